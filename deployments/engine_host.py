"""A worker deployment's replica owns one engine actor; the router talks to the engine directly.

Why two actors per replica: Serve gives us lifecycle, health checks, scaling and placement, but
a DeploymentHandle call costs ~3 ms, paid twice per speculative round. A plain Ray actor call
costs about half that. So each worker replica spawns its engine (the model) inside the replica's
own placement group (bundle 1 carries the engine's CPUs/GPUs, so on a GPU cluster draft and
target engines land on distinct GPUs), and hands the engine's actor handle to the router once
per request through Serve. If the replica dies, its engine dies with it (the replica owns it).

`EngineCore` is what the draft and target engines share: the batching loop (engine_loop.py),
release, the stats the policy actor and `specserve status` read, idle-sequence eviction.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
import torch
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from decoding.batched_runner import ForwardCall
from decoding.model_runner import SequenceStateError
from decoding.scheduler import IterationPlan, WaitingCall, plan_iteration
from deployments.engine_loop import EngineLoop, SequenceReleasedError
from deployments.metrics import EngineMetrics
from deployments.naming import ENGINE_NAMESPACE, current_replica_id, engine_actor_name

ENGINE_BUNDLE_INDEX = 1
REPLICA_CPUS = 0.01  # the replica only relays the engine handle and health checks
ENGINE_COST_SAMPLES_KEPT = 64  # (batch tokens, seconds) of recent forwards, between two load reports
CALL_LOG_KEPT = 4096  # recent (kind, sequence, entered, left) calls, for bench.round_profile
RELEASED_IDS_KEPT = 4096  # recently released request ids: calls that arrive late for them are refused
REPORT_INTERVAL_S = 1.0  # how often an engine reports its load to the policy actor

logger = logging.getLogger(__name__)


def engine_bundles(num_cpus: float, num_gpus: float,
                   resources: dict[str, float] | None = None) -> list[dict[str, float]]:
    """Placement-group bundles for one worker replica: [replica, engine]."""
    engine = {"CPU": num_cpus, "GPU": num_gpus, **(resources or {})}
    return [{"CPU": REPLICA_CPUS}, {k: v for k, v in engine.items() if v > 0} or {"CPU": REPLICA_CPUS}]


def spawn_engine(engine_class: type, num_cpus: float, num_gpus: float, resources: dict[str, float],
                 name: str | None, *args: Any) -> "ray.actor.ActorHandle":
    """Start engine_class as a Ray actor in this replica's engine bundle (or free-standing)."""
    placement_group = get_current_placement_group()
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": resources,
                               "max_restarts": 0, "max_concurrency": 1000}
    if name:
        options.update(name=name, namespace=ENGINE_NAMESPACE)
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=ENGINE_BUNDLE_INDEX)
    return ray.remote(engine_class).options(**options).remote(*args)


def to_wire(rows: torch.Tensor) -> list[int] | np.ndarray:
    """Ids as a list, probability rows as a numpy array: a torch tensor costs ~0.25 ms to pickle
    and unpickle, paid every round; a list or an array costs a few microseconds."""
    if rows.dtype.is_floating_point:
        return rows.cpu().numpy()
    return rows.tolist()


class EngineCore:
    """Shared body of the draft and target engine actors. Subclasses set `runner` (or None for a
    model-free proposer) before calling __init__, and implement `_iterate(calls)`."""

    pool: str
    runner: Any

    def __init__(self, engine_options: dict, name: str = "") -> None:
        self.name = name
        self.max_step_tokens = int(engine_options["max_step_tokens"])
        self.prefill_token_budget = int(engine_options["prefill_token_budget"])
        self.max_batch_rows = int(engine_options["max_batch_rows"])
        self.idle_ttl_s = float(engine_options["idle_sequence_ttl_s"])
        self.policy_actor = engine_options.get("policy_actor")  # None: the default application's
        self.metrics = EngineMetrics(self.pool, name.rsplit(":", 1)[-1] if name else "local")
        self.loop = EngineLoop(self._iterate, self._release_now, engine_options["admission_timeout_s"],
                               on_iteration=self._record_iteration)
        self.cost_samples: deque[tuple[int, float]] = deque(maxlen=ENGINE_COST_SAMPLES_KEPT)
        self._unreported_costs: deque[tuple[int, float]] = deque(maxlen=ENGINE_COST_SAMPLES_KEPT)
        self._report_task: asyncio.Task | None = None
        self.last_used_s: dict[str, float] = {}
        self.call_log: deque[tuple[str, str, float, float]] = deque(maxlen=CALL_LOG_KEPT)
        self.released_ids: OrderedDict[str, None] = OrderedDict()  # request ids are never reused
        self.preemptions = 0  # sequences whose KV was freed to let older ones grow
        self.gpu_ids = [str(gpu) for gpu in ray.get_gpu_ids()] if ray.is_initialized() else []
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def _iterate(self, calls: list[Any]) -> dict[int, Any]:
        raise NotImplementedError

    def _record_iteration(self, rows: int, busy_s: float, idle_s: float) -> None:
        self.metrics.record_forward(rows, busy_s, idle_s)
        held = 0 if self.runner is None else len(self.runner.active_sequences())
        self.metrics.set_load(self.loop.queue_depth, held)

    async def ping(self) -> bool:
        """Health check (the replica calls it every few seconds); also keeps load reports going."""
        if self._report_task is None or self._report_task.done():
            self._report_task = asyncio.get_running_loop().create_task(self._report_load())
        return True

    async def _report_load(self) -> None:
        """Tell the policy actor this engine's load about once a second (if it runs; the router
        starts it). Cost samples go out once each: the actor accumulates them."""
        from policies.actor import POLICY_ACTOR_NAME, POLICY_NAMESPACE

        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            try:
                policy = ray.get_actor(self.policy_actor or POLICY_ACTOR_NAME, namespace=POLICY_NAMESPACE)
                report = await self.stats()
                report["cost_samples"] = list(self._unreported_costs)
                self._unreported_costs.clear()
                policy.report_engine.remote(report)
            except Exception:  # no policy actor (yet, or restarting): the engine works on regardless
                pass

    def answer(self, kind: str, seq_id: str, entered_s: float, started_s: float | None = None
               ) -> tuple[float, float, float]:
        """The span (entered, forward started, left) a call spent in this engine, logged.
        time.perf_counter is CLOCK_MONOTONIC, one clock for every process on a machine: the router
        subtracts its own send and receive times to see the hops, and bench.round_profile reads the
        log to time rounds from the engines' side, an outside check on the router's accounting.
        Entered to started is the wait in the batching loop, started to left the compute."""
        left_s = time.perf_counter()
        self.call_log.append((kind, seq_id, entered_s, left_s))
        return entered_s, entered_s if started_s is None else started_s, left_s

    async def call_times(self) -> list[tuple[str, str, float, float]]:
        """Recent calls: (kind, sequence id, entered, left), perf_counter seconds."""
        return list(self.call_log)

    async def release(self, seq_id: str) -> None:
        self.released_ids[seq_id] = None
        while len(self.released_ids) > RELEASED_IDS_KEPT:
            self.released_ids.popitem(last=False)
        self.loop.release(seq_id)

    def check_not_released(self, seq_id: str) -> None:
        """Refuse a call for a sequence whose request already ended. Running it would create KV
        state nobody ever releases, and it can come late: a verify waits here for its draft block,
        an asyncio actor does not run a caller's calls in the order sent (a propose sent before
        the release can start after it)."""
        if seq_id in self.released_ids:
            raise SequenceReleasedError(f"sequence {seq_id!r} released")

    async def submit(self, call: Any) -> tuple[Any, float]:
        """Queue a call (it has a seq_id) on the batching loop: (result, when its forward began).
        Every call that can create KV state enters here, so none does after its release."""
        self.check_not_released(call.seq_id)
        return await self.loop.submit_timed(call)

    def _release_now(self, seq_id: str) -> None:
        self.last_used_s.pop(seq_id, None)
        if self.runner is not None:
            self.runner.release(seq_id)

    async def active_sequences(self) -> list[str]:
        """Ids whose KV caches this engine holds (what a leak check must see)."""
        return [] if self.runner is None else sorted(self.runner.active_sequences())

    async def stats(self) -> dict[str, Any]:
        """Load and cost figures for the policy actor, metrics and `specserve status`."""
        self._evict_idle()
        loop_stats = self.loop.stats
        return {"pool": self.pool, "replica": self.name, "sequences": len(await self.active_sequences()),
                "free_slots": self.free_slots, "queue_depth": self.loop.queue_depth,
                "forwards": loop_stats.iterations, "batch_rows_total": loop_stats.rows_total,
                "busy_s": loop_stats.busy_s, "idle_s": loop_stats.idle_s, "gpu_ids": self.gpu_ids,
                "node_id": self.node_id,
                "cost_samples": list(self.cost_samples),
                **({**self.runner.kv_usage(), "kv_preemptions": self.preemptions} if self._paged else {})}

    @property
    def free_slots(self) -> int:
        return 1 << 30 if self.runner is None else self.runner.num_free_slots

    def _evict_idle(self) -> None:
        """A safety net, not the release path: forget sequences untouched for idle_sequence_ttl_s
        (their router died before it could release them)."""
        cutoff = time.monotonic() - self.idle_ttl_s
        for seq_id, last_used in list(self.last_used_s.items()):
            if last_used < cutoff:
                self.loop.release(seq_id)

    def _waiting_call(self, seq_id: str, token_ids: Sequence[int], num_rows: int = 1,
                      extra_tokens: int = 0) -> WaitingCall:
        """extra_tokens: what the call adds after its forward (a draft's later decode steps)."""
        cached = self.runner.num_cached(seq_id) if self.runner is not None else 0
        blocks_held = self.runner.blocks_held(seq_id) if self._paged else 0
        return WaitingCall(seq_id, max(num_rows, len(token_ids) - cached), holds_slot=cached > 0,
                           num_cached=cached, blocks_held=blocks_held, extra_tokens=extra_tokens)

    @property
    def _paged(self) -> bool:
        """The runner keeps KV in a block pool (BatchedModelRunner), so calls wait for blocks."""
        return hasattr(self.runner, "blocks_held")

    def check_call(self, token_ids: Sequence[int], num_rows: int = 1) -> SequenceStateError | None:
        """The error a call would raise in a batched forward, found before it can fail the batch."""
        if self.runner is not None and len(token_ids) > self.runner.max_context:
            return SequenceStateError(f"{len(token_ids)} tokens exceed the model's context of "
                                      f"{self.runner.max_context}")
        if not 1 <= num_rows <= len(token_ids):
            return SequenceStateError(f"num_rows={num_rows} must be between 1 and the history length "
                                      f"{len(token_ids)}")
        return None

    def plan(self, waiting: list[WaitingCall], shapes: list[tuple[Sequence[int], int]],
             results: dict[int, Any]) -> IterationPlan:
        """This iteration's plan over the waiting calls, indices into them. A call that cannot run
        (too long, bad row count) is answered with its error in results instead of failing the batch."""
        valid = []
        for index, (token_ids, num_rows) in enumerate(shapes):
            error = self.check_call(token_ids, num_rows)
            if error is None:
                valid.append(index)
            else:
                results[index] = error
        plan = plan_iteration([waiting[index] for index in valid], self.free_slots, self.max_step_tokens,
                              self.prefill_token_budget, self.max_batch_rows,
                              free_blocks=self.runner.num_free_blocks if self._paged else None,
                              block_size=self.runner.block_size if self._paged else 1)
        if self._paged and not plan.steps and not plan.prefills and any(waiting[valid[i]].holds_slot
                                                                         for i in plan.waiting):
            self._preempt_youngest()
        return IterationPlan(steps=[valid[i] for i in plan.steps],
                             prefills=[(valid[i], chunk) for i, chunk in plan.prefills],
                             waiting=[valid[i] for i in plan.waiting])

    def _preempt_youngest(self) -> None:
        """Nothing can run and a sequence the engine holds waits for KV blocks to grow: free the
        most recently admitted sequence's KV (vLLM's recompute preemption). Its request goes on:
        its next call names the full history, so it is prefilled again once blocks are free, and
        the older sequences finish first. Without this, sequences that all wait to grow would
        wait each other out until the admission deadline failed them."""
        victim = self.runner.active_sequences()[-1]
        logger.warning("%s: KV blocks exhausted; preempting %s (it will be prefilled again)",
                       self.name or self.pool, victim)
        self.runner.release(victim)
        self.preemptions += 1

    def record_cost(self, batch_tokens: int, seconds: float) -> None:
        self.cost_samples.append((batch_tokens, seconds))
        self._unreported_costs.append((batch_tokens, seconds))

    def timed_forward(self, calls: list[ForwardCall]) -> list[torch.Tensor]:
        """runner.forward_batch, recording (new tokens, seconds) for the policy's cost curve."""
        new_tokens = sum(max(call.num_rows, len(call.token_ids) - self.runner.num_cached(call.seq_id))
                         for call in calls)
        started = time.perf_counter()
        logits = self.runner.forward_batch(calls)
        self.record_cost(new_tokens, time.perf_counter() - started)
        now = time.monotonic()
        for call in calls:
            self.last_used_s[call.seq_id] = now
        return logits


class EngineHost:
    """Base of the worker deployments: spawn the engine, hand out its handle, check its health."""

    engine_class: type

    def __init__(self, resources: dict[str, Any], *engine_args: Any) -> None:
        """resources: a WorkerResources dump (num_cpus, num_gpus, resources) for the engine."""
        name = engine_actor_name(self.engine_class.pool, current_replica_id())
        self.engine = spawn_engine(self.engine_class, resources["num_cpus"], resources["num_gpus"],
                                   resources["resources"], name, *engine_args, name)
        started = time.monotonic()
        ray.get(self.engine.ping.remote())  # fail replica start-up if the model cannot load
        self.startup_s = time.monotonic() - started

    def get_engine(self) -> "ray.actor.ActorHandle":
        return self.engine

    async def check_health(self) -> None:
        await asyncio.wait_for(self.engine.ping.remote(), timeout=30)
