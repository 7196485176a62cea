"""Draft worker: proposes K tokens (and their processed q rows when sampling) per round, for every
request drafting now in K batched decode steps."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from ray import serve

from decoding.batched_runner import ForwardCall, load_runner
from decoding.proposers import DraftModelProposer, NgramProposer, Proposal, ProposeCall, empty_proposal
from decoding.sampling import SamplingParams, make_generator
from deployments.engine_host import EngineCore, EngineHost, to_wire


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
            self.runner = None
            self.proposer = NgramProposer()
        else:
            assert model_spec is not None, "a draft-model proposer needs a model spec"
            # The pair was checked before the app started (cluster.builder.served_model_specs): a
            # refusal here would only make Serve retry this deployment while the rest serves.
            self.runner = load_runner(model_spec)
            self.proposer = DraftModelProposer(self.runner)
        self.generators: dict[str, torch.Generator] = {}
        super().__init__(engine_options, name)

    async def prefill(self, seq_id: str, history: Sequence[int]) -> None:
        """Warm the draft's cache with the prompt while the target prefills it."""
        await self.submit(DraftCall(seq_id, list(history), 0))

    async def propose(self, seq_id: str, history: Sequence[int], num_tokens: int, params: SamplingParams,
                      seed: int | None, prompt_len: int | None = None) -> tuple[Proposal, tuple[float, float, float]]:
        """Up to num_tokens draft tokens continuing history (its first prompt_len tokens the
        prompt), and the span (entered, forward started, left) spent in this engine."""
        entered_s = time.perf_counter()
        proposal, started_s = await self.submit(DraftCall(seq_id, list(history), num_tokens, params, seed,
                                                          prompt_len))
        return proposal, self.answer("propose", seq_id, entered_s, started_s)

    def _release_now(self, seq_id: str) -> None:
        super()._release_now(seq_id)
        self.generators.pop(seq_id, None)

    def _iterate(self, calls: list[DraftCall]) -> dict[int, object]:
        """Prefill what the cache lacks (prompts, or a replica's first sight of a request), then
        draft for every call in one batch of decode steps."""
        results: dict[int, object] = {}
        if self.runner is None:  # n-gram lookup: nothing to schedule
            runnable = list(range(len(calls)))
        else:
            for index, call in enumerate(calls):
                if len(call.history) + max(call.num_tokens - 1, 0) > self.runner.max_context:
                    results[index] = None if call.num_tokens == 0 else empty_proposal()  # past the draft's context
            waiting = [self._waiting_call(call.seq_id, call.history, extra_tokens=max(call.num_tokens - 1, 0))
                       for call in calls]
            plan = self.plan(waiting, [(call.history, 1) for call in calls], results)
            runnable = self._prefill(calls, waiting, plan.prefills) + plan.steps
        to_draft = []
        for index in runnable:
            if calls[index].num_tokens == 0:
                results.setdefault(index, None)
            elif index not in results:
                to_draft.append(index)
        if to_draft:
            started = time.perf_counter()
            proposals = self.proposer.propose_batch([self._propose_call(calls[index]) for index in to_draft])
            num_steps = max(calls[index].num_tokens for index in to_draft)
            self.record_cost(len(to_draft), (time.perf_counter() - started) / num_steps)  # per decode step
            for index, proposal in zip(to_draft, proposals):
                results[index] = self._to_wire(proposal)
            if self.runner is not None:
                now = time.monotonic()
                for index in to_draft:
                    self.last_used_s[calls[index].seq_id] = now
        return results

    def _prefill(self, calls: list[DraftCall], waiting, prefills: list[tuple[int, int]]) -> list[int]:
        """Run this iteration's prefill chunks in one forward; the calls whose cache is now complete."""
        if not prefills:
            return []
        forward_calls, complete = [], []
        for index, chunk in prefills:
            call = calls[index]
            if chunk < waiting[index].num_new_tokens:
                end = self.runner.num_cached(call.seq_id) + chunk
                forward_calls.append(ForwardCall(call.seq_id, call.history[:end], 1))
            else:
                forward_calls.append(ForwardCall(call.seq_id, call.history, 1))
                complete.append(index)
        self.timed_forward(forward_calls)
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
