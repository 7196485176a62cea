"""Proposers: where draft tokens come from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
    grammar forbids; bench.structured_outputs measures the difference)."""

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
        """`propose` for every call (distinct seq_ids) in max(num_tokens) batched draft steps.

        The first step brings each row's history up to date (several new tokens for a row whose
        last round accepted some); each later step feeds one token per row. A row leaves the batch
        once it has its num_tokens. Each row is drawn with its own generator, so a seeded
        request's draft does not depend on what else shares the batch."""
        # The last drafted token is never fed, so the draft sees at most len(history) + K - 1 tokens.
        budgets = [max(0, min(call.num_tokens, self.runner.max_context - len(call.history) + 1))
                   for call in calls]
        histories = [list(call.history) for call in calls]
        drafted: list[list[int]] = [[] for _ in calls]
        ranked: list[list[list[int]]] = [[] for _ in calls]
        states: list[list[torch.Tensor]] = [[] for _ in calls]
        q_rows: list[list[DraftSupport]] = [[] for _ in calls]
        matchers = [self._grammar(call) if budget > 0 else None for call, budget in zip(calls, budgets)]
        budgets = [0 if matcher is False else budget for matcher, budget in zip(matchers, budgets)]
        processors: list[HistoryProcessor | None] = [None] * len(calls)
        drafting = [i for i, budget in enumerate(budgets) if budget > 0]
        while drafting:
            logits = self.runner.forward_batch([ForwardCall(calls[i].seq_id, histories[i], 1) for i in drafting])
            rows = torch.cat([row_logits[-1:] for row_logits in logits])
            for i in drafting:  # built on the first step, where the rows' width and device are known
                if processors[i] is None and calls[i].params.uses_history:
                    processors[i] = history_processor(calls[i].params, calls[i].history, calls[i].prompt_len,
                                                      rows.shape[-1], rows.device, matchers[i] or None)
            step = draft_step(rows, [calls[i] for i in drafting], [processors[i] for i in drafting],
                              [not drafted[i] for i in drafting], self.max_candidates)
            for i, (token, top, q) in zip(drafting, step):
                call = calls[i]
                if token is None:  # the grammar allows nothing here: the target will say so; the draft just stops
                    budgets[i] = len(drafted[i])
                    continue
                if top is not None:
                    ranked[i].append(top)
                if q is not None:
                    q_rows[i].append(q)
                if call.keep_stream_states and call.generator is not None and not (call.guess_first and not drafted[i]):
                    states[i].append(call.generator.get_state())
                if processors[i] is not None:
                    processors[i].advance([token])
                drafted[i].append(token)
                histories[i].append(token)
            drafting = [i for i in drafting if len(drafted[i]) < budgets[i]]
        return [Proposal(token_ids=tokens, support=None if call.params.is_greedy else DraftSupport.stack(rows),
                         candidates=top or None, stream_states=kept if call.keep_stream_states else None)
                if tokens else empty_proposal()
                for call, tokens, rows, top, kept in zip(calls, drafted, q_rows, ranked, states)]

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
