"""The batching loop inside an engine actor: every call waiting when a forward ends joins the next.

An engine actor is an asyncio actor. Calls (`submit`) queue up while the model runs in ONE worker
thread (torch releases the GIL, so the event loop keeps accepting calls meanwhile); when the
forward ends, the loop hands everything waiting to the engine's `step` (`iterate` here), which
plans and runs one iteration (decoding.scheduler) and answers the calls it finished. Calls it did
not finish (a prefill mid-chunk, a new sequence waiting for a KV slot) stay queued, in order. No
timer: a lone call starts at once.

Releases never race a forward: they are applied between iterations, and drop any queued call of
the released sequence (its request is gone), so a late call cannot resurrect freed state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

WAIT_FOR_SLOT_POLL_S = 0.02  # how often calls that wait for a KV slot look again
LET_ARRIVALS_IN = 3  # event-loop turns between iterations: a delivered call needs a few to reach the queue


class EngineOverloadedError(RuntimeError):
    """No KV slot freed up for a new sequence within the engine's admission deadline."""


class SequenceReleasedError(RuntimeError):
    """The call's sequence was released while the call waited (its request ended)."""


@dataclass
class LoopStats:
    """What the loop did, for metrics and the policy: utilisation is busy / (busy + idle)."""

    iterations: int = 0
    rows_total: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0


@dataclass
class _Queued:
    call: Any
    future: asyncio.Future
    arrived_s: float = field(default_factory=time.monotonic)
    started_s: float | None = None  # perf_counter when the iteration that answered it began


class EngineLoop:
    """Queue + batching loop. `iterate(calls) -> {index: result or Exception}` runs in the worker
    thread; indices it leaves out stay queued for the next iteration."""

    def __init__(self, iterate: Callable[[list[Any]], dict[int, Any]], release: Callable[[str], None],
                 admission_timeout_s: float = 30.0,
                 on_iteration: Callable[[int, float, float], None] | None = None) -> None:
        """on_iteration(rows answered, busy seconds, idle seconds before it), after each iteration."""
        self._iterate = iterate
        self._on_iteration = on_iteration
        self._idle_before_s = 0.0
        self._release = release
        self._admission_timeout_s = admission_timeout_s
        self._queue: list[_Queued] = []
        self._pending_releases: list[str] = []
        self._running = False
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-forward")
        self._task: asyncio.Task | None = None
        self._stats = LoopStats()
        self._idle_since: float | None = None  # set while the loop waits for calls
        self._busy_since: float | None = None  # set while an iteration runs

    @property
    def stats(self) -> LoopStats:
        """Counters up to now, the idle or busy stretch in progress included: an engine that has
        been idle for a minute must read as idle now, not as busy as it was at its last forward."""
        now = time.perf_counter()
        stats = replace(self._stats)
        if self._idle_since is not None:
            stats.idle_s += now - self._idle_since
        if self._busy_since is not None:
            stats.busy_s += now - self._busy_since
        return stats

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    async def submit(self, call: Any) -> Any:
        """Queue call (it must have a seq_id) and wait for its result."""
        return (await self.submit_timed(call))[0]

    async def submit_timed(self, call: Any) -> tuple[Any, float]:
        """submit, plus when the iteration that answered the call began (perf_counter seconds):
        what the call spent before it is the wait in this loop, what it spent after, compute."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        queued = _Queued(call, asyncio.get_running_loop().create_future())
        self._queue.append(queued)
        self._wake.set()
        result = await queued.future
        return result, queued.started_s

    def release(self, seq_id: str) -> None:
        """Forget seq_id once no forward is running: drop its queued calls, free its state."""
        self._pending_releases.append(seq_id)
        if not self._running:
            self._apply_releases()

    def _apply_releases(self) -> None:
        released = set(self._pending_releases)
        self._pending_releases.clear()
        if not released:
            return
        kept = []
        for queued in self._queue:
            if queued.call.seq_id in released:
                if not queued.future.done():
                    queued.future.set_exception(SequenceReleasedError(f"sequence {queued.call.seq_id!r} released"))
            else:
                kept.append(queued)
        self._queue = kept
        for seq_id in released:
            self._release(seq_id)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._idle_since = time.perf_counter()
                self._wake.clear()
                try:
                    await self._wake.wait()
                finally:
                    idle_s = time.perf_counter() - self._idle_since
                    self._idle_since = None
                self._stats.idle_s += idle_s
                self._idle_before_s += idle_s
            batch = list(self._queue)
            self._running = True
            busy_from = self._busy_since = time.perf_counter()
            for queued in batch:  # a call left waiting is stamped again by the next iteration
                queued.started_s = busy_from
            try:
                if len(batch) == 1:
                    # A lone call runs right here: handing it to the worker thread and back costs a
                    # lone stream two thread switches per call, paid every round.
                    results = self._iterate([batch[0].call])
                else:
                    results = await loop.run_in_executor(self._executor, self._iterate, [q.call for q in batch])
            except Exception as exc:  # the iteration as a whole failed: answer every call in it
                results = {index: exc for index in range(len(batch))}
            finally:
                self._running = False
                self._busy_since = None
            busy_s = time.perf_counter() - busy_from
            self._stats.busy_s += busy_s
            if results:
                self._stats.iterations += 1
                self._stats.rows_total += len(results)
                if self._on_iteration is not None:
                    self._on_iteration(len(results), busy_s, self._idle_before_s)
                self._idle_before_s = 0.0
            for index, result in results.items():
                future = batch[index].future
                if future.done():  # the caller went away (cancelled)
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            finished = {id(batch[index]) for index in results}
            self._queue = [q for q in self._queue if id(q) not in finished and not q.future.done()]
            self._apply_releases()
            self._expire_waiting()
            for _ in range(LET_ARRIVALS_IN):  # calls Ray delivered meanwhile join the next batch
                await asyncio.sleep(0)
            if not results and self._queue:  # everything waits for a slot: look again shortly
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), WAIT_FOR_SLOT_POLL_S)
                except asyncio.TimeoutError:
                    pass

    def _expire_waiting(self) -> None:
        """Calls that waited past the admission deadline get EngineOverloadedError."""
        now = time.monotonic()
        kept = []
        for queued in self._queue:
            if now - queued.arrived_s > self._admission_timeout_s:
                queued.future.set_exception(EngineOverloadedError(
                    f"no KV slot became free within {self._admission_timeout_s:.0f} s"))
            else:
                kept.append(queued)
        self._queue = kept
