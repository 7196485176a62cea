"""The batching loop inside an engine actor: every call waiting when a forward ends joins the next.

An engine actor is an asyncio actor. Calls (`submit`) queue up while the model runs in ONE worker
thread (torch releases the GIL, so the event loop keeps accepting calls meanwhile); when the
forward ends, the loop hands everything waiting to the engine's `step` (`iterate` here), which
plans and runs one iteration (decoding.scheduler) and answers the calls it finished. Calls it did
not finish (a prefill mid-chunk, a new sequence waiting for a KV slot) stay queued, in order. No
timer: a lone call starts at once. Every iteration, a lone call's too, runs in the worker thread:
one on the event loop would hold up pings, releases and stats for as long as its forward takes.

An iteration that makes progress without answering anything (a block mid-draft, a prefill
mid-chunk, a target-only round mid-way) is followed by the next one in the worker thread itself,
as long as nothing changed on the event loop meanwhile (no call arrived, none was released or
given up, no stats reader waits): handing each step back to the event loop and out again would
cost a thread switch and a few event-loop turns a token, which on a busy host cost about what a
small model's step does. As soon as something changes, the loop takes over again, so a new call
waits at most one step.

Only the worker thread touches the engine's state while an iteration runs. Releases are applied
between iterations, and drop any queued call of the released sequence (its request is gone), so
a late call cannot resurrect freed state; readers on the event loop (stats) wait for a moment
between iterations (`between_iterations`).

Faults stay with the call that caused them: when an iteration fails as a whole (one prompt runs
the device out of memory, one call's tokens break the forward), each of its calls is run again
alone, so only the call that cannot run gets the error and its neighbours get their answers.
The admission deadline is for waiting to be admitted: a call whose sequence the engine holds
(mid chunked prefill, waiting to grow) is making progress and does not expire; a preempted
sequence's call waits for admission again from the moment it was let go.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

logger = logging.getLogger(__name__)

WAIT_FOR_SLOT_POLL_S = 0.02  # how often calls that wait for a KV slot look again
LET_ARRIVALS_IN = 3  # event-loop turns between iterations: a delivered call needs a few to reach the queue


class EngineOverloadedError(RuntimeError):
    """A new sequence was not admitted (no KV slot or blocks freed up) within the engine's admission deadline."""


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
    waiting_since_s: float = field(default_factory=time.monotonic)  # arrival, or last seen admitted
    started_s: float | None = None  # perf_counter when the iterations that answered it began


class EngineLoop:
    """Queue + batching loop. `iterate(calls) -> ({index: result or Exception}, calls run)` runs in
    the worker thread; indices it leaves out stay queued for the next iteration. Calls run but not
    answered (a prefill mid-chunk, a block mid-draft) make progress: the next iteration starts at
    once, in the worker thread while nothing changed (`_iterate_while_unchanged`). An iteration
    that ran none (everything waits for a slot or blocks) is followed by a short wait for a
    release or a new call."""

    def __init__(self, iterate: Callable[[list[Any]], tuple[dict[int, Any], int]], release: Callable[[str], None],
                 admission_timeout_s: float = 30.0,
                 on_iteration: Callable[[int, float, float], None] | None = None,
                 admitted: Callable[[str], bool] | None = None) -> None:
        """on_iteration(rows answered, busy seconds, idle seconds before it), after each iteration.
        admitted(seq_id): the engine holds seq_id's state, so its calls are past admission (called
        between iterations); None: no call is ever admitted ahead of running (no KV to wait for)."""
        self._iterate = iterate
        self._admitted = admitted
        self._on_iteration = on_iteration
        self._idle_before_s = 0.0
        self._release = release
        self._admission_timeout_s = admission_timeout_s
        self._queue: list[_Queued] = []
        self._pending_releases: list[str] = []
        self._running = False
        self._iteration_ended: asyncio.Future | None = None  # resolved when the running iteration ends
        self._reader_waiting = False  # a stats reader waits for the running iterations to end
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

    async def between_iterations(self) -> None:
        """Return at a moment no iteration runs (the worker thread is not touching the engine's
        state), so the caller may read that state on the event loop until its next await. A
        reader waiting counts as a change: the worker thread ends its run of iterations."""
        while self._running:
            self._reader_waiting = True
            await asyncio.shield(self._iteration_ended)

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
            self._iteration_ended = loop.create_future()
            busy_from = self._busy_since = time.perf_counter()
            for queued in batch:  # a call left waiting is stamped again by the next iteration
                queued.started_s = busy_from
            try:
                results, iterations = await loop.run_in_executor(self._executor, self._iterate_while_unchanged, batch)
            finally:
                self._running = self._reader_waiting = False
                self._busy_since = None
                self._iteration_ended.set_result(None)
            self._stats.busy_s += time.perf_counter() - busy_from
            for rows, busy_s in iterations:
                if rows:
                    self._stats.iterations += 1
                    self._stats.rows_total += rows
                    if self._on_iteration is not None:
                        self._on_iteration(rows, busy_s, self._idle_before_s)
                    self._idle_before_s = 0.0
            ran = iterations[-1][0]   # calls the last iteration ran (only the last may have run none)
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
            if not ran and self._queue:  # everything waits for a slot: look again shortly
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), WAIT_FOR_SLOT_POLL_S)
                except asyncio.TimeoutError:
                    pass

    def _iterate_while_unchanged(self, batch: list[_Queued]) -> tuple[dict[int, Any], list[tuple[int, float]]]:
        """(worker thread) Iterations over batch's calls, one after another while each runs calls
        without answering any and the event loop has changed nothing: no call arrived, none was
        released, none was given up by its caller, no reader waits for a moment between
        iterations. -> the last iteration's answers, and (calls run, seconds) of every iteration.
        The event loop only appends to the queue and sets flags while an iteration runs, so
        reading them here is a safe test."""
        calls, iterations = [queued.call for queued in batch], []
        while True:
            started = time.perf_counter()
            results, ran = self._iterate_isolating(calls)
            iterations.append((ran, time.perf_counter() - started))
            if (results or not ran or len(self._queue) != len(batch) or self._pending_releases
                    or self._reader_waiting or any(queued.future.done() for queued in batch)):
                return results, iterations

    def _iterate_isolating(self, calls: list[Any]) -> tuple[dict[int, Any], int]:
        """iterate(calls); if it fails as a whole, each call again alone (in the worker thread), so
        a failure is answered to the call that cannot run, not to every call that shared its batch."""
        try:
            return self._iterate(calls)
        except Exception as exc:
            if len(calls) == 1:
                return {0: exc}, 1
            logger.warning("an iteration over %d calls failed (%s: %s); running each call alone",
                           len(calls), type(exc).__name__, exc)
        results: dict[int, Any] = {}
        ran = 0
        for index, call in enumerate(calls):
            try:
                alone, ran_alone = self._iterate([call])
            except Exception as exc:
                alone, ran_alone = {0: exc}, 1
            ran += ran_alone
            if 0 in alone:  # left out: it waits in the queue, as it would have in the batch
                results[index] = alone[0]
        return results, ran

    def _expire_waiting(self) -> None:
        """Calls that waited to be admitted past the admission deadline get EngineOverloadedError;
        a call whose sequence the engine holds is past admission, and its clock starts again."""
        now = time.monotonic()
        kept = []
        for queued in self._queue:
            if self._admitted is not None and self._admitted(queued.call.seq_id):
                queued.waiting_since_s = now
            if now - queued.waiting_since_s > self._admission_timeout_s:
                queued.future.set_exception(EngineOverloadedError(
                    f"not admitted within {self._admission_timeout_s:.0f} s: no KV slot or blocks became free"))
            else:
                kept.append(queued)
        self._queue = kept


def observed(answer: asyncio.Future) -> None:
    """A done-callback for an answer nobody awaits (a dropped pre-draft, a prefill whose failure
    shows at the next call): its failure is expected and must not be logged as unhandled."""
    if not answer.cancelled():
        answer.exception()
