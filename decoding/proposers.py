"""Proposers: where draft tokens come from."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specserve.decoding.grammar import GrammarDeadEndError, GrammarMatchers
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.row_processors import HistoryProcessor, RowBatch, history_processor
from specserve.decoding.compact_verify import DraftSupport, draft_support
from specserve.decoding.sampling import RowParams, SamplingParams, process_rows, sample_rows


@dataclass
class Proposal:
    token_ids: list[int]              # K proposed tokens (may be fewer than asked, even 0)
    # The q each token was sampled from, as (ids, probs) [K, m] (decoding.compact_verify; numpy on
    # the wire); None: greedy or deterministic (q one-hot at the token).
    support: DraftSupport | None
    draft_version: int = 0            # the draft weights that drafted it (0: those the server started with)
    # The draft's most likely tokens at each drafted position, best first (asked for with
    # ProposeCall.num_candidates): where the speculation cache looks for the target's token. The
    # draft engine keeps them; they never leave it.
    candidates: list[list[int]] | None = None
    # Set by the draft engine: the block was pre-drafted during the last verify (a speculation
    # cache hit, decoding.speculation_cache), and the pre-drafted tokens thrown away when this
    # round's outcome was known.
    cached: bool = False
    predrafted_thrown_away: int = 0
    # The draft stream's state after each token drawn (asked for with ProposeCall.keep_stream_states;
    # engine-internal): a pre-draft that is used leaves the request's stream where drafting its
    # block just in time would have.
    stream_states: list[torch.Tensor] | None = None


@dataclass
class ProposeCall:
    """One request's share of a batched propose (the arguments of `Proposer.propose`)."""

    seq_id: str
    history: Sequence[int]
    num_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_len: int | None = None  # tokens of history that are prompt (penalties count the rest as output)
    num_candidates: int = 0        # also return the draft's top tokens at each position (Proposal.candidates)
    guess_first: bool = False      # the first token is the draft's argmax, drawn with no randomness (a guess)
    keep_stream_states: bool = False  # return the generator's state after each draw (Proposal.stream_states)


@dataclass
class Drafting:
    """One call's block while it is drafted (DraftModelProposer.start, then a token per `step`)."""

    call: ProposeCall
    budget: int                      # tokens it may draft (fewer near the draft's context end; 0: none)
    history: list[int]               # the call's history and the tokens drafted so far
    matcher: object | None = None    # the call's grammar matcher, synced to its history
    processor: HistoryProcessor | None = None
    drafted: list[int] = field(default_factory=list)
    ranked: list[list[int]] = field(default_factory=list)
    q_rows: list[DraftSupport] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.drafted) >= self.budget

    def advance(self, token: int | None, top: list[int] | None, q: DraftSupport | None) -> None:
        """Take one step's token (None: the grammar allows nothing here; the target will say so,
        the draft just stops)."""
        if token is None:
            self.budget = len(self.drafted)
            return
        call = self.call
        if top is not None:
            self.ranked.append(top)
        if q is not None:
            self.q_rows.append(q)
        if call.keep_stream_states and call.generator is not None and not (call.guess_first and not self.drafted):
            self.states.append(call.generator.get_state())
        if self.processor is not None:
            self.processor.advance([token])
        self.drafted.append(token)
        self.history.append(token)

    def proposal(self) -> Proposal:
        if not self.drafted:
            return empty_proposal()
        return Proposal(token_ids=self.drafted, support=None if self.call.params.is_greedy else
                        DraftSupport.stack(self.q_rows), candidates=self.ranked or None,
                        stream_states=self.states if self.call.keep_stream_states else None)


def reads_target_features(proposer: object) -> bool:
    """The proposer drafts from the target's hidden features (an EAGLE-3 head): the round runs the
    target with its aux layers' features and hands each forward's to `proposer.observe`."""
    return bool(getattr(proposer, "reads_target_features", False))


def empty_proposal() -> Proposal:
    """No draft tokens: the round degenerates to one plain target step."""
    return Proposal(token_ids=[], support=None)


class Proposer(Protocol):
    def propose(self, seq_id: str, history: Sequence[int], num_tokens: int, params: SamplingParams,
                generator: torch.Generator | None = None, prompt_len: int | None = None) -> Proposal:
        """Propose up to num_tokens continuing history (prompt + committed output; its first
        prompt_len tokens are the prompt, which penalties need to know)."""

    def propose_batch(self, calls: Sequence[ProposeCall]) -> list[Proposal]:
        """`propose` for every call (distinct seq_ids), batched where the proposer can."""

    def release(self, seq_id: str) -> None:
        """Drop any per-sequence state (idempotent)."""


class DraftModelProposer:
    """A small causal LM drafting autoregressively over an engine (KV cache reused across rounds).

    Every step of `propose_batch` is one draft forward for all the requests still drafting, through
    the engine's `forward_batch` (decoding.scheduler.Scheduler; the tests' reference runner has the
    same protocol).

    grammars: the matchers of structured-output requests (one per sequence); with them the draft
    rows are masked as the target's will be, so the draft never proposes a token the grammar
    forbids. None drafts such requests unmasked (still lossless: the target rejects what the
    grammar forbids; bench.figures.structured_outputs measures the difference)."""

    def __init__(self, runner: Any, grammars: GrammarMatchers | None = None,
                 max_candidates: int | None = None) -> None:
        """max_candidates: a sampled draft token is drawn from its processed row's top
        max_candidates tokens renormalised (decoding.compact_verify.draft_support), which is the q
        verified against; None: the whole row (`speculation.draft_top_k` on the served path).
        runner: what the draft forwards run on (a Scheduler: forward_batch, release, max_context)."""
        self.runner = runner
        self.grammars = grammars
        self.max_candidates = max_candidates

    def propose(self, seq_id: str, history: Sequence[int], num_tokens: int, params: SamplingParams,
                generator: torch.Generator | None = None, prompt_len: int | None = None) -> Proposal:
        """Draft up to num_tokens tokens, one draft forward each. Greedy drafts are the argmax chain
        (support None); sampled drafts are drawn with `generator` from the logits_to_probs rows cut
        to max_candidates tokens, and those q rows are returned as (ids, probs) [K, m] for verification. Penalties and grammar masks see
        history plus the tokens drafted so far, as the target's verify rows will (decoding.row_processors).

        Fewer tokens are drafted when the draft model's context would overflow."""
        return self.propose_batch([ProposeCall(seq_id, history, num_tokens, params, generator, prompt_len)])[0]

    def propose_batch(self, calls: Sequence[ProposeCall]) -> list[Proposal]:
        """`propose` for every call (distinct seq_ids) in max(num_tokens) batched draft steps
        (`start`, then `step` while any is drafting)."""
        drafts = [self.start(call) for call in calls]
        while drafting := [draft for draft in drafts if not draft.done]:
            self.step(drafting)
        return [draft.proposal() for draft in drafts]

    def start(self, call: ProposeCall) -> Drafting:
        """A block to draft for call, one `step` at a time: no forward yet."""
        # The last drafted token is never fed, so the draft sees at most len(history) + K - 1 tokens.
        budget = max(0, min(call.num_tokens, self.runner.max_context - len(call.history) + 1))
        matcher = self._grammar(call) if budget > 0 else None
        return Drafting(call, 0 if matcher is False else budget, list(call.history), matcher or None)

    def step(self, drafts: Sequence[Drafting]) -> None:
        """One draft forward for drafts (distinct seq_ids, none done), each advanced by one token.

        A draft's first step brings its row's history up to date (several new tokens for a row
        whose last round accepted some); each later step feeds one token. Each row is drawn with
        its own generator, so a seeded request's draft does not depend on what else shares the
        step, nor on which steps it shared: a draft engine may start new drafts between the steps
        of others (continuous batching), and each block is the one drafting it alone draws."""
        logits = self.runner.forward_batch([ForwardCall(draft.call.seq_id, draft.history, 1) for draft in drafts])
        rows = torch.cat([row_logits[-1:] for row_logits in logits])
        for draft in drafts:  # built on the first step, where the rows' width and device are known
            if draft.processor is None and draft.call.params.uses_history:
                draft.processor = history_processor(draft.call.params, draft.call.history, draft.call.prompt_len,
                                                    rows.shape[-1], rows.device, draft.matcher)
        step = draft_step(rows, [draft.call for draft in drafts], [draft.processor for draft in drafts],
                          [not draft.drafted for draft in drafts], self.max_candidates)
        for draft, (token, top, q) in zip(drafts, step):
            draft.advance(token, top, q)

    def _grammar(self, call: ProposeCall):
        """The call's grammar matcher synced to its history, None (no grammar, or drafting
        unmasked), or False: the history is speculative and the grammar refuses it (a block
        drafted ahead past EOS), so there is nothing worth drafting."""
        spec = call.params.structured
        if spec is None or self.grammars is None:
            return None
        if call.prompt_len is None:
            raise ValueError("a structured output needs the prompt's length to find its output")
        matcher = self.grammars.synced(call.seq_id, spec, call.history[call.prompt_len:])
        return False if matcher is None else matcher

    def release(self, seq_id: str) -> None:
        self.runner.release(seq_id)
        if self.grammars is not None:
            self.grammars.release(seq_id)


def draft_step(logits: torch.Tensor, calls: Sequence[ProposeCall], processors: Sequence[HistoryProcessor | None],
               first: Sequence[bool], max_candidates: int | None = None,
               ) -> list[tuple[int | None, list[int] | None, DraftSupport | None]]:
    """One draft step for the rows logits [B, V] (row j: calls[j]'s next token), in batched
    tensor ops on the rows' device: penalties and grammar masks (decoding.row_processors.RowBatch),
    one argmax for the greedy rows (and a pre-draft's guessed first token), the sampled rows'
    processing (decoding.sampling.process_rows) cut to max_candidates (draft_support) and drawn
    each with its request's generator, and ONE transfer of the chosen ids (and the candidates
    asked for) to the host. Per row: (token, its candidates or None, the q it was drawn from
    (None when greedy)); token None where the row's grammar allows nothing. The caller advances
    processors[j] by the token. first[j]: the row is its call's first token (a pre-draft guesses
    it when call.guess_first). max_candidates as DraftModelProposer's."""
    batch, dead = RowBatch(), set()
    for j, (call, processor) in enumerate(zip(calls, processors)):
        if processor is not None:
            try:
                processor.contribute(batch, j, 1)
            except GrammarDeadEndError:
                dead.add(j)
    logits = batch.apply(logits)
    tokens = logits.argmax(dim=-1)
    guessing = {j for j, call in enumerate(calls) if call.guess_first and first[j]}
    sampled = [j for j, call in enumerate(calls) if not call.params.is_greedy]
    supports: dict[int, DraftSupport] = {}
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        q = draft_support(process_rows(logits[rows], RowParams.of([calls[j].params for j in sampled],
                                                                  logits.shape[-1], logits.device)),
                          max_candidates)
        drawing = [k for k, j in enumerate(sampled) if j not in guessing]
        if drawing:
            pick = sample_rows(q.probs[drawing], [calls[sampled[k]].generator for k in drawing])
            chosen = q.ids[drawing].gather(-1, pick.unsqueeze(-1)).squeeze(-1)
            tokens = tokens.index_copy(0, rows[drawing], chosen)
        for k, j in enumerate(sampled):
            # A guess's row is one-hot at it, so the q rows stay one per token (it is never verified).
            probs = (q.ids[k] == tokens[j]).to(q.probs.dtype) if j in guessing else q.probs[k]
            supports[j] = DraftSupport(q.ids[k], probs)
    num_candidates = max((call.num_candidates for call in calls), default=0)
    if num_candidates:
        top = torch.topk(logits, min(num_candidates, logits.shape[-1]), dim=-1).indices
        on_host = torch.cat([tokens.unsqueeze(-1), top], dim=-1).tolist()
    else:
        on_host = tokens.unsqueeze(-1).tolist()
    return [(None, None, None) if j in dead else
            (row[0], row[1:1 + call.num_candidates] if call.num_candidates else None, supports.get(j))
            for j, (call, row) in enumerate(zip(calls, on_host))]


class NgramProposer:
    """Prompt lookup: continue the longest suffix of history (n from max_ngram down to min_ngram)
    that occurred earlier in history with the tokens that followed it. No model, no state."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, seq_id: str, history: Sequence[int], num_tokens: int, params: SamplingParams,
                generator: torch.Generator | None = None, prompt_len: int | None = None) -> Proposal:
        """The up-to-num_tokens tokens that followed the most recent earlier occurrence of the
        longest matching suffix; empty when no suffix of length >= min_ngram recurs."""
        length = len(history)
        if num_tokens <= 0 or length < 2:
            return empty_proposal()
        ids = torch.as_tensor(list(history), dtype=torch.long)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # Windows starting at 0 .. length-n-1: each is followed by at least one token.
            windows = ids[:-1].unfold(0, n, 1)
            matches = (windows == ids[-n:]).all(dim=1).nonzero()
            if matches.numel() > 0:
                start = int(matches[-1]) + n
                return Proposal(token_ids=ids[start:start + num_tokens].tolist(), support=None)
        return empty_proposal()

    def propose_batch(self, calls: Sequence[ProposeCall]) -> list[Proposal]:
        """`propose` for each call (a lookup has no forward to share)."""
        return [self.propose(call.seq_id, call.history, call.num_tokens, call.params, call.generator)
                for call in calls]

    def release(self, seq_id: str) -> None:
        """Stateless: nothing to drop."""


@dataclass(frozen=True)
class ProposerKind:
    """One way of proposing draft tokens, as config validation and the draft engine both see it.

    needs_model: it drafts with a draft checkpoint: the config must set `draft.path`, and the engine
    loads it into a runner (which draft training may hot-swap). build makes the proposer in the
    draft engine from the engine's scheduler over that runner, through which its forwards are planned
    (None when needs_model is False), the draft model's spec (None likewise) and the engine's options
    (`SpecServeConfig.engine_options`)."""

    needs_model: bool
    build: Callable[[Any, Mapping[str, Any] | None, Mapping[str, Any]], Proposer]
    description: str
    # It reads draft.path without a runner (an EAGLE-3 head: the config must set it, the engine
    # hands the spec to build).
    needs_path: bool = False


def _draft_model_proposer(runner: Any, model_spec: Mapping[str, Any] | None,
                          engine_options: Mapping[str, Any]) -> DraftModelProposer:
    assert runner is not None and model_spec is not None, "a draft-model proposer needs its runner and spec"
    grammars = GrammarMatchers.for_runner(runner, model_spec.get("tokenizer_path") or model_spec["path"])
    return DraftModelProposer(runner, grammars, engine_options.get("draft_top_k"))


def _eagle3_proposer(runner: Any, model_spec: Mapping[str, Any] | None, engine_options: Mapping[str, Any]):
    """The head in model_spec["path"] over the target's embeddings, read from model_spec["target_path"]
    (the draft engine loads those, not the target's layers)."""
    from specserve.decoding.checkpoint import resolve_device, resolve_dtype
    from specserve.decoding.eagle3_checkpoint import load_eagle3_head, target_embeddings
    from specserve.decoding.eagle3_proposer import Eagle3Proposer

    assert model_spec is not None and "target_path" in model_spec, "a head needs its spec and its target's path"
    device = resolve_device(model_spec["device"])
    target = target_embeddings(model_spec["target_path"],
                               resolve_dtype(model_spec["dtype"], model_spec["target_path"], device), device)
    return Eagle3Proposer(load_eagle3_head(model_spec["path"], target), engine_options.get("draft_top_k"))


# Every proposer `speculation.proposer` can name: an entry here is all a new one needs (the config
# accepts its name, the draft engine builds it). NO_PROPOSER, target-only, is the absence of one.
PROPOSERS: dict[str, ProposerKind] = {
    "draft": ProposerKind(True, _draft_model_proposer, "a draft model drafting autoregressively (draft.path)"),
    "eagle3": ProposerKind(False, _eagle3_proposer, "an EAGLE-3 head (draft.path) fed the target's hidden features "
                           "each round (docs/eagle3.md)", needs_path=True),
    "ngram": ProposerKind(False, lambda runner, model_spec, engine_options: NgramProposer(),
                          "prompt lookup: continue a suffix that occurred earlier in the text, no model"),
}
NO_PROPOSER = "none"


def proposer_kind(name: str) -> ProposerKind:
    """The registered proposer called name; a ValueError naming the choices for any other name."""
    if name not in PROPOSERS:
        raise ValueError(f"unknown proposer {name!r}: choose one of {sorted(PROPOSERS)} or {NO_PROPOSER!r}")
    return PROPOSERS[name]
