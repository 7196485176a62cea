"""Target worker: scores draft blocks, every request waiting on it in ONE batched forward."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from ray import serve

from decoding.batched_runner import ForwardCall, load_runner
from decoding.model_runner import SequenceStateError
from decoding.sampling import SamplingParams
from decoding.speculation import target_rows
from deployments.engine_host import EngineCore, EngineHost, to_wire


@dataclass(frozen=True)
class VerifyCall:
    seq_id: str
    token_ids: Sequence[int]  # the full history: prompt + committed output + draft block
    num_rows: int             # rows wanted: K + 1 (1 for a prefill)
    params: SamplingParams
    first_output_index: int | None = None  # output position of the first row (min_tokens EOS masking)


class TargetEngine(EngineCore):
    """Holds the target model and one KV slot per request id (the Ray actor on the data path)."""

    pool = "target"

    def __init__(self, model_spec: dict, engine_options: dict, name: str = "") -> None:
        self.runner = load_runner(model_spec)
        super().__init__(engine_options, name)

    async def verify(self, seq_id: str, token_ids: Sequence[int], num_rows: int, params: SamplingParams,
                     first_output_index: int | None = None,
                     draft_block: list | None = None) -> tuple[object, tuple[float, float, float]]:
        """Rows for the last num_rows positions of token_ids (argmax ids when greedy, else probs),
        and the span (entered, forward started, left) the call spent in this engine (loop wait +
        forward). Prefill: num_rows=1. When params.logprobs is set the rows come as (rows, raw
        log-probability rows [num_rows, V]).

        draft_block: [ObjectRef of a draft engine's `propose` answer]; then token_ids is the
        history without the block, which is appended here, and num_rows is len(block) + 1. The
        block goes draft -> target without the router's Python in between, while the router awaits
        the same answer for rejection sampling. It is nested in a list so that Ray does not resolve
        it before sending the call: a caller's actor calls leave in order, so every later call
        from that router to this engine would wait behind the draft. If the draft engine failed,
        the call verifies no block (one row); the router, which sees the same failure, cancels it
        and goes on target-only. The call enters this engine when its block is here."""
        if draft_block is not None:
            try:
                proposal, _ = await draft_block[0]
                block = list(proposal.token_ids)
            except Exception:  # the router sees the same failure: it continues target-only
                block = []
            token_ids, num_rows = list(token_ids) + block, len(block) + 1
        entered_s = time.perf_counter()
        rows, started_s = await self.submit(VerifyCall(seq_id, list(token_ids), num_rows, params,
                                                                  first_output_index))
        return rows, self.answer("verify", seq_id, entered_s, started_s)

    def _iterate(self, calls: list[VerifyCall]) -> dict[int, object]:
        """One iteration: the step batch (verifies), then one chunk of waiting prefills."""
        results: dict[int, object] = {}
        waiting = [self._waiting_call(call.seq_id, call.token_ids, call.num_rows) for call in calls]
        plan = self.plan(waiting, [(call.token_ids, call.num_rows) for call in calls], results)
        step_calls = [(index, calls[index]) for index in plan.steps]
        self._forward_rows(step_calls, results)
        finishing, chunks = [], []
        for index, chunk in plan.prefills:
            call = calls[index]
            if chunk < waiting[index].num_new_tokens:  # an early chunk: fill the cache, no rows
                end = self.runner.num_cached(call.seq_id) + chunk
                chunks.append(ForwardCall(call.seq_id, call.token_ids[:end], 1))
            else:
                finishing.append((index, call))
        self._forward_rows(finishing, results, extra=chunks)
        return results

    def _forward_rows(self, indexed_calls: list[tuple[int, VerifyCall]], results: dict[int, object],
                      extra: list[ForwardCall] = ()) -> None:
        """One forward for indexed_calls (+ prefill chunks whose rows nobody wants); rows into results."""
        forward_calls = [ForwardCall(call.seq_id, call.token_ids, call.num_rows) for _, call in indexed_calls]
        if not forward_calls and not extra:
            return
        try:
            logits = self.timed_forward(forward_calls + list(extra))
        except SequenceStateError as exc:
            for index, _ in indexed_calls:
                results[index] = exc
            return
        for (index, call), rows in zip(indexed_calls, logits):
            processed = to_wire(target_rows(rows, call.params, self.runner.eos_token_id, call.first_output_index,
                                              call.token_ids))
            if call.params.logprobs is None:
                results[index] = processed
            else:  # the raw distribution's log-probabilities, for the tokens the router will emit
                results[index] = (processed, to_wire(torch.log_softmax(rows.float(), dim=-1)))


@serve.deployment
class TargetWorker(EngineHost):
    engine_class = TargetEngine
