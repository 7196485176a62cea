"""Proposers: where draft tokens come from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from decoding.grammar import GrammarDeadEndError, GrammarMatchers
from decoding.model_runner import ForwardCall, RunnerBase
from decoding.row_processors import HistoryProcessor, history_processor
from decoding.compact_verify import DraftSupport, draft_support, sample_from_support
from decoding.sampling import SamplingParams, logits_to_probs


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
    """A small causal LM drafting autoregressively over a runner (KV cache reused across rounds).

    Over a BatchedModelRunner, every step of `propose_batch` is one draft forward for all the
    requests still drafting; over a ModelRunner the same code runs one forward per request.

    grammars: the matchers of structured-output requests (one per sequence); with them the draft
    rows are masked as the target's will be, so the draft never proposes a token the grammar
    forbids. None drafts such requests unmasked (still lossless: the target rejects what the
    grammar forbids; bench.structured_outputs measures the difference)."""

    def __init__(self, runner: RunnerBase, grammars: GrammarMatchers | None = None,
                 max_candidates: int | None = None) -> None:
        """max_candidates: a sampled draft token is drawn from its processed row's top
        max_candidates tokens renormalised (decoding.compact_verify.draft_support), which is the q
        verified against; None: the whole row (`speculation.draft_top_k` on the served path)."""
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
        processors: list[HistoryProcessor | None] = [None] * len(calls)
        matchers = [self._grammar(call) if budget > 0 else None for call, budget in zip(calls, budgets)]
        budgets = [0 if matcher is False else budget for matcher, budget in zip(matchers, budgets)]
        drafting = [i for i, budget in enumerate(budgets) if budget > 0]
        while drafting:
            logits = self.runner.forward_batch([ForwardCall(calls[i].seq_id, histories[i], 1) for i in drafting])
            for i, row_logits in zip(drafting, logits):
                call = calls[i]
                row = row_logits[0] if call.generator is None or call.params.is_greedy else (
                    row_logits[0].to(call.generator.device))  # sample where the generator lives
                if call.params.uses_history:
                    if processors[i] is None:
                        processors[i] = history_processor(call.params, call.history, call.prompt_len,
                                                          row.shape[-1], row.device, matchers[i])
                    if processors[i] is not None:
                        try:
                            row = processors[i].process(row.unsqueeze(0))[0]
                        except GrammarDeadEndError:  # the target will say so; the draft just stops
                            budgets[i] = len(drafted[i])
                            continue
                if call.num_candidates:
                    ranked[i].append(torch.topk(row, min(call.num_candidates, row.shape[-1])).indices.tolist())
                if call.guess_first and not drafted[i]:
                    token = self._guess(row, call, q_rows[i])
                else:
                    token = self._draw(row, call, q_rows[i])
                    if call.keep_stream_states and call.generator is not None:
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

    def _guess(self, logits: torch.Tensor, call: ProposeCall, q_rows: list[DraftSupport]) -> int:
        """The draft's most likely next token, with no draw (a pre-draft's guess of the target's
        bonus token, decoding.speculation_cache); a sampled row's q is one-hot at it, so the q rows
        stay one per token (the guess's row is never verified)."""
        token = int(torch.argmax(logits))
        if not call.params.is_greedy:
            q = draft_support(logits_to_probs(logits, call.params), self.max_candidates)
            q_rows.append(DraftSupport(q.ids, (q.ids == token).to(q.probs.dtype)))
        return token

    def _draw(self, logits: torch.Tensor, call: ProposeCall, q_rows: list[DraftSupport]) -> int:
        """The next draft token from one row of logits [V] (on the generator's device when sampling,
        so q rows travel in the same host place); a sampled row's q is kept in q_rows."""
        if call.params.is_greedy:
            return int(torch.argmax(logits))
        q = draft_support(logits_to_probs(logits, call.params), self.max_candidates)
        q_rows.append(q)
        return int(sample_from_support(q, call.generator))

    def release(self, seq_id: str) -> None:
        self.runner.release(seq_id)
        if self.grammars is not None:
            self.grammars.release(seq_id)


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
