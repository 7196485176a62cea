"""Drafting with an EAGLE-3 head (decoding.eagle3_head) fed by the target's features.

The head's entry at position p reads the target's fused feature at p and the token at p + 1, and
its output scores the token at p + 2 (EAGLE-3 at inference, as vLLM's and SGLang's proposers).
After a round commits, the target has computed features for every committed position but the
last (the bonus or recovered token was never fed), so a sequence with committed history x_0..x_n
has head entries 0..n-1 from target features, and the last of them scores the first draft token.
Each further draft token is one head step at the next position whose feature is the head's own
pre-norm output of the step before (the target's is not known yet). Those speculative entries
are never kept: the next round crops back to the committed ones and feeds the target's features
of the newly committed positions in their place.

Exactness: the head scores its reduced vocabulary; its rows are placed at their target ids with
-inf elsewhere before any processing (Eagle3Head.target_logits), so q over the target's
vocabulary is zero where the head cannot propose and the token is drawn from exactly the q that
verification receives (decoding.proposers.draft_step), as for a draft model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specserve.decoding.block_manager import common_prefix_length
from specserve.decoding.eagle3_checkpoint import LoadedHead
from specserve.decoding.eagle3_head import HeadKV, HeadStep
from specserve.decoding.errors import SequenceStateError
from specserve.decoding.proposers import Drafting, Proposal, ProposeCall, draft_step, empty_proposal
from specserve.decoding.row_processors import history_processor
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.target_features import TargetFeatures, merged_features


@dataclass(frozen=True)
class DraftedBlock:
    """The block a sequence last drafted, kept until its outcome is known so that pre-drafts for
    the likely outcomes (decoding.speculation_cache) can start from it: the history it continued
    (n = len(history) - 1), its tokens, the entries drafting wrote after the committed ones (in kv:
    entry n + i read tokens[i]) and the head's own features that fed them (prenorms[i]: the
    pre-norm output of entry n - 1 + i, the feature of entry n + i)."""

    history: tuple[int, ...]
    tokens: tuple[int, ...]
    kv: HeadKV
    prenorms: tuple[torch.Tensor, ...]


@dataclass
class HeadSequence:
    """One sequence's head state: entries 0..len(tokens)-1 computed from the target's features
    (their keys and values in `kv`, whose slots past them are scratch), the tokens they read
    (entry p read token p + 1), the last entry's output, and target features not yet made entries
    (from `pending_start`)."""

    kv: HeadKV | None = None
    tokens: list[int] = field(default_factory=list)
    last_logits: torch.Tensor | None = None    # [draft_vocab] the last entry's scores
    last_prenorm: torch.Tensor | None = None   # [hidden] its pre-norm output
    pending_start: int = 0
    pending: torch.Tensor | None = None        # [n, 3 x target hidden]
    block: DraftedBlock | None = None          # the last block drafted for pre-drafts to start from

    @property
    def num_entries(self) -> int:
        return len(self.tokens)

    def crop(self, num_entries: int) -> None:
        """Keep entries 0..num_entries-1 (their output is no longer the last one's when cropped)."""
        if num_entries < self.num_entries:
            self.tokens = self.tokens[:num_entries]
            self.last_logits = self.last_prenorm = None

    def add_features(self, features: TargetFeatures) -> None:
        """The target's features of positions features.start, ...: they replace any pending ones
        from that position on (a forward recomputing positions gives them afresh)."""
        pending = None if self.pending is None else TargetFeatures(self.pending_start, self.pending)
        merged = merged_features(pending, features)
        self.pending_start, self.pending = merged.start, merged.hidden


@dataclass
class _HeadDraft:
    """One call's block while the head drafts it: the sequence's entries (the committed ones, then
    the drafted ones written after them, which the next round writes over) and the last entry's
    output."""

    index: int                 # the call's place in propose_batch's calls
    drafting: Drafting
    logits: torch.Tensor       # [draft_vocab] the next token's scores
    prenorm: torch.Tensor      # [hidden] the next head step's feature
    kv: HeadKV
    position: int              # the next entry's position
    prenorms: list[torch.Tensor] = field(default_factory=list)   # every feature the block's steps read

    def take(self, step: HeadStep) -> None:
        """The head's one-row step over this block's last drafted token."""
        self.logits, self.prenorm, self.position = step.logits[0], step.prenorm[0], self.position + 1
        self.prenorms.append(self.prenorm)


class Eagle3Proposer:
    """Proposes with an EAGLE-3 head; `observe` hands it the target's features of each forward.

    reads_target_features tells the round loop (decoding.generate) to run the target with its
    aux layers' features and pass them on."""

    reads_target_features = True

    def __init__(self, loaded: LoadedHead, max_candidates: int | None = None) -> None:
        """max_candidates: as DraftModelProposer's (a sampled token is drawn from its row's top
        max_candidates tokens renormalised; None: the whole row). A head drafting from a reduced
        vocabulary has no more tokens than that to offer a row: its q is never wider."""
        self.head = loaded.head
        self.aux_layers = loaded.aux_layers
        self.vocab_size = loaded.head.shape.vocab_size
        draft_vocab = loaded.head.shape.draft_vocab_size
        self.max_candidates = (max_candidates if draft_vocab >= self.vocab_size
                               else min(max_candidates or draft_vocab, draft_vocab))
        self.sequences: dict[str, HeadSequence] = {}

    def observe(self, seq_id: str, features: TargetFeatures) -> None:
        """The target's features from a forward over seq_id (positions it computed, whether or
        not they are committed: `propose` takes the committed ones)."""
        hidden = features.hidden.to(device=self.device, dtype=self.head.fc.weight.dtype)
        self.sequences.setdefault(seq_id, HeadSequence()).add_features(TargetFeatures(features.start, hidden))

    @property
    def device(self) -> torch.device:
        """Where the head runs (its requests' draft generators live there too)."""
        return self.head.fc.weight.device

    def propose(self, seq_id: str, history: Sequence[int], num_tokens: int, params: SamplingParams,
                generator: torch.Generator | None = None, prompt_len: int | None = None) -> Proposal:
        return self.propose_batch([ProposeCall(seq_id, history, num_tokens, params, generator, prompt_len)])[0]

    @torch.inference_mode()
    def propose_batch(self, calls: Sequence[ProposeCall]) -> list[Proposal]:
        """Up to num_tokens head steps per call, the calls drafting together: each step draws one
        token for every call still drafting, in one batched draw (decoding.proposers.draft_step,
        each row with its own generator, so a seeded request's block does not depend on what it
        shares a step with), and runs the head once over all of their rows
        (Eagle3Head.step_sequences), so the head's weights are read once a step, not once a
        request; the calls' entries from the target's features are made together first, the same way."""
        proposals = [empty_proposal() for _ in calls]
        drafting = [(index, call, list(call.history)) for index, call in enumerate(calls)
                    if call.num_tokens > 0 and len(call.history) >= 2]
        sequences = self._caught_up([(call.seq_id, history) for _, call, history in drafting])
        # Each call's next entry's position is its last committed token's.
        live = [_HeadDraft(index, Drafting(call, call.num_tokens, history[:]), sequence.last_logits,
                           sequence.last_prenorm, sequence.kv, len(history) - 1, [sequence.last_prenorm])
                for (index, call, history), sequence in zip(drafting, sequences)]
        while live:
            rows = self.head.target_logits(torch.stack([draft.logits for draft in live]), self.vocab_size).float()
            for draft in live:
                call = draft.drafting.call
                if draft.drafting.processor is None and call.params.uses_history:
                    draft.drafting.processor = history_processor(call.params, call.history, call.prompt_len,
                                                                 rows.shape[-1], rows.device, None)
            drawn = draft_step(rows, [draft.drafting.call for draft in live],
                               [draft.drafting.processor for draft in live],
                               [not draft.drafting.drafted for draft in live], self.max_candidates)
            going = []
            for draft, (token, top, q, odds) in zip(live, drawn):
                call = draft.drafting.call
                draft.drafting.advance(token, top, q, odds)
                if draft.drafting.done:
                    proposals[draft.index] = draft.drafting.proposal()
                    # Kept where the draft engine pre-drafts its outcomes (it asks for candidates then).
                    self.sequences[call.seq_id].block = DraftedBlock(
                        tuple(call.history), tuple(proposals[draft.index].token_ids), draft.kv,
                        tuple(draft.prenorms)) if call.num_candidates else None
                else:
                    going.append((draft, token))
            live = [draft for draft, _ in going]
            if live:
                steps = self.head.step_sequences(torch.tensor([token for _, token in going], device=rows.device),
                                                 torch.stack([draft.prenorm for draft in live]),
                                                 [draft.position for draft in live], [1] * len(live),
                                                 [draft.kv for draft in live])
                for draft, step in zip(live, steps):
                    draft.take(step)
        return proposals

    @torch.inference_mode()
    def fork(self, parent_id: str, branch_id: str, history: Sequence[int]) -> bool:
        """A pre-draft's sequence for one outcome of verifying parent_id's last block: history
        continues the parent's committed history with the block's first tokens and, where the
        outcome rejected one, the token emitted instead (decoding.speculation_cache.Predraft).
        Its entries are the parent's committed ones, then the block's own (drafted from the
        head's own features, as SSD's EAGLE mode pre-drafts: the target's features of those
        positions are not computed yet), and one made now for its last token, from the feature
        the block's step before it produced; the branch drafts from that entry's output. -> False
        (nothing made) when history does not continue the block so."""
        parent = self.sequences.get(parent_id)
        block = None if parent is None else parent.block
        if block is None:
            return False
        history = list(history)
        start, last = len(block.history) - 1, len(history) - 2   # the block's first entry; the branch's last
        drafted = last - start                                   # block entries the branch keeps
        if not (0 <= drafted < len(block.tokens) and tuple(history[:start + 1]) == block.history
                and tuple(history[start + 1:last + 1]) == block.tokens[:drafted]):
            return False
        kv = self.head.new_kv()
        kv.write(0, *block.kv.entries(last))
        step = self.head.step_sequences(torch.tensor([history[last + 1]], device=self.device),
                                        block.prenorms[drafted].unsqueeze(0), [last], [1], [kv])[0]
        self.sequences[branch_id] = HeadSequence(kv, history[1:last + 2], step.logits[0], step.prenorm[0])
        return True

    def adopt(self, seq_id: str, branch_id: str) -> None:
        """The round continued branch_id's history and took its block: the next pre-drafts start
        from that block. seq_id's committed entries stay its own (the next propose makes the new
        positions' from the target's features); the branch's state goes."""
        branch = self.sequences.pop(branch_id, None)
        if branch is not None and seq_id in self.sequences:
            self.sequences[seq_id].block = branch.block

    def missing_features(self, seq_id: str, history: Sequence[int]) -> int | None:
        """The position from which seq_id's next propose over history needs target features this
        proposer does not hold (a draft engine that never saw the request, or lost them), else
        None. The caller gets the target's features from there on and observes them."""
        if len(history) < 2:
            return None
        sequence = self.sequences.get(seq_id) or HeadSequence()
        start, wanted = _entries_to_make(sequence, list(history))
        return None if start == wanted or _holds(sequence, start, wanted) else start

    def _caught_up(self, histories: list[tuple[str, list[int]]]) -> list[HeadSequence]:
        """Each (seq_id, history)'s entries made to cover positions 0..len(history)-2 from the
        target's features, the last entry's output kept (the first draft token's scores): the
        entries every sequence lacks are made in one batched head call."""
        sequences, making = [], []
        for seq_id, history in histories:
            sequence = self.sequences.setdefault(seq_id, HeadSequence())
            start, wanted = _entries_to_make(sequence, history)
            sequence.crop(start)   # an entry whose output was let go is computed again
            sequences.append(sequence)
            if start == wanted:
                continue
            if not _holds(sequence, start, wanted):
                pending = sequence.pending
                have = "none" if pending is None else \
                    f"{sequence.pending_start}..{sequence.pending_start + pending.shape[0] - 1}"
                raise SequenceStateError(f"{seq_id}: the EAGLE-3 head needs the target's features of positions "
                                         f"{start}..{wanted - 1}, it has {have} (the target, run with the head's "
                                         "aux layers, must return the features of every position it has not returned)")
            making.append((sequence, history, start, wanted))
        if not making:
            return sequences
        head = self.head
        for sequence, _, _, _ in making:
            if sequence.kv is None:
                sequence.kv = head.new_kv()
        features = torch.cat([sequence.pending[start - sequence.pending_start:wanted - sequence.pending_start]
                              for sequence, _, start, wanted in making])
        tokens = [token for _, history, start, wanted in making for token in history[start + 1:wanted + 1]]
        steps = head.step_sequences(torch.tensor(tokens, device=features.device), head.fuse(features),
                                    [start for _, _, start, _ in making],
                                    [wanted - start for _, _, start, wanted in making],
                                    [sequence.kv for sequence, _, _, _ in making])
        for (sequence, history, start, wanted), step in zip(making, steps):
            sequence.tokens.extend(history[start + 1:wanted + 1])
            sequence.last_logits, sequence.last_prenorm = step.logits[-1], step.prenorm[-1]
            # Features of positions from `wanted` on were computed over tokens not committed (or
            # are the next round's): the next forward gives them again.
            sequence.pending = None
        return sequences

    def release(self, seq_id: str) -> None:
        self.sequences.pop(seq_id, None)


def _entries_to_make(sequence: HeadSequence, history: list[int]) -> tuple[int, int]:
    """(start, wanted): the entries history needs are 0..wanted-1 (one per position but the last);
    those from start on must be made from the target's features (start == wanted: none). Entries
    that read tokens history no longer has go, and so does the last kept one when its output was
    let go (it is computed again)."""
    wanted = len(history) - 1
    agreed = common_prefix_length(sequence.tokens, history[1:], wanted)
    kept_output = agreed == sequence.num_entries and sequence.last_logits is not None
    if kept_output and agreed == wanted:
        return wanted, wanted
    return (agreed if kept_output or agreed == 0 else agreed - 1), wanted


def _holds(sequence: HeadSequence, start: int, wanted: int) -> bool:
    """The sequence's pending target features cover positions start..wanted-1."""
    return (sequence.pending is not None and sequence.pending_start <= start
            and sequence.pending_start + sequence.pending.shape[0] >= wanted)
