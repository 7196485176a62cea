"""One speculative round, split where the wire is: what a target worker returns (`target_rows`,
then `verify_answer`) and what the request's owner does with it (`accept_round`). The router and
the in-process generator both call these, so the distributed path and the reference share the math.
A greedy answer is the target's argmax ids; a sampled one is O(K) numbers
(decoding.compact_verify.TargetNumbers), never [K, V] rows.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from decoding.grammar import GrammarMatcher
from decoding.proposers import Proposal
from decoding.compact_verify import (DraftSupport, TargetNumbers, compact_block_verify, compact_rejection_sample,
                                     target_numbers)
from decoding.rejection import PLACEHOLDER_TOKEN_ID
from decoding.row_processors import history_processor
from decoding.sampling import SamplingParams, logits_to_probs
from decoding.sequence import RequestState, stop_ids


def target_rows(logits: torch.Tensor, params: SamplingParams,
                eos_token_id: int | Collection[int] | None = None,
                first_output_index: int | None = None, token_ids: Sequence[int] | None = None,
                grammar: GrammarMatcher | None = None) -> torch.Tensor:
    """Target logits [n, V] -> argmax ids LongTensor [n] when greedy (small on the wire),
    else processed probabilities float32 [n, V].

    Row i scores output position first_output_index + i (`RequestState.next_output_index` at the
    time of the call). Where that position is below params.min_tokens, every EOS id (the served
    set, see decoding.checkpoint.eos_token_ids) and every stop token id gets logit -inf, so none
    can be the argmax nor sampled, as in vLLM, unless nothing else is left in the row (a grammar
    that is complete allows only EOS: the grammar wins over min_tokens). Only target rows need it:
    rejection sampling turns any draft into samples of the (masked) target distribution.

    token_ids: the call's whole input (prompt + committed output + the n - 1 draft tokens), needed
    when the request has penalties or a grammar: row i is processed for the committed history plus
    the block's first i tokens (decoding.row_processors), exactly as the drafter processed its step
    i. grammar: the request's matcher holding the committed output (params.structured set)."""
    if params.uses_history:
        if token_ids is None or first_output_index is None:
            raise ValueError("penalties and grammars need the call's token ids and its first output index")
        if params.structured is not None and grammar is None:
            raise ValueError("a structured output needs its grammar matcher")
        committed = len(token_ids) - (logits.shape[0] - 1)
        processor = history_processor(params, token_ids[:committed], committed - first_output_index,
                                      logits.shape[-1], logits.device, grammar)
        logits = processor.process(logits, token_ids[committed:])
    if params.min_tokens > 0 and first_output_index is not None:
        num_masked = min(max(params.min_tokens - first_output_index, 0), logits.shape[0])
        stopping = stop_ids(eos_token_id, params.stop_token_ids) if num_masked else []
        if stopping:
            logits = logits.clone()
            rows = logits[:num_masked]
            others = rows.clone()
            others[:, stopping] = float("-inf")
            keeps_some = torch.isfinite(others).any(dim=-1, keepdim=True)
            logits[:num_masked] = torch.where(keeps_some, others, rows)
    if params.is_greedy:
        return torch.argmax(logits, dim=-1)
    return logits_to_probs(logits, params)


def verify_answer(rows: torch.Tensor, proposal: Proposal, generator: torch.Generator | None,
                  verification: str = "block") -> list[int] | TargetNumbers:
    """What a verify answers for one request, from `target_rows`' output: the argmax ids (greedy),
    or the numbers the owner verifies the proposal's block on (sampled: p(x_i), residual draws and
    masses, a bonus draw, drawn with generator, the target's own stream; decoding.compact_verify).
    verification as accept_round's: the residuals are block-weighted when the owner will verify
    the block jointly, which it does for a sampled block with draft rows."""
    if not rows.dtype.is_floating_point:
        return rows.tolist()
    draft_ids = torch.tensor([proposal.token_ids], dtype=torch.long, device=rows.device).reshape(1, -1)
    support = None if proposal.support is None else DraftSupport(*(torch.as_tensor(
        np.array(part) if isinstance(part, np.ndarray) else part).unsqueeze(0) for part in
        (proposal.support.ids, proposal.support.probs)))
    block = verification == "block" and support is not None
    return target_numbers(draft_ids, support, rows.unsqueeze(0), generator, block).wire()


def as_tensor(rows: torch.Tensor | np.ndarray | Sequence[int]) -> torch.Tensor:
    """Rows as they come off the wire (ids as a list, probabilities as a numpy array: both far
    cheaper to serialise than torch tensors) -> a tensor. Arrays Ray hands back are read-only."""
    if isinstance(rows, np.ndarray) and not rows.flags.writeable:
        rows = rows.copy()
    return torch.as_tensor(rows)


def accept_round(state: RequestState, proposal: Proposal,
                 answer: TargetNumbers | torch.Tensor | Sequence[int], verification: str = "block") -> list[int]:
    """Verify proposal against the target's answer to it (`verify_answer`: argmax ids [K+1] when
    greedy, TargetNumbers when sampled), commit the emitted tokens to state and update its stats;
    return the tokens committed. An empty proposal is a plain target step (one token from row 0),
    e.g. the first token after prefill.

    verification "block" verifies a sampled request's block with draft rows jointly (block
    verification on the target's weighted residuals); "token" token by token. It must be the
    verification the answer was computed for. Greedy requests and blocks without draft rows
    (n-gram) are token-wise either way: there block verification has token-wise's distribution and
    costs more. The acceptance uniforms come from the request's own generator."""
    if state.finished:
        raise ValueError(f"request {state.request_id!r} already finished ({state.finish_reason})")
    num_drafted = len(proposal.token_ids)
    if state.params.is_greedy:
        if len(answer) != num_drafted + 1:
            raise ValueError(f"expected {num_drafted + 1} target ids for {num_drafted} draft tokens, "
                             f"got {len(answer)}")
        # Argmax ids off the wire: the same answer as greedy_verify, without building tensors (a
        # third of a millisecond per round on the router's loop, measured by bench.round_profile).
        emitted = greedy_emitted(proposal.token_ids, answer if isinstance(answer, list) else as_tensor(answer).tolist())
    else:
        if len(answer.recovered) != num_drafted:
            raise ValueError(f"expected numbers for {num_drafted} draft tokens, got {len(answer.recovered)}")
        device = state.generator.device  # the uniforms are drawn where the request's generator lives
        numbers = answer.tensors(device)
        draft_ids = torch.tensor([proposal.token_ids], dtype=torch.long, device=device).reshape(1, num_drafted)
        if proposal.support is None:
            draft_of_draft = torch.ones(1, num_drafted, dtype=torch.float64, device=device)
        else:
            draft_of_draft = proposal.support.tensors(device).probs_of(draft_ids[0]).unsqueeze(0)
        block = verification == "block" and proposal.support is not None
        verify = compact_block_verify if block else compact_rejection_sample
        output = verify(draft_ids, draft_of_draft, numbers, state.generator)
        emitted = [token for token in output[0].tolist() if token != PLACEHOLDER_TOKEN_ID]
    committed = state.commit(emitted)

    stats = state.stats
    if num_drafted:
        stats.rounds += 1
        stats.draft_version = proposal.draft_version
    stats.num_drafted += num_drafted
    stats.num_accepted += len(emitted) - 1  # everything but the one recovered or bonus token
    stats.num_emitted += len(committed)
    stats.target_passes += 1
    return committed


def greedy_emitted(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]) -> list[int]:
    """greedy_verify for one request, on plain lists: draft ids are kept while they equal the
    target's argmax ids, then the target's id at the first mismatch (or its bonus after all K)."""
    num_accepted = 0
    for draft_id, target_id in zip(draft_token_ids, target_token_ids):
        if draft_id != target_id:
            break
        num_accepted += 1
    return [int(token) for token in target_token_ids[: num_accepted + 1]]


def token_logprobs(token_ids: Sequence[int], logprob_rows: torch.Tensor | np.ndarray,
                   num_alternatives: int) -> list[dict]:
    """Per token: its log-probability under dense log-probability rows (token i at row i) and the
    num_alternatives most likely (id, log-probability) pairs (the prompt's entries, on the engine)."""
    rows = as_tensor(logprob_rows)
    entries = []
    for i, token in enumerate(token_ids):
        top = torch.topk(rows[i], num_alternatives) if num_alternatives else None
        entries.append({"token_id": int(token), "logprob": float(rows[i, token]),
                        "top": [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))})
    return entries


@dataclass(frozen=True)
class LogprobEntries:
    """What a logprobs request's verify carries beside its answer: per row of the verify, the raw
    distribution's num_alternatives most likely (id, log-probability) pairs, and the
    log-probabilities of the tokens that row may commit (the drafted token there, and the target's
    own: its argmax, or its recovered or bonus draw). O(K x N) numbers instead of [K+1, V] rows: the
    owner does not know yet which token each row commits, but it is one of these."""

    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    may_commit: list[dict[int, float]]

    @staticmethod
    def of(logits: torch.Tensor, num_alternatives: int, may_commit: Sequence[Sequence[int]]) -> "LogprobEntries":
        """From a verify's raw logits [rows, V] and each row's possible tokens."""
        rows = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(rows, num_alternatives, dim=-1) if num_alternatives else None
        return LogprobEntries(
            [] if top is None else top.indices.tolist(), [] if top is None else top.values.tolist(),
            [{int(token): float(rows[i, int(token)]) for token in tokens} for i, tokens in enumerate(may_commit)])

    def entries(self, token_ids: Sequence[int]) -> list[dict]:
        """Per committed token (token i from row i): its log-probability and the top pairs."""
        return [{"token_id": int(token), "logprob": self.may_commit[i][int(token)],
                 "top": list(zip(self.top_ids[i], self.top_logprobs[i])) if self.top_ids else []}
                for i, token in enumerate(token_ids)]


def tokens_each_row_may_commit(proposal: Proposal, answer: TargetNumbers | Sequence[int]) -> list[list[int]]:
    """For a verify of proposal's K tokens answered with answer (`verify_answer`), the tokens row i
    may commit: d_(i+1) if accepted, else the target's own token (its argmax, or its recovered
    draw; the bonus after the last draft token)."""
    drafted = list(proposal.token_ids)
    own = list(answer) if not isinstance(answer, TargetNumbers) else [*answer.recovered, answer.bonus]
    return [([drafted[i]] if i < len(drafted) else []) + [int(own[i])] for i in range(len(drafted) + 1)]
