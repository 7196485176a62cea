"""One speculative round, split where the wire is: what a target worker returns (`target_rows`,
then `verify_answer`) and what the request's owner does with it (`accept_round`). The router and
the in-process generator both call these, so the distributed path and the reference share the math.
A greedy answer is the target's argmax ids; a sampled one is O(K) numbers
(decoding.compact_verify.TargetNumbers), never [K, V] rows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.decoding.grammar import GrammarDeadEndError, GrammarMatcher
from specserve.decoding.proposers import Proposal
from specserve.decoding.compact_verify import (TargetNumbers, compact_block_verify, compact_rejection_sample,
                                               ragged_target_numbers)
from specserve.decoding.rejection import PLACEHOLDER_TOKEN_ID
from specserve.decoding.row_processors import RowBatch, history_processor
from specserve.decoding.sampling import RowParams, SamplingParams, greedy_ids, process_rows
from specserve.decoding.sequence import RequestState, ending_ids


@dataclass(frozen=True)
class RowsCall:
    """One request's rows in a batched `target_rows_batch`: num_rows consecutive rows of the batch.

    Row i scores output position first_output_index + i (`RequestState.next_output_index` at the
    time of the call). token_ids: the call's whole input (prompt + committed output + the
    num_rows - 1 draft tokens), needed when the request has penalties or a grammar. grammar: the
    request's matcher holding the committed output (params.structured set)."""

    num_rows: int
    params: SamplingParams
    first_output_index: int | None = None
    token_ids: Sequence[int] | None = None
    grammar: GrammarMatcher | None = None
    eos_token_id: int | Collection[int] | None = None  # the served EOS set (decoding.checkpoint.eos_token_ids)


def target_rows_batch(logits: torch.Tensor, calls: Sequence[RowsCall]) -> list[torch.Tensor | GrammarDeadEndError]:
    """Target logits [N, V] of several requests' rows (calls in order, N = sum of num_rows) -> per
    call, argmax ids LongTensor [n] when greedy (small on the wire), else processed probabilities
    float32 [n, V], or the GrammarDeadEndError that call's grammar raised (the rest go on).

    Every call's rows are processed in one pass of batched tensor ops, each row with its request's
    parameters: penalties and grammar masks (decoding.row_processors.RowBatch: row i for the
    committed history plus the block's first i tokens, exactly as the drafter processed its step
    i), then min_tokens, then temperature, min-p, top-k, top-p (decoding.sampling.process_rows)
    or one argmax for the greedy rows. Where a row's output position is below params.min_tokens,
    every EOS id (call.eos_token_id) and every stop token id
    gets logit -inf, so none can be the argmax nor sampled, as in vLLM, unless nothing else is
    left in the row (a grammar that is complete allows only EOS: the grammar wins over
    min_tokens). Only target rows need it: rejection sampling turns any draft into samples of the
    (masked) target distribution."""
    batch, failed, first_row = RowBatch(), {}, 0
    for index, call in enumerate(calls):
        params = call.params
        if params.uses_history:
            if call.token_ids is None or call.first_output_index is None:
                raise ValueError("penalties and grammars need the call's token ids and its first output index")
            if params.structured is not None and call.grammar is None:
                raise ValueError("a structured output needs its grammar matcher")
            committed = len(call.token_ids) - (call.num_rows - 1)
            processor = history_processor(params, call.token_ids[:committed], committed - call.first_output_index,
                                          logits.shape[-1], logits.device, call.grammar)
            try:
                processor.contribute(batch, first_row, call.num_rows, call.token_ids[committed:])
            except GrammarDeadEndError as exc:
                failed[index] = exc
        if params.min_tokens > 0 and call.first_output_index is not None:
            num_masked = min(max(params.min_tokens - call.first_output_index, 0), call.num_rows)
            stopping = sorted(ending_ids(call.eos_token_id, params)) if num_masked else []
            if stopping:
                batch.forbid_stops(first_row, num_masked, stopping)
        first_row += call.num_rows
    if first_row != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows for calls of {first_row} rows")
    processed = batch.apply(logits)
    greedy = [call.params.is_greedy for call in calls]
    argmax = greedy_ids(processed) if any(greedy) else None
    probs = None
    if not all(greedy):   # (a greedy batch, the common case, needs no per-row parameters on the device)
        probs = process_rows(processed, RowParams.of([call.params for call in calls for _ in range(call.num_rows)],
                                                     logits.shape[-1], logits.device))
    answers, first_row = [], 0
    for index, call in enumerate(calls):
        rows = slice(first_row, first_row + call.num_rows)
        answers.append(failed.get(index) or (argmax[rows] if call.params.is_greedy else probs[rows]))
        first_row += call.num_rows
    return answers


def target_rows(logits: torch.Tensor, params: SamplingParams,
                eos_token_id: int | Collection[int] | None = None,
                first_output_index: int | None = None, token_ids: Sequence[int] | None = None,
                grammar: GrammarMatcher | None = None) -> torch.Tensor:
    """`target_rows_batch` for one request's logits [n, V] (raising its GrammarDeadEndError)."""
    answer = target_rows_batch(logits, [RowsCall(logits.shape[0], params, first_output_index, token_ids, grammar,
                                                  eos_token_id)])[0]
    if isinstance(answer, Exception):
        raise answer
    return answer


def verify_answers(rows: Sequence[torch.Tensor], proposals: Sequence[Proposal],
                   generators: Sequence[torch.Generator | None],
                   verifications: Sequence[str]) -> list[list[int] | TargetNumbers]:
    """What a verify answers for each request, from `target_rows_batch`' output: the argmax ids
    (greedy), or the numbers the owner verifies the proposal's block on (sampled: p(x_i), residual
    draws and masses, a bonus draw, drawn with the request's generator, the target's own stream;
    decoding.compact_verify). A verification as accept_round's: the residuals are block-weighted
    when the owner will verify the block jointly, which it does for a sampled block with draft rows.

    Every sampled request's numbers come from one batched pass (`ragged_target_numbers`), and the
    whole batch's answers come to the host in ONE transfer."""
    sampled = [i for i, request_rows in enumerate(rows) if request_rows.dtype.is_floating_point]
    greedy = [i for i, request_rows in enumerate(rows) if not request_rows.dtype.is_floating_point]
    parts = [rows[i] for i in greedy]
    if sampled:
        numbers = ragged_target_numbers(
            joined_rows([rows[i] for i in sampled]), [proposals[i].token_ids for i in sampled],
            [proposals[i].support for i in sampled], [generators[i] for i in sampled],
            [verifications[i] == "block" and proposals[i].support is not None for i in sampled])
        parts += [numbers.target_of_draft, numbers.residual_mass, numbers.tokens]
    on_host = to_host(parts)
    answers: list[list[int] | TargetNumbers] = [[]] * len(rows)
    for i, ids in zip(greedy, on_host):
        answers[i] = [int(token) for token in ids]
    if sampled:
        target_of_draft, residual_mass, tokens = on_host[len(greedy):]
        draft_start = token_start = 0
        for i, count in zip(sampled, numbers.num_draft_tokens):
            drawn = tokens[token_start:token_start + count + 1]
            answers[i] = TargetNumbers(target_of_draft[draft_start:draft_start + count],
                                       residual_mass[draft_start:draft_start + count],
                                       [int(token) for token in drawn[:-1]], int(drawn[-1]))
            draft_start += count
            token_start += count + 1
    return answers


def verify_answer(rows: torch.Tensor, proposal: Proposal, generator: torch.Generator | None,
                  verification: str = "block") -> list[int] | TargetNumbers:
    """`verify_answers` for one request."""
    return verify_answers([rows], [proposal], [generator], [verification])[0]


def answer_verifies(rows: Sequence[torch.Tensor], calls: Sequence[RowsCall | GrammarDeadEndError],
                    proposals: Sequence[Proposal], generator_of: Callable[[int], torch.Generator | None],
                    verifications: Sequence[str]) -> list[list[int] | TargetNumbers | GrammarDeadEndError]:
    """Each verify call's answer from its target rows [n_i, V], as a target engine gives them:
    every call's rows processed in one batched pass (`target_rows_batch`) and answered together
    (`verify_answers`: one transfer to the host). A call given as its grammar's GrammarDeadEndError,
    or whose grammar fails on its block, answers that error alone; the rest go on.
    generator_of(i): call i's stream for its draws, asked only of the calls answered."""
    answers: list = list(calls)
    batch = [i for i, call in enumerate(calls) if isinstance(call, RowsCall)]
    if not batch:
        return answers
    for i, processed in zip(batch, target_rows_batch(joined_rows([rows[i] for i in batch]), [calls[i] for i in batch])):
        answers[i] = processed
    answering = [i for i in batch if not isinstance(answers[i], GrammarDeadEndError)]
    verified = verify_answers([answers[i] for i in answering], [proposals[i] for i in answering],
                              [generator_of(i) for i in answering], [verifications[i] for i in answering])
    for i, answer in zip(answering, verified):
        answers[i] = answer
    return answers


def joined_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rows [n_i, V] as one [sum n_i, V] tensor: a view when each lies right after the one before
    in the same storage (one forward's logits, split by call, as the runner answers them), else a
    copy. Why: re-joining a batch's split logits would copy every row of the vocabulary each step."""
    present = [row for row in rows if row.shape[0]]   # an empty view has no address of its own
    if not present:
        return torch.cat(rows)
    first = present[0]
    storage, end = first.untyped_storage().data_ptr(), first.data_ptr()
    for row in present:
        if (row.data_ptr() != end or row.stride() != first.stride() or row.dtype != first.dtype
                or row.untyped_storage().data_ptr() != storage):
            return torch.cat(rows)
        end += row.shape[0] * row.stride(0) * row.element_size()
    return first.as_strided((sum(row.shape[0] for row in present), *first.shape[1:]), first.stride())


def to_host(tensors: Sequence[torch.Tensor]) -> list[list[float]]:
    """Each tensor's values as a flat Python list, all of them brought over in one device -> host
    copy (as float64: exact for token ids, which stay below 2**53)."""
    if not tensors:
        return []
    sizes = [tensor.numel() for tensor in tensors]
    flat = torch.cat([tensor.reshape(-1).double() for tensor in tensors]).tolist()
    values, start = [], 0
    for size in sizes:
        values.append(flat[start:start + size])
        start += size
    return values


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
        # One request's block, verified on the host (decoding.compact_verify); the uniforms come
        # from the request's generator, on its device.
        draft_ids = np.asarray(proposal.token_ids, dtype=np.int64)
        if proposal.support is None:
            draft_of_draft = np.ones(num_drafted)
        else:
            draft_of_draft = proposal.support.probs_of(draft_ids)
        block = verification == "block" and proposal.support is not None
        verify = compact_block_verify if block else compact_rejection_sample
        output = verify(draft_ids, draft_of_draft, answer, state.generator)
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

    @staticmethod
    def joined(parts: Sequence["LogprobEntries"]) -> "LogprobEntries":
        """Consecutive verifies' entries as one (a target-only round's steps), row after row."""
        return LogprobEntries([row for part in parts for row in part.top_ids],
                              [row for part in parts for row in part.top_logprobs],
                              [row for part in parts for row in part.may_commit])

    def entries(self, token_ids: Sequence[int]) -> list[dict]:
        """Per committed token (token i from row i): its log-probability and the top pairs."""
        return [{"token_id": int(token), "logprob": self.may_commit[i][int(token)],
                 "top": list(zip(self.top_ids[i], self.top_logprobs[i])) if self.top_ids else []}
                for i, token in enumerate(token_ids)]


def split_logprobs(params: SamplingParams, answer):
    """(the verify answer, its LogprobEntries or None): a logprobs request's verify answers with both."""
    return answer if params.logprobs is not None else (answer, None)


def target_token(answer: TargetNumbers | Sequence[int]) -> int:
    """The token an answer to a verify without a block commits: the target's argmax (greedy) or
    its bonus draw (sampled), as accept_round commits it."""
    return int(answer.bonus) if isinstance(answer, TargetNumbers) else int(answer[0])


def tokens_each_row_may_commit(proposal: Proposal, answer: TargetNumbers | Sequence[int]) -> list[list[int]]:
    """For a verify of proposal's K tokens answered with answer (`verify_answer`), the tokens row i
    may commit: d_(i+1) if accepted, else the target's own token (its argmax, or its recovered
    draw; the bonus after the last draft token)."""
    drafted = list(proposal.token_ids)
    own = list(answer) if not isinstance(answer, TargetNumbers) else [*answer.recovered, answer.bonus]
    return [([drafted[i]] if i < len(drafted) else []) + [int(own[i])] for i in range(len(drafted) + 1)]
