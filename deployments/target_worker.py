"""Target engine: scores draft blocks, every request waiting on it in ONE batched forward, and
answers each with what its verification needs (decoding.speculation.verify_answer): O(K) numbers.

A prefill asked for the prompt's log-probabilities runs chunk by chunk like any prefill, each
chunk's full-vocabulary rows reduced to the prompt's entries (log-probability, top alternatives,
rank) as soon as its forward ends: the rows alive at once are one chunk's, never the whole
prompt's (an 8K-token prompt at a 128k vocabulary would be 4 GB of fp32 logits).

Serving an EAGLE-3 head (the spec's aux_layers), every forward also stores the aux layers'
features of the positions it computed in the KV pool beside their keys; a call's answer carries
those of the positions the router lacks (CallSpan.features): a sequence's first answer from
position 0 (a prefix-cache hit's and earlier chunks' included), each later one from its last
committed token's; the router keeps the committed ones for the draft engine (docs/eagle3.md#serving)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specserve.common.messages import CallSpan, DecodedSteps, HistoryUpdate, UnknownHistory
from specserve.decoding.batched_runner import load_runner
from specserve.decoding.target_features import TargetFeatures, features_start, merged_features
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.capture import top_rows
from specserve.decoding.grammar import GrammarDeadEndError, GrammarMatcher, GrammarMatchers
from specserve.decoding.errors import SequenceStateError
from specserve.decoding.proposers import Proposal, empty_proposal
from specserve.decoding.sampling import SamplingParams, make_generator, verify_seed
from specserve.decoding.scheduler import CallShape, Schedule
from specserve.decoding.sequence import ending_ids
from specserve.decoding.speculation import (LogprobEntries, RowsCall, answer_verifies, split_logprobs, target_token,
                                            token_logprobs, tokens_each_row_may_commit)
from specserve.deployments.engine_core import EngineCore, StepOutput, timed_forward


@dataclass(frozen=True)
class VerifyCall:
    seq_id: str
    token_ids: Sequence[int]  # the full history: prompt + committed output + draft block (kept by the engine)
    num_rows: int             # rows wanted: K + 1 (1 for a prefill)
    params: SamplingParams
    first_output_index: int | None = None  # output position of the first row (min_tokens EOS masking)
    prompt_logprobs: int | None = None     # a prefill that also scores the prompt (see TargetEngine.verify)
    capture_top_k: int | None = None       # also answer the raw rows' top-k (decoding.capture.top_rows)
    proposal: Proposal | None = None       # the block verified (its q, for a sampled answer); None: a prefill
    verification: str = "block"            # how the owner verifies a sampled block (speculation.verification)
    features_from: int | None = None       # serving an EAGLE-3 head: answer the features from this position
    steps: int = 1                         # a target-only round decodes up to this many tokens (DecodedSteps)


@dataclass
class _DecodingRound:
    """A target-only round of several steps in progress (TargetEngine.step): the call as queued,
    the call of its next step (the history grown by the tokens drawn so far) and the answers."""

    call: VerifyCall
    current: VerifyCall
    answers: list
    features: TargetFeatures | None = None   # serving a head: the steps' features so far, merged


@dataclass(frozen=True)
class RoundEnd:
    """Where a target-only round left its sequence, for a round that continues it (TargetEngine.
    verify without a history): the tokens it drew, the output position after them, and whether
    the last one ends the request."""

    token_ids: tuple[int, ...]
    next_output_index: int | None
    ended: bool


class TargetEngine(EngineCore):
    """Holds the target model and one KV slot per request id (the Ray actor on the data path)."""

    pool = "target"
    channel_methods = frozenset({"verify", "release"})

    def __init__(self, model_spec: dict, engine_options: dict, name: str = "") -> None:
        runner = load_runner(model_spec)
        self.grammars = GrammarMatchers.for_runner(runner, model_spec.get("tokenizer_path") or model_spec["path"])
        self.generators: dict[str, torch.Generator] = {}
        # A prompt being scored chunk by chunk: the entries of its tokens so far (the first token's
        # included), one more than the prompt positions whose rows were reduced.
        self.prompt_entries: dict[str, list[dict]] = {}
        self.reads_features = bool(model_spec.get("aux_layers"))
        # Sequences whose features were answered (the next answer starts at the last committed token).
        self.features_answered: set[str] = set()
        # The answering forward's features, by sequence, until its call returns them.
        self.features: dict[str, TargetFeatures] = {}
        # Target-only rounds of several steps in progress, by sequence.
        self.decoding: dict[str, _DecodingRound] = {}
        # Each sequence's target-only round in progress, answered as (its call, its rows) or None
        # (it failed), for the round the router queued to continue it.
        self.round_ends: dict[str, asyncio.Future] = {}
        super().__init__(runner, engine_options, name)

    def forget(self, seq_id: str) -> None:
        super().forget(seq_id)
        self.grammars.release(seq_id)
        self.generators.pop(seq_id, None)
        self.prompt_entries.pop(seq_id, None)
        self.features.pop(seq_id, None)
        self.features_answered.discard(seq_id)
        self.decoding.pop(seq_id, None)
        self.round_ends.pop(seq_id, None)

    async def verify(self, seq_id: str, history: HistoryUpdate | None, proposal: Proposal | None, params: SamplingParams,
                     first_output_index: int | None = None, prompt_logprobs: int | None = None,
                     capture_top_k: int | None = None, verification: str = "block",
                     features_from: int | None = None, steps: int = 1) -> tuple[object, CallSpan] | UnknownHistory:
        """The target's answer for [last committed token, *proposal's block] (decoding.speculation.
        verify_answer: argmax ids when greedy, else the O(K) numbers the owner verifies the block on,
        drawn with this sequence's own seeded generator), and the span (entered, forward started,
        left) the call spent in this engine (loop wait + forward). history: the committed history's
        update since this engine's last call for seq_id (deployments.committed_history);
        UnknownHistory answers instead when this engine cannot rebuild it, and the caller sends all
        of it again. history None: a target-only round the router queued behind the one in
        progress, continuing from where that one ends (`_continued`). A prefill has no proposal
        (one row). When params.logprobs is set the answer
        comes as (answer, raw log-probability rows [num_rows, V]).

        prompt_logprobs: a prefill that also scores every prompt token (its log-probability, the
        prompt_logprobs most likely alternatives, its rank), chunk by chunk.
        capture_top_k: a round sampled for the draft's online training (docs/online-learning.md):
        the answer becomes (answer, (top ids, top log-probabilities)) of the raw distribution at
        every row, k columns each. Only sampled rounds ask, so the others pay nothing.
        verification: the owner's ("block" or "token"), which a sampled answer's residuals follow.
        features_from: serving an EAGLE-3 head, answer the features from this position on (read
        from the cache, where every forward stores them): a replacement draft engine lacks them.
        steps: a round without a block may decode up to this many tokens here (`step`)
        and answer DecodedSteps."""
        proposal = proposal or empty_proposal()
        if history is None:
            continued = await self._continued(seq_id)
            if not isinstance(continued, tuple):
                return continued
            committed, first_output_index = continued
        else:
            committed = self.committed(seq_id, history)
            if isinstance(committed, UnknownHistory):
                return committed
        if self.reads_features and features_from is None:
            features_from = features_start(committed, seq_id in self.features_answered)
        token_ids = committed + list(proposal.token_ids)
        num_rows = len(token_ids) if prompt_logprobs is not None else len(proposal.token_ids) + 1
        several = steps > 1 and not proposal.token_ids and prompt_logprobs is None and capture_top_k is None
        call = VerifyCall(seq_id, token_ids, num_rows, params, first_output_index, prompt_logprobs, capture_top_k,
                          proposal, verification, features_from if self.reads_features else None,
                          steps if several else 1)
        ends = None
        if not proposal.token_ids and prompt_logprobs is None and capture_top_k is None:
            ends = self.round_ends[seq_id] = asyncio.get_running_loop().create_future()
        try:
            rows, span = await self.submit(call)
        except BaseException:
            if ends is not None:
                ends.set_result(None)   # failed or given up: nothing to continue from
            raise
        if ends is not None:
            ends.set_result((call, rows))
        span = replace(span, cached_tokens=self.scheduler.blocks.prefix_cached_tokens(seq_id),
                       features=self.features.pop(seq_id, None))
        self.call_log.record("verify", seq_id, span)
        return rows, span

    async def _continued(self, seq_id: str) -> tuple[list[int], int | None] | UnknownHistory:
        """A queued round's start: (committed history, output position) once the sequence's round
        in progress ends, its tokens counted as committed, as the router commits every token of a
        round that leaves the request going. The router queues such a round while it waits for the
        one before, so the engine decodes on at once instead of idling for the round trip (vLLM's
        engine never waits on its frontend between steps). UnknownHistory when no round is in
        progress, it failed, or it ended the request (the router sends a round of its own, or,
        finishing the request, reads no answer)."""
        ending = self.round_ends.pop(seq_id, None)   # taken at once: a later round cannot see it
        answered = None if ending is None else await ending
        if answered is None:
            return UnknownHistory(seq_id)
        self.released.check(seq_id)
        end = self._round_end(*answered)
        if end.ended:
            return UnknownHistory(seq_id)
        committed = self.histories.extend(seq_id, end.token_ids)
        if committed is None:
            return UnknownHistory(seq_id)
        return list(committed), end.next_output_index

    def _round_end(self, call: VerifyCall, rows: object) -> RoundEnd:
        """Where call's answered round leaves the sequence (RoundEnd)."""
        answers = rows.answers if isinstance(rows, DecodedSteps) else (rows,)
        drawn = tuple(target_token(split_logprobs(call.params, answer)[0]) for answer in answers)
        ended = bool(drawn) and drawn[-1] in ending_ids(self.runner.eos_token_ids, call.params)
        return RoundEnd(drawn, None if call.first_output_index is None else call.first_output_index + len(drawn),
                        ended)

    def step(self, calls: list[VerifyCall]) -> tuple[dict[int, object], int]:
        """EngineCore.step, with target-only rounds of several steps (VerifyCall.steps) run as
        vLLM's multi-step scheduling runs them: the call stays queued, each iteration decodes the
        token the one before drew, batched with every other call like any verify, and the call is
        answered DecodedSteps once it has `steps` answers, so the router, the channel and the
        stream pay once for up to `steps` tokens (and the batching loop runs the steps back to
        back in its worker thread while nothing else arrives). The answers are those the same
        number of plain rounds would get (the same rows, the same draws from the sequence's
        generator); the router commits them in order and stops where the request ends (a stop
        string, max_tokens), so a token decoded past that is only work thrown away. Decoding stops
        here at a token that ends the request (`ending_ids`, the rule RequestState commits by). A
        later step's error ends the round with the answers so far: the next round's first step
        meets it again and reports it as a plain round does. Serving a head, each step computes
        the features of the token it feeds, and the answer carries every step's, merged."""
        try:
            results, ran = super().step([self._step_call(call) for call in calls])
        except Exception:
            if len(calls) == 1 and calls[0].steps > 1:   # run alone (the loop isolates a failing batch's calls)
                so_far = self._ended_by_error(calls[0])
                if so_far is not None:
                    return {0: so_far}, 1
            raise
        for index, result in list(results.items()):
            call = calls[index]
            if call.steps == 1:
                continue
            if isinstance(result, BaseException):
                results[index] = self._ended_by_error(call) or result
                continue
            decoding = self.decoding[call.seq_id]
            decoding.answers.append(result)
            decoding.features = merged_features(decoding.features, self.features.pop(call.seq_id, None))
            token = target_token(split_logprobs(call.params, result)[0])
            if len(decoding.answers) == call.steps or token in ending_ids(self.runner.eos_token_ids, call.params):
                results[index] = self._decoded(self.decoding.pop(call.seq_id))
                continue
            del results[index]   # run, not answered: the next iteration decodes on
            current = decoding.current
            decoding.current = replace(current, token_ids=[*current.token_ids, token], first_output_index=None
                                       if current.first_output_index is None else current.first_output_index + 1,
                                       features_from=len(current.token_ids) if self.reads_features else None)
        return results, ran

    def _ended_by_error(self, call: VerifyCall) -> DecodedSteps | None:
        """A round of several steps that a step's error ends: its answers so far (None: it had
        none, so the error is the answer); the engine keeps no state of it. Another call's round
        of the same sequence (a newer one) keeps its state."""
        decoding = self.decoding.get(call.seq_id)
        if decoding is None or decoding.call is not call:
            return None
        del self.decoding[call.seq_id]
        return self._decoded(decoding) if decoding.answers else None

    def _decoded(self, decoding: _DecodingRound) -> DecodedSteps:
        """A round of several steps' answer; its features (serving a head) for the call to return."""
        if decoding.features is not None:
            self.features[decoding.call.seq_id] = decoding.features
        return DecodedSteps(tuple(decoding.answers))

    def _step_call(self, call: VerifyCall) -> VerifyCall:
        """The call this iteration runs for call: itself, or a round of several steps' next step."""
        if call.steps == 1:
            return call
        decoding = self.decoding.get(call.seq_id)
        if decoding is None or decoding.call is not call:   # its first step (any earlier round's is over)
            decoding = self.decoding[call.seq_id] = _DecodingRound(call, call, [])
        return decoding.current

    def shape(self, call: VerifyCall) -> CallShape:
        return CallShape(call.seq_id, call.token_ids, self._rows_wanted(call))

    def _rows_scored(self, call: VerifyCall) -> int:
        """Prompt positions whose rows a scoring prefill has reduced already (its cache holds
        exactly them); 0 when it starts, or starts again because its KV was let go (preempted)."""
        entries = self.prompt_entries.get(call.seq_id)
        if call.prompt_logprobs is None or not entries:
            return 0
        if self.scheduler.blocks.num_cached(call.seq_id) != len(entries) - 1:
            del self.prompt_entries[call.seq_id]
            return 0
        return len(entries) - 1

    def _rows_wanted(self, call: VerifyCall) -> int:
        """Rows the call's next forward must return: a scoring prefill's every position not scored yet."""
        return len(call.token_ids) - self._rows_scored(call) if call.prompt_logprobs is not None else call.num_rows

    def run(self, calls: list[VerifyCall], schedule: Schedule) -> StepOutput:
        """One iteration: the step batch (verifies), then one chunk of waiting prefills. An early
        chunk fills the cache and returns no rows, or, for a prompt being scored, the chunk's rows,
        reduced to its entries at once."""
        output = StepOutput()
        self._forward_rows([(index, calls[index]) for index in schedule.plan.steps], output)
        finishing, chunks, scoring = [], [], []
        for index, chunk in schedule.plan.prefills:
            call = calls[index]
            end = schedule.calls[index].chunk_end(chunk)
            if end is None:
                finishing.append((index, call))
            elif call.prompt_logprobs is None:
                chunks.append(ForwardCall(call.seq_id, call.token_ids[:end], 1))
            else:
                start = self._rows_scored(call)
                scoring.append((call, start, len(chunks)))
                chunks.append(ForwardCall(call.seq_id, call.token_ids[:end], end - start))
        chunk_rows = self._forward_rows(finishing, output, extra=chunks)
        for call, start, position in scoring if chunk_rows else ():
            self.prompt_entries[call.seq_id] = self.prompt_entries.get(call.seq_id, []) + prompt_logprob_entries(
                call.token_ids, chunk_rows[position], call.prompt_logprobs, start)
        return output

    def _forward_rows(self, indexed_calls: list[tuple[int, VerifyCall]], output: StepOutput,
                      extra: list[ForwardCall] = ()) -> list[torch.Tensor]:
        """One forward for indexed_calls (+ prefill chunks, not answered); rows into output. ->
        the extra chunks' rows (none when the forward failed: they stay queued)."""
        results = output.results
        forward_calls = [ForwardCall(call.seq_id, call.token_ids, self._rows_wanted(call)) for _, call in indexed_calls]
        if not forward_calls and not extra:
            return []
        # The answered calls' features (an early chunk's stay in the cache until its prefill's answer).
        features_from = [call.features_from for _, call in indexed_calls] + [None] * len(extra) \
            if self.reads_features and indexed_calls else None
        try:
            result, cost = timed_forward(self.scheduler, forward_calls + list(extra), features_from)
        except SequenceStateError as exc:
            for index, _ in indexed_calls:
                results[index] = exc
            return []
        output.costs.append(cost)
        logits = result
        if features_from is not None:
            logits, features = result
            for (_, call), computed in zip(indexed_calls, features):
                self.features[call.seq_id] = TargetFeatures(computed.start, computed.hidden.cpu())
                self.features_answered.add(call.seq_id)
        # Every call's rows are processed and answered together (one pass of batched ops, one
        # transfer to the host); a call whose grammar fails answers its error alone.
        last_rows, row_calls = [], []
        for (_, call), rows in zip(indexed_calls, logits):
            last_rows.append(rows[-1:] if call.prompt_logprobs is not None else rows)
            try:
                row_calls.append(RowsCall(last_rows[-1].shape[0], call.params, call.first_output_index,
                                          call.token_ids, self._grammar(call), self.runner.eos_token_ids))
            except GrammarDeadEndError as exc:
                row_calls.append(exc)
        answers = answer_verifies(last_rows, row_calls, [call.proposal for _, call in indexed_calls],
                                  lambda i: self._generator(indexed_calls[i][1]),
                                  [call.verification for _, call in indexed_calls])
        for i, ((index, call), rows, answer) in enumerate(zip(indexed_calls, logits, answers)):
            results[index] = answer
            if isinstance(answer, GrammarDeadEndError):  # this request's alone: the rest of the batch goes on
                continue
            if call.params.logprobs is not None:
                # the raw distribution's log-probabilities of the tokens the router may emit, and the top N
                results[index] = (answer, LogprobEntries.of(
                    last_rows[i], call.params.logprobs, tokens_each_row_may_commit(call.proposal, answer)))
            if call.prompt_logprobs is not None:
                start = len(call.token_ids) - rows.shape[0]
                entries = self.prompt_entries.pop(call.seq_id, []) + prompt_logprob_entries(
                    call.token_ids, rows[:-1], call.prompt_logprobs, start)
                results[index] = (results[index], entries)
            if call.capture_top_k is not None:
                results[index] = (results[index], top_rows(last_rows[i], call.capture_top_k))
        return logits[len(forward_calls):]

    def _generator(self, call: VerifyCall) -> torch.Generator | None:
        """The sequence's own stream for its residual and bonus draws (seeded requests reproduce)."""
        if call.params.is_greedy:
            return None
        generator = self.generators.get(call.seq_id)
        if generator is None:
            generator = self.generators[call.seq_id] = make_generator(verify_seed(call.params.seed), self.runner.device)
        return generator

    def _grammar(self, call: VerifyCall) -> GrammarMatcher | None:
        """A structured output's matcher, synced to the call's committed output (its token ids
        without the draft block, from the first output position on)."""
        if call.params.structured is None:
            return None
        committed = len(call.token_ids) - (call.num_rows - 1 if call.prompt_logprobs is None else 0)
        output = call.token_ids[committed - call.first_output_index:committed]
        matcher = self.grammars.synced(call.seq_id, call.params.structured, output)
        if matcher is None:
            raise GrammarDeadEndError(f"{call.params.structured.param}: the output so far does not follow the "
                                      "grammar", call.params.structured.param)
        return matcher


def prompt_logprob_entries(token_ids: Sequence[int], logits: torch.Tensor, num_alternatives: int,
                           start: int = 0) -> list[dict]:
    """The entries of the prompt tokens logits predicts (row j is position start + j and predicts
    token start + j + 1): each token's log-probability under the target given the tokens before
    it, the num_alternatives most likely tokens and its rank among all (1 = the most likely). From
    start 0 the first token's entry comes first, with none (logprob, top and rank None), as in
    OpenAI/vLLM."""
    logprob_rows = torch.log_softmax(logits.float(), dim=-1)
    entries = [{"token_id": int(token_ids[0]), "logprob": None, "top": None, "rank": None}] if start == 0 else []
    predicted = token_ids[start + 1:start + 1 + logits.shape[0]]
    for entry, row in zip(token_logprobs(predicted, logprob_rows, num_alternatives), logprob_rows):
        entry["rank"] = int((row > entry["logprob"]).sum()) + 1
        entries.append(entry)
    return entries

