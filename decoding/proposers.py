"""Proposers: where draft tokens come from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specserve.decoding.grammar import GrammarDeadEndError, GrammarMatchers
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.row_processors import HistoryProcessor, RowBatch, history_processor
from specserve.decoding.compact_verify import DraftSupport, draft_support, saguaro_support
from specserve.decoding.device_copy import index_on
from specserve.decoding.draft_odds import DraftOdds
from specserve.decoding.sampling import RowParams, SamplingParams, greedy_ids, process_rows, sample_rows


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
    # The draft's own numbers at each drafted position (with candidates): what the fan-out is
    # shared out by (policies.fan_out.share_fan_out). Engine-internal like candidates.
    odds: list[DraftOdds] | None = None
    # Set by the draft engine: the block was pre-drafted during the last verify (a speculation
    # cache hit, decoding.speculation_cache), and the pre-drafted tokens thrown away when this
    # round's outcome was known.
    cached: bool = False
    predrafted_thrown_away: int = 0
    # The draft stream's state after each token drawn (asked for with ProposeCall.keep_stream_states;
    # engine-internal): a pre-draft that is used leaves the request's stream where drafting its
    # block just in time would have.
    stream_states: list[torch.Tensor] | None = None


# How many of a sampled draft row's likeliest tokens Saguaro sampling lowers: those the speculation
# cache pre-drafts for at a rejected position (the drafted token may be one of them).
SAGUARO_LOWERED = 3


@dataclass(frozen=True)
class SaguaroSampling:
    """How a sampled draft lowers its top tokens (decoding.compact_verify.saguaro_support):
    the num_lowered most likely tokens of each row, scaled by downweight."""

    num_lowered: int
    downweight: float

    def __post_init__(self) -> None:
        if self.num_lowered < 0 or not 0.0 < self.downweight <= 1.0:
            raise ValueError(f"Saguaro sampling needs num_lowered >= 0 and downweight in (0, 1], got "
                             f"{self.num_lowered}, {self.downweight}")


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
    guess_rank: int | None = None  # the first token is the draft's guess_rank-th likeliest, drawn with no randomness
    keep_stream_states: bool = False  # return the generator's state after each draw (Proposal.stream_states)
    lowered: bool = False          # a sampled row draws from its Saguaro-lowered q (DraftModelProposer.saguaro)


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
    odds: list[DraftOdds] = field(default_factory=list)
    q_rows: list[DraftSupport] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.drafted) >= self.budget

    def advance(self, token: int | None, top: list[int] | None, q: DraftSupport | None,
                odds: DraftOdds | None = None) -> None:
        """Take one step's token (None: the grammar allows nothing here; the target will say so,
        the draft just stops)."""
        if token is None:
            self.budget = len(self.drafted)
            return
        call = self.call
        if top is not None:
            self.ranked.append(top)
        if odds is not None:
            self.odds.append(odds)
        if q is not None:
            self.q_rows.append(q)
        if call.keep_stream_states and call.generator is not None and not (call.guess_rank is not None and not self.drafted):
            self.states.append(call.generator.get_state())
        if self.processor is not None:
            self.processor.advance([token])
        self.drafted.append(token)
        self.history.append(token)

    def proposal(self) -> Proposal:
        if not self.drafted:
            return empty_proposal()
        return Proposal(token_ids=self.drafted, support=None if self.call.params.is_greedy else
                        DraftSupport.stack(self.q_rows), candidates=self.ranked or None, odds=self.odds or None,
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
                 max_candidates: int | None = None, saguaro: SaguaroSampling | None = None) -> None:
        """max_candidates: a sampled draft token is drawn from at most this many of its processed
        row's likely tokens renormalised (decoding.compact_verify.draft_support), which is the q
        verified against; None: the whole row (`speculation.draft_top_k` on the served path).
        runner: what the draft forwards run on (a Scheduler: forward_batch, release, max_context).
        saguaro: sampled drafts lower their top tokens so that a rejection's residual lands on the
        tokens the speculation cache pre-drafts for (`speculation.saguaro_downweight`); None: q as it is."""
        self.runner = runner
        self.saguaro = saguaro
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
        logits = self.runner.forward_batch([ForwardCall(draft.call.seq_id, draft.history, 1,
                                                        over_map=draft.call.params.is_greedy) for draft in drafts])
        rows = torch.cat([row_logits[-1:] for row_logits in logits])
        for draft in drafts:  # built on the first step, where the rows' width and device are known
            if draft.processor is None and draft.call.params.uses_history:
                draft.processor = history_processor(draft.call.params, draft.call.history, draft.call.prompt_len,
                                                    rows.shape[-1], rows.device, draft.matcher)
        step = draft_step(rows, [draft.call for draft in drafts], [draft.processor for draft in drafts],
                          [not draft.drafted for draft in drafts], self.max_candidates, self.saguaro)
        for draft, (token, top, q, odds) in zip(drafts, step):
            draft.advance(token, top, q, odds)

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
               first: Sequence[bool], max_candidates: int | None = None, saguaro: SaguaroSampling | None = None,
               ) -> list[tuple[int | None, list[int] | None, DraftSupport | None, DraftOdds | None]]:
    """One draft step for the rows logits [B, V] (row j: calls[j]'s next token), in batched
    tensor ops on the rows' device: penalties and grammar masks (decoding.row_processors.RowBatch),
    one argmax for the greedy rows, the sampled rows' processing (decoding.sampling.process_rows)
    cut to max_candidates (draft_support), lowered by saguaro (compact_verify.saguaro_support)
    where the call asks (ProposeCall.lowered), and drawn each with its request's generator, and ONE transfer of the chosen ids (and the
    candidates and odds asked for) to the host. Per row: (token, its candidates or None, the q it
    was drawn from (None when greedy), its DraftOdds or None); token None where the row's grammar
    allows nothing. The caller advances processors[j] by the token. first[j]: the row is its call's
    first token (a pre-draft guesses it when call.guess_rank is set: the row's guess_rank-th most
    likely token, no draw). max_candidates as DraftModelProposer's."""
    batch, dead = RowBatch(), set()
    for j, (call, processor) in enumerate(zip(calls, processors)):
        if processor is not None:
            try:
                processor.contribute(batch, j, 1)
            except GrammarDeadEndError:
                dead.add(j)
    logits = batch.apply(logits)
    sampled = [j for j, call in enumerate(calls) if not call.params.is_greedy]
    all_sampled = len(sampled) == len(calls)
    # The greedy rows' tokens (a sampled row's is drawn below, so an all-sampled step needs none)
    tokens = (torch.zeros(len(calls), dtype=torch.long, device=logits.device) if all_sampled
              else greedy_ids(logits))
    guesses = {j: call.guess_rank for j, call in enumerate(calls) if call.guess_rank is not None and first[j]}
    num_candidates = max((call.num_candidates for call in calls), default=0)
    width = min(max([num_candidates, *(rank + 1 for rank in guesses.values())]), logits.shape[-1])
    # The draft's processed rows (the target's stand-in when its odds are guessed): softmax for
    # greedy rows, process_rows for sampled ones. Ranked once, for candidates and guesses alike.
    own = torch.softmax(logits.float(), dim=-1) if width and not all_sampled else None
    supports: dict[int, DraftSupport] = {}
    if sampled:
        rows = index_on(sampled, logits.device)
        row_params = RowParams.of([calls[j].params for j in sampled], logits.shape[-1], logits.device)
        processed = process_rows(rows_at(logits, sampled, rows), row_params, exact_cut=False)
        if width:
            own = processed if own is None else own.index_copy(0, rows, processed)
        cut = (row_params.uses_top_k or row_params.uses_top_p or row_params.uses_min_p
               or any(processors[j] is not None for j in sampled))   # a grammar's mask zeroes tokens too
        q = draft_support(processed, max_candidates, cut)
        lowering = [k for k, j in enumerate(sampled) if calls[j].lowered] if saguaro is not None else []
        if lowering:
            rows_lowered = index_on(lowering, logits.device)
            lowered = DraftSupport(q.ids.index_select(0, rows_lowered), q.probs.index_select(0, rows_lowered))
            down = saguaro_support(lowered, saguaro.num_lowered, saguaro.downweight)
            q = DraftSupport(q.ids, q.probs.index_copy(0, rows_lowered, down.probs))
        drawing = [k for k, j in enumerate(sampled) if j not in guesses]
        if drawing:
            at = index_on(drawing, logits.device)
            pick = sample_rows(rows_at(q.probs, drawing, at), [calls[sampled[k]].generator for k in drawing])
            chosen = rows_at(q.ids, drawing, at).gather(-1, pick.unsqueeze(-1)).squeeze(-1)
            tokens = tokens.index_copy(0, rows.index_select(0, at), chosen)
    top = torch.topk(own, width, dim=-1) if width else None
    if guesses:
        guessed = index_on(list(guesses), logits.device)
        ranks = index_on(list(guesses.values()), logits.device)
        tokens = tokens.index_copy(0, guessed, top.indices[guessed, ranks])
    if sampled:
        # What each sampled row was drawn from: its q, but a guess's row is one-hot at the guess,
        # so the q rows stay one per token (a guess is never verified).
        drawn_probs = q.probs
        guessed_rows = [k for k, j in enumerate(sampled) if j in guesses]
        if guessed_rows:
            at = index_on(guessed_rows, logits.device)
            guessed_tokens = tokens.index_select(0, rows.index_select(0, at))
            one_hot = (q.ids.index_select(0, at) == guessed_tokens.unsqueeze(-1)).to(q.probs.dtype)
            drawn_probs = drawn_probs.index_copy(0, at, one_hot)
        drawn = DraftSupport(q.ids, drawn_probs)
        for k, j in enumerate(sampled):
            supports[j] = DraftSupport(q.ids[k], drawn_probs[k])
    # To the host in one copy: token | candidates | their q | their drawn q | the token's q, drawn q.
    columns = [tokens.unsqueeze(-1).double()]
    if num_candidates:
        drawn_top = torch.zeros_like(top.values)
        drawn_token = torch.zeros_like(tokens, dtype=torch.float32)
        residual = torch.zeros_like(drawn_token)
        if sampled:   # the sampled rows at once: drawn as [S, m] supports, the candidates [S, width]
            per_candidate = DraftSupport(drawn.ids.unsqueeze(1), drawn.probs.unsqueeze(1))
            candidates_q = per_candidate.probs_of(top.indices.index_select(0, rows)).to(drawn_top.dtype)
            drawn_top = drawn_top.index_copy(0, rows, candidates_q)
            drawn_token = drawn_token.index_copy(0, rows, drawn.probs_of(tokens.index_select(0, rows)))
            left = (rows_at(own, sampled, rows) - drawn.dense(own.shape[-1])).clamp(min=0).sum(-1)
            residual = residual.index_copy(0, rows, left)
        columns += [top.indices[:, :num_candidates].double(), top.values[:, :num_candidates].double(),
                    drawn_top[:, :num_candidates].double(), residual.unsqueeze(-1).double(),
                    own.gather(-1, tokens.unsqueeze(-1)).double(), drawn_token.unsqueeze(-1).double()]
    on_host = torch.cat(columns, dim=-1).tolist()
    steps = []
    for j, (call, row) in enumerate(zip(calls, on_host)):
        if j in dead:
            steps.append((None, None, None, None))
            continue
        n, greedy = call.num_candidates, call.params.is_greedy
        ranked = odds = None
        if n:
            ids, q_top, drawn_top = row[1:1 + n], row[1 + num_candidates:1 + num_candidates + n], \
                row[1 + 2 * num_candidates:1 + 2 * num_candidates + n]
            ranked = [int(token) for token in ids]
            odds = DraftOdds(tuple(q_top), None if greedy else tuple(drawn_top), row[-2],
                             None if greedy else row[-1], 0.0 if greedy else row[-3])
        steps.append((int(row[0]), ranked, supports.get(j), odds))
    return steps


def rows_at(tensor: torch.Tensor, positions: list[int], index: torch.Tensor) -> torch.Tensor:
    """tensor's rows at positions (index: the same positions on tensor's device); the tensor
    itself when they are all its rows in order, the common case (every row sampled), where a
    copy of rows as wide as the vocabulary would cost a CPU step as much as processing them."""
    if len(positions) == tensor.shape[0] and positions == list(range(len(positions))):
        return tensor
    return tensor.index_select(0, index)


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
