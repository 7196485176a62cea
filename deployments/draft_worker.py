"""Draft worker: proposes K tokens (and their processed q rows when sampling) per round, for every
request drafting now in K batched decode steps."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from ray import serve

from cluster.messages import CallSpan
from decoding.batched_runner import ForwardCall, load_runner
from decoding.grammar import GrammarMatchers
from decoding.proposers import DraftModelProposer, NgramProposer, Proposal, ProposeCall, empty_proposal
from decoding.sampling import SamplingParams, make_generator
from decoding.scheduler import CallShape, Schedule
from deployments.engine_host import EngineCore, EngineHost, StepOutput, timed_forward, to_wire


@dataclass(frozen=True)
class DraftCall:
    seq_id: str
    history: Sequence[int]
    num_tokens: int                  # 0: only prefill the cache with history
    params: SamplingParams | None = None
    seed: int | None = None
    prompt_len: int | None = None    # history's prompt tokens (penalties count the rest as output)


class DraftEngine(EngineCore):
    """Holds the proposer and, per request id, its KV slot and its seeded draft generator."""

    pool = "draft"

    def __init__(self, proposer_kind: str, model_spec: dict | None, target_path: str, engine_options: dict,
                 name: str = "") -> None:
        if proposer_kind == "ngram":
            runner = None
            self.proposer = NgramProposer()
        else:
            assert model_spec is not None, "a draft-model proposer needs a model spec"
            # The pair was checked before the app started (cluster.builder.served_model_specs): a
            # refusal here would only make Serve retry this deployment while the rest serves.
            runner = load_runner(model_spec)
            self.proposer = DraftModelProposer(runner, GrammarMatchers.for_runner(
                runner, model_spec.get("tokenizer_path") or model_spec["path"]))
        self.generators: dict[str, torch.Generator] = {}
        super().__init__(runner, engine_options, name)

    async def prefill(self, seq_id: str, history: Sequence[int]) -> None:
        """Warm the draft's cache with the prompt while the target prefills it."""
        await self.submit(DraftCall(seq_id, list(history), 0))

    async def propose(self, seq_id: str, history: Sequence[int], num_tokens: int, params: SamplingParams,
                      seed: int | None, prompt_len: int | None = None) -> tuple[Proposal, CallSpan]:
        """Up to num_tokens draft tokens continuing history (its first prompt_len tokens the
        prompt), and the span it spent in this engine."""
        proposal, span = await self.submit(DraftCall(seq_id, list(history), num_tokens, params, seed, prompt_len))
        self.call_log.record("propose", seq_id, span)
        return proposal, span

    def forget(self, seq_id: str) -> None:
        super().forget(seq_id)
        self.generators.pop(seq_id, None)
        if self.runner is not None:
            self.proposer.grammars.release(seq_id)

    def shape(self, call: DraftCall) -> CallShape:
        return CallShape(call.seq_id, call.history, extra_tokens=max(call.num_tokens - 1, 0))

    def run(self, calls: list[DraftCall], schedule: Schedule) -> StepOutput:
        """Prefill what the cache lacks (prompts, or a replica's first sight of a request), then
        draft for every call in one batch of decode steps."""
        output = StepOutput()
        if self.runner is not None:  # a block past the draft's context: none
            for index, call in enumerate(calls):
                if len(call.history) + max(call.num_tokens - 1, 0) > self.runner.max_context:
                    output.results[index] = None if call.num_tokens == 0 else empty_proposal()
        runnable = self._prefill(calls, schedule, output) + schedule.plan.steps
        to_draft = []
        for index in runnable:
            if calls[index].num_tokens == 0:
                output.results.setdefault(index, None)
            elif index not in output.results:
                to_draft.append(index)
        if to_draft:
            started = time.perf_counter()
            proposals = self.proposer.propose_batch([self._propose_call(calls[index]) for index in to_draft])
            num_steps = max(calls[index].num_tokens for index in to_draft)
            output.costs.append((len(to_draft), (time.perf_counter() - started) / num_steps))  # per decode step
            for index, proposal in zip(to_draft, proposals):
                output.results[index] = self._to_wire(proposal)
        return output

    def _prefill(self, calls: list[DraftCall], schedule: Schedule, output: StepOutput) -> list[int]:
        """Run this iteration's prefill chunks in one forward; the calls whose cache is now complete."""
        if not schedule.plan.prefills:
            return []
        forward_calls, complete = [], []
        for index, chunk in schedule.plan.prefills:
            call = calls[index]
            end = schedule.calls[index].chunk_end(chunk)
            forward_calls.append(ForwardCall(call.seq_id, call.history if end is None else call.history[:end], 1))
            if end is None:
                complete.append(index)
        _, cost = timed_forward(self.runner, forward_calls)
        output.costs.append(cost)
        return complete

    def _propose_call(self, call: DraftCall) -> ProposeCall:
        generator = self.generators.get(call.seq_id)
        if generator is None:
            generator = self.generators[call.seq_id] = make_generator(call.seed)
        return ProposeCall(call.seq_id, call.history, call.num_tokens, call.params, generator, call.prompt_len)

    @staticmethod
    def _to_wire(proposal: Proposal) -> Proposal:
        if proposal.probs is None:
            return proposal
        return Proposal(proposal.token_ids, to_wire(proposal.probs))


@serve.deployment
class DraftWorker(EngineHost):
    engine_class = DraftEngine
