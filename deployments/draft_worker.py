"""Draft worker: proposes K tokens (and, when sampling, the q each was drawn from as (ids, probs))
per round, for every request drafting now in K batched decode steps.

Its weights can change while it serves (`load_draft`, docs/online-learning.md): a new version is
loaded beside the serving one and takes over between two forwards, every sequence's draft KV
dropped (the engine keeps each request's committed history, so the next propose re-prefills from it). Each Proposal names the
version that drafted it and carries that version's q, which the router verifies the block
against, so a swap in the middle of a request changes speed, never the output distribution.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray
import torch
from ray import serve

from cluster.messages import CallSpan, HistoryUpdate, UnknownHistory
from decoding.batched_runner import ForwardCall, load_runner
from decoding.grammar import GrammarMatchers
from decoding.proposers import DraftModelProposer, NgramProposer, Proposal, ProposeCall, empty_proposal
from decoding.sampling import SamplingParams, make_generator
from decoding.scheduler import CallShape, Schedule
from deployments.engine_host import EngineCore, EngineHost, StepOutput, timed_forward
from deployments.metrics import DraftVersionMetrics
from deployments.naming import ENGINE_NAMESPACE

REGISTER_INTERVAL_S = 5.0  # how often an engine tells the draft trainer its version (a new one learns the latest)

logger = logging.getLogger(__name__)


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
                runner, model_spec.get("tokenizer_path") or model_spec["path"]), engine_options.get("draft_top_k"))
        self.generators: dict[str, torch.Generator] = {}
        self.model_spec = model_spec
        self.draft_version, self.draft_path = 0, None if model_spec is None else model_spec["path"]
        self._pending_swap: tuple[int, str, Any] | None = None  # (version, path, runner) loaded, not yet serving
        self._swap_lock = threading.Lock()
        self.trainer_name = engine_options.get("draft_trainer")
        self._registered_at = 0.0
        super().__init__(runner, engine_options, name)
        self.version_metrics = DraftVersionMetrics(name.rsplit(":", 1)[-1] if name else "local")
        self.version_metrics.set_version(0)

    async def load_draft(self, version: int, path: str) -> dict[str, Any]:
        """Load the draft checkpoint at path as `version`; it serves from the next forward on.
        A load that fails raises and changes nothing: the current weights go on serving."""
        if self.runner is None:
            raise ValueError("an n-gram proposer has no weights to load")
        if (version, path) == (self.draft_version, self.draft_path):
            return await self.version()
        # Its prefix cache starts empty and is salted with the version: no block of other weights is found.
        runner = await asyncio.to_thread(load_runner, {**self.model_spec, "path": path,
                                                       "cache_salt": f"{path}@draft-v{version}"})
        with self._swap_lock:
            self._pending_swap = (version, path, runner)
        logger.info("%s: draft version %d loaded from %s; it serves from the next forward",
                    self.name or self.pool, version, path)
        return {**(await self.version()), "pending": version}

    async def version(self) -> dict[str, Any]:
        """The draft version serving now and where its weights came from."""
        return {"draft_version": self.draft_version, "draft_path": self.draft_path}

    def step(self, calls: list[DraftCall]) -> dict[int, Any]:
        """An iteration, on the loaded version if one waits: it takes over here, between forwards."""
        self._apply_pending_swap()
        return super().step(calls)

    def _apply_pending_swap(self) -> None:
        """The loaded version replaces the serving one; all draft KV goes with the old runner."""
        with self._swap_lock:
            pending, self._pending_swap = self._pending_swap, None
        if pending is None:
            return
        self.draft_version, self.draft_path, self.runner = pending
        self.scheduler.runner = self.runner
        self.proposer = DraftModelProposer(self.runner, self.proposer.grammars, self.proposer.max_candidates)
        self.version_metrics.set_version(self.draft_version)

    async def ping(self) -> bool:
        """Health check; with online training on, also tell the app's trainer this engine's
        version every few seconds, so a new replica is given the current one."""
        if self.trainer_name and time.monotonic() - self._registered_at > REGISTER_INTERVAL_S:
            self._registered_at = time.monotonic()
            try:
                trainer = ray.get_actor(self.trainer_name, namespace=ENGINE_NAMESPACE)
                trainer.register_engine.remote(self.name, ray.get_runtime_context().current_actor,
                                               self.draft_version, self.draft_path)
            except Exception:  # no trainer (yet, or it died): serving goes on untouched
                pass
        return await super().ping()

    async def prefill(self, seq_id: str, history: HistoryUpdate) -> UnknownHistory | None:
        """Warm the draft's cache with the prompt while the target prefills it."""
        committed = self.committed(seq_id, history)
        if isinstance(committed, UnknownHistory):
            return committed
        await self.submit(DraftCall(seq_id, committed, 0))
        return None

    async def propose(self, seq_id: str, history: HistoryUpdate, tail: Sequence[int], num_tokens: int,
                      params: SamplingParams, seed: int | None, prompt_len: int | None = None
                      ) -> tuple[Proposal, CallSpan] | UnknownHistory:
        """Up to num_tokens draft tokens continuing the committed history (its update since this
        engine's last call for seq_id, deployments.committed_history) followed by tail (tokens
        not committed: a block being verified, when drafting ahead), its first prompt_len tokens
        the prompt; and the span it spent in this engine. UnknownHistory when this engine does not
        hold the history the update continues: the caller sends all of it again."""
        committed = self.committed(seq_id, history)
        if isinstance(committed, UnknownHistory):
            return committed
        proposal, span = await self.submit(DraftCall(seq_id, committed + list(tail), num_tokens, params, seed,
                                                     prompt_len))
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

    def _to_wire(self, proposal: Proposal) -> Proposal:
        return replace(proposal, support=None if proposal.support is None else proposal.support.wire(),
                       draft_version=self.draft_version)


@serve.deployment
class DraftWorker(EngineHost):
    engine_class = DraftEngine
    model_spec_arg = 1
