"""The fast lane: a lone stream's rounds as one Ray Compiled Graph, router -> draft -> target -> router.

Why: a round over plain actor calls pays two round trips through Ray's task path (measured by
`python -m bench.transport` on the 2-core box: 1.9 ms for two chained calls to asyncio actors,
0.3 ms for the same two hops as a compiled graph; 5.8 ms median under a stream's own load,
bench/results/cpu-2core-thirdparty-http.json). A compiled graph sends its arguments through
shared-memory channels that stay open between executions.

Shape (docs/transport.md): Ray 2.60 runs an actor's part of a graph on the single thread of its
`_ray_system` concurrency group, so an engine can serve one graph at a time. The graph's methods
(`propose_in_graph`, `verify_in_graph`) hand their call to the engine's event loop, so lane calls
batch with everyone else's. A router claims both engines before it compiles (`claim_lane`); when
another router holds one, its requests take the ordinary path. The lane serves a router's lone
request (with company the ordinary path batches better). Drafting ahead moves into the draft
engine (`DraftEngine.propose_in_graph`): a graph round returns only after its verify, so the
router could not overlap the next block with it. Any failure in the lane closes it and the
round is redone on the ordinary path, which owns the fault handling (target failover, target-only
after a lost draft). A result is awaited under `asyncio.shield`: a graph's results must be read
in order, so a cancelled request's round is still read to its end, then dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


LANE_MIN_TIMEOUT_S = 2.0   # a lane round with no answer this long (or LANE_TIMEOUT_ROUNDS times the
LANE_TIMEOUT_ROUNDS = 50   # last round's time, if longer) has stalled: an engine of the graph died


class LaneStalledError(RuntimeError):
    """The graph gave no answer in time: one of its engines is gone."""


def actor_key(handle: Any) -> str:
    return handle._actor_id.hex()


class FastLane:
    """One compiled graph through one draft engine and one target engine, for one router."""

    def __init__(self, holder: str, draft: Any, target: Any, compiled: Any, compile_s: float) -> None:
        self.holder, self.draft, self.target = holder, draft, target
        self.key = (actor_key(draft), actor_key(target))
        self.compiled = compiled
        self.compile_s = compile_s
        self._lock = asyncio.Lock()  # one execution in flight: a lane serves one request at a time
        self.closed = False
        self.used_at = time.monotonic()
        self.round_s = 0.0  # the last round's wall time, for the stall deadline

    @classmethod
    async def open(cls, holder: str, draft: Any, target: Any) -> "FastLane | None":
        """Claim both engines and compile the graph; None when another router holds either."""
        from ray.dag import InputNode

        claims = await asyncio.gather(draft.claim_lane.remote(holder), target.claim_lane.remote(holder))
        if not all(claims):
            await _free(holder, draft, target)
            return None
        started = time.perf_counter()
        try:
            with InputNode() as call:
                dag = target.verify_in_graph.bind(call, draft.propose_in_graph.bind(call))
            compiled = dag.experimental_compile(enable_asyncio=True)
        except Exception:
            logger.warning("compiled graph failed to build; this router uses the ordinary path", exc_info=True)
            await _free(holder, draft, target)
            raise
        return cls(holder, draft, target, compiled, time.perf_counter() - started)

    async def round(self, call: dict) -> tuple[tuple, tuple]:
        """((proposal, draft span, drafting-ahead info), (rows, verify span)) of one round; raises
        what either engine raised, or LaneStalledError past a deadline. Why a deadline: when an
        engine of the graph dies mid-round, Ray 2.60 does not fail the execution, it never ends
        (measured: a killed draft engine left the request waiting until the client gave up)."""
        task = asyncio.ensure_future(self._execute(call))
        timeout_s = max(LANE_MIN_TIMEOUT_S, LANE_TIMEOUT_ROUNDS * self.round_s)
        try:
            result = await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except asyncio.TimeoutError:
            raise LaneStalledError(f"no answer from the compiled graph within {timeout_s:.1f} s") from None
        self.round_s = time.monotonic() - self.used_at
        return result

    async def _execute(self, call: dict) -> tuple[tuple, tuple]:
        async with self._lock:
            if self.closed:
                raise RuntimeError("fast lane closed")
            self.used_at = time.monotonic()
            result = await self.compiled.execute_async(call)
            return await result

    async def close_when_idle(self, idle_s: float) -> None:
        """Close the lane once it has carried no round for idle_s. Why: on Ray 2.60 an open graph's
        channel readers poll, so an idle graph burns about half a core in each engine actor and a
        core in the router (`python -m bench.graph_idle`); reopening costs one compile (~0.5 s)."""
        while not self.closed:
            await asyncio.sleep(max(0.0, self.used_at + idle_s - time.monotonic()) + 0.01)
            if not self.closed and not self._lock.locked() and time.monotonic() - self.used_at >= idle_s:
                await self.close()

    async def close(self, stalled: bool = False) -> None:
        """Tear the graph down (off the event loop: teardown waits for the actors' graph loops)
        and free both engines for whichever router claims them next. A round in flight is let
        finish first, unless the lane stalled: then it never will, and teardown is what ends it."""
        if self.closed:
            return
        self.closed = True
        if not stalled:
            await self._lock.acquire()
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.compiled.teardown)
        except Exception:
            logger.warning("compiled graph teardown failed", exc_info=True)
        finally:
            if not stalled:
                self._lock.release()
        await _free(self.holder, self.draft, self.target)


async def _free(holder: str, *engines: Any) -> None:
    for engine in engines:
        try:
            await engine.free_lane.remote(holder)
        except Exception:  # a dead engine holds nothing
            pass
