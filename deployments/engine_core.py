"""What the draft and target engines share: `EngineCore`, the body of an engine actor.

Its `step` is one iteration of the batching loop (engine_loop.py), shaped like nano-vllm's
`LLMEngine.step`: the scheduler plans, the engine's `run` runs the plan on its runner, the answers
go back. Around it: release, the stats the policy actor and `specserve status` read
(common.messages.EngineStats), and the small pieces of engine_parts.py. An engine runs in the
actor its replica spawns (deployments.engine_process.EngineProcess).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from specserve.common.channel import CALLER, ChannelServer
from specserve.common.messages import (CallSpan, CostSample, EngineStats, HistoryUpdate, KvUsage, RankStats,
                                       UnknownHistory)
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.scheduler import CallShape, Schedule, Scheduler
from specserve.decoding.tensor_parallel import MirroredRunner
from specserve.deployments.committed_history import CommittedHistories
from specserve.deployments.engine_group import end_process, rank_stats
from specserve.deployments.engine_loop import EngineLoop
from specserve.deployments.engine_parts import CallLog, IdleSequences, LoadReporter, ReleasedIds
from specserve.common.metrics import EngineMetrics
from specserve.deployments.round_stages import profiling_enabled

STATS_TIMEOUT_S = 5.0  # a follower rank that does not answer its stats in this long is reported failing


def timed_forward(scheduler: Scheduler, calls: list[ForwardCall],
                  features_from: Sequence[int | None] | None = None) -> tuple[Any, CostSample]:
    """scheduler.forward_batch (features_from: forward_batch_with_features from there, (logits,
    features)), and its cost (new tokens, seconds) for the policy's cost curve: the tokens it
    computed (prefix-cache hits excluded)."""
    started = time.perf_counter()
    result = scheduler.forward_batch(calls) if features_from is None else \
        scheduler.forward_batch_with_features(calls, features_from)
    return result, (scheduler.last_num_new_tokens, time.perf_counter() - started)


@dataclass
class StepOutput:
    """What an engine's `run` did: answers by call index (a result or an exception; calls left
    out stay queued) and the cost of each forward it ran."""

    results: dict[int, Any] = field(default_factory=dict)
    costs: list[CostSample] = field(default_factory=list)


class EngineCore:
    """Shared body of the draft and target engine actors. Subclasses set `pool` and
    `channel_methods` (what routers may call over a channel) and implement `shape(call)` (what
    the call asks of the runner) and `run(calls, schedule)`."""

    pool: str
    channel_methods: frozenset[str] = frozenset({"release"})
    speculative_s = 0.0   # seconds of forwards that only did optional work (the draft's pre-drafts)

    def __init__(self, runner: Any, engine_options: dict, name: str = "") -> None:
        """runner: a decoding runner, or None for a model-free proposer."""
        self.runner = runner
        self.name = name
        self.scheduler = Scheduler(runner, int(engine_options["max_step_tokens"]),
                                   int(engine_options["prefill_token_budget"]), int(engine_options["max_batch_rows"]),
                                   name or self.pool)
        self.loop = EngineLoop(self.step, self.forget, engine_options["admission_timeout_s"],
                               on_iteration=self._record_iteration, admitted=self._holds)
        self.released = ReleasedIds()
        self.histories = CommittedHistories()
        self.idle = IdleSequences(float(engine_options["idle_sequence_ttl_s"]))
        self.reporter = LoadReporter(engine_options.get("policy_actor"))
        self.call_log = CallLog(profiling_enabled())
        self.metrics = EngineMetrics(self.pool, name.rsplit(":", 1)[-1] if name else "local")
        self._prefix_cache_recorded: tuple[int, int] = (0, 0)   # (queries, hits) sent to metrics
        self.gpu_ids = tuple(str(gpu) for gpu in ray.get_gpu_ids()) if ray.is_initialized() else ()
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        # A tensor-parallel engine (rank 0 of a group): its followers' handles, for stats.
        self.followers: list[Any] = []
        if isinstance(runner, MirroredRunner):
            runner.on_broken = end_process
        self.channel: ChannelServer | None = None
        self.callers: dict[str, int] = {}   # sequence id -> the channel connection of its last call

    async def open_channel(self, host: str | None = None) -> str:
        """Listen for routers' channels (common.channel) on host (default: this node's address,
        the one Ray uses) at a port the OS picks; -> the address routers connect to."""
        if self.channel is None:
            self.channel = ChannelServer(self._answer_channel_call, on_close=self._router_gone)
            await self.channel.start(host or ray.util.get_node_ip_address())
        return self.channel.address

    async def _answer_channel_call(self, method: str, args: tuple) -> Any:
        """Every channel method's first argument is the sequence id it is about."""
        if method not in self.channel_methods:
            raise ValueError(f"a {self.pool} engine answers no {method!r} over a channel")
        self.callers[args[0]] = CALLER.get()
        return await getattr(self, method)(*args)

    def _router_gone(self, caller: int) -> None:
        """A router's channel closed (its process ended, or the connection broke): the sequences
        it last called about go as idle ones do, now rather than after the idle timeout. A router
        that still lives treats the lost channel as a lost engine; asking again, it finds the
        history unknown and sends it whole (nothing committed is lost)."""
        for seq_id in [seq_id for seq_id, called_by in self.callers.items() if called_by == caller]:
            del self.callers[seq_id]
            self.loop.release(seq_id)

    def shape(self, call: Any) -> CallShape:
        raise NotImplementedError

    def run(self, calls: list[Any], schedule: Schedule) -> StepOutput:
        raise NotImplementedError

    def step(self, calls: list[Any]) -> tuple[dict[int, Any], int]:
        """One iteration over the waiting calls (in the loop's worker thread): the scheduler plans,
        `run` runs the plan, the answers go back by call index, with how many calls ran (some, a
        prefill mid-chunk or a block mid-draft, run without an answer yet)."""
        schedule = self.scheduler.schedule([self.shape(call) for call in calls])
        output = self.run(calls, schedule)
        self.reporter.record(output.costs)
        ran = schedule.plan.steps + [index for index, _ in schedule.plan.prefills]
        self.idle.touch((calls[index].seq_id for index in ran), time.monotonic())
        results = {**output.results, **schedule.errors}
        return results, len(set(ran) | set(results))

    async def submit(self, call: Any) -> tuple[Any, CallSpan]:
        """Queue a call (it has a seq_id) on the batching loop: its result, and the span it spent
        in this engine. Every call that can create KV state enters here, so none does after its
        release."""
        self.released.check(call.seq_id)
        entered_s = time.perf_counter()
        result, started_s = await self.loop.submit_timed(call)
        return result, CallSpan(entered_s, started_s, time.perf_counter())

    def committed(self, seq_id: str, update: HistoryUpdate) -> list[int] | UnknownHistory:
        """seq_id's committed history with update applied (a new list, the caller's to extend),
        or UnknownHistory when this engine cannot rebuild it (deployments.committed_history). A
        whole history's cache_salt keys the request's prefix-cache blocks from its admission on.
        A released sequence raises SequenceReleasedError, so none is remembered after its release.

        The history outlives the sequence's KV: a preempted sequence, or every sequence after a
        draft weight swap, is prefilled again from it without the router's help."""
        self.released.check(seq_id)
        history = self.histories.apply(seq_id, update)
        if history is None:
            return UnknownHistory(seq_id)
        if update.start == 0 and self.scheduler.paged:   # a whole history says its request's salt
            self.scheduler.blocks.salt_sequence(seq_id, update.cache_salt)
        return list(history)

    def _holds(self, seq_id: str) -> bool:
        """The runner holds seq_id's KV (between iterations: the loop asks then)."""
        return self.scheduler.paged and self.scheduler.blocks.num_cached(seq_id) > 0

    def forget(self, seq_id: str) -> None:
        """Free seq_id's state (the loop calls it between iterations)."""
        self.callers.pop(seq_id, None)
        self.idle.forget(seq_id)
        self.histories.forget(seq_id)
        self.scheduler.release(seq_id)

    def _record_iteration(self, rows: int, busy_s: float, idle_s: float) -> None:
        self.metrics.record_forward(rows, busy_s, idle_s)
        held = len(self.scheduler.blocks.active_sequences()) if self.scheduler.paged else 0
        self.metrics.set_load(self.loop.queue_depth, held)
        if self.scheduler.paged:
            counted = (self.scheduler.blocks.prefix_cache_queries, self.scheduler.blocks.prefix_cache_hits)
            self.metrics.record_prefix_cache(counted[0] - self._prefix_cache_recorded[0],
                                             counted[1] - self._prefix_cache_recorded[1])
            self._prefix_cache_recorded = counted

    async def set_followers(self, followers: list[Any]) -> None:
        """The group's other ranks (deployments.engine_group), whose stats this engine reports."""
        self.followers = list(followers)

    async def _rank_stats(self) -> tuple[RankStats, ...]:
        """Every rank's RankStats, rank 0's first; () for an engine that is not a group."""
        if not self.followers:
            return ()
        ranks = [rank_stats(self.runner.runner, 0)]
        for rank, follower in enumerate(self.followers, start=1):
            try:
                ranks.append(await asyncio.wait_for(follower.stats.remote(), timeout=STATS_TIMEOUT_S))
            except Exception as error:   # a dead or stuck rank: its group is failing
                ranks.append(RankStats(rank, None, (), 0, 0, 0, 0, f"{type(error).__name__}"))
        return tuple(ranks)

    async def ping(self) -> bool:
        """Health check (the replica calls it every few seconds); also keeps load reports going."""
        self.reporter.start(self.stats)
        return True

    async def call_times(self) -> list[tuple[str, str, float, float]]:
        """Recent calls: (kind, sequence id, entered, left), perf_counter seconds; empty unless
        round profiling is on (deployments.round_stages)."""
        return self.call_log.calls()

    async def release(self, seq_id: str) -> None:
        self.released.add(seq_id)
        self.loop.release(seq_id)

    async def active_sequences(self) -> list[str]:
        """Ids whose KV caches this engine holds (what a leak check must see)."""
        await self.loop.between_iterations()
        return sorted(self.scheduler.blocks.active_sequences()) if self.scheduler.paged else []

    async def stats(self) -> EngineStats:
        """Load and cost figures for the policy actor, metrics and `specserve status`. Read between
        iterations: the worker thread changes the runner's sequences while one runs."""
        await self.loop.between_iterations()
        for seq_id in self.idle.expired(time.monotonic()):
            self.loop.release(seq_id)
        loop = self.loop.stats
        held = len(self.scheduler.blocks.active_sequences()) if self.scheduler.paged else 0
        return EngineStats(self.pool, self.name, sequences=held,
                           free_slots=self.scheduler.free_slots, queue_depth=self.loop.queue_depth,
                           forwards=loop.iterations, batch_rows_total=loop.rows_total, busy_s=loop.busy_s,
                           idle_s=loop.idle_s, speculative_s=self.speculative_s, gpu_ids=self.gpu_ids,
                           node_id=self.node_id, cost_samples=tuple(self.reporter.recent), kv=self._kv_usage(),
                           ranks=await self._rank_stats())

    def _kv_usage(self) -> KvUsage | None:
        if not self.scheduler.paged:
            return None
        usage = self.scheduler.kv_usage()
        return KvUsage(usage["kv_blocks_used"], usage["kv_blocks_free"], usage["kv_block_size"],
                       usage["kv_tokens_held"], usage["kv_bytes_reserved"], self.scheduler.preemptions,
                       usage["kv_blocks_cached"], usage["prefix_cache_queries"], usage["prefix_cache_hits"])
