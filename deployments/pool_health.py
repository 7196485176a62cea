"""Liveness of the worker pools as /health reports it, answered without waiting on an engine.

Why a monitor rather than a probe per request: a load balancer polls /health with a short timeout
of its own, and an engine busy with a long forward (or a Serve handle's first call, which waits for
the controller to publish the replica set) can take seconds to answer. Probing inline made /health
answer 503 exactly when the server was loaded, so a load balancer would pull a busy pod. Here one
background probe per pool runs at a time with a generous timeout; /health reads its last verdict.
A pool whose probe is still running keeps its previous verdict: busy is not dead. Only a probe that
fails, or that outlasts PROBE_TIMEOUT_S, marks a pool unavailable.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

PROBE_INTERVAL_S = 2.0   # how often each pool is probed while /health is being asked
PROBE_TIMEOUT_S = 15.0   # a probe slower than this counts as a dead engine (far beyond any forward)


def overall_status(pools: dict[str, str]) -> str:
    """ok when every pool answers; degraded when only the draft pool does not (requests run
    target-only); unavailable when the target pool does not (requests would get 503)."""
    if pools.get("target") != "ok":
        return "unavailable"
    return "ok" if all(state == "ok" for state in pools.values()) else "degraded"


class PoolHealth:
    """Last known liveness of each pool's engine, refreshed in the background."""

    def __init__(self, pools: dict[str, Any]) -> None:
        """pools: name -> a Serve handle whose get_engine() returns an engine actor with ping()."""
        self.pools = {name: handle for name, handle in pools.items() if handle is not None}
        self.verdicts: dict[str, str] = {}
        self._probes: dict[str, asyncio.Task] = {}
        self._probed_at: dict[str, float] = {}

    async def report(self) -> dict[str, Any]:
        """{"status": ..., "pools": {pool: "ok" | "unavailable"}}. Waits only for a pool never probed
        yet (at start-up, so readiness is real); otherwise answers from the last verdicts at once."""
        now = time.monotonic()
        for name in self.pools:
            probe = self._probes.get(name)
            if (probe is None or probe.done()) and now - self._probed_at.get(name, -PROBE_INTERVAL_S) >= PROBE_INTERVAL_S:
                self._probed_at[name] = now
                self._probes[name] = asyncio.get_running_loop().create_task(self._probe(name))
        unknown = [self._probes[name] for name in self.pools if name not in self.verdicts]
        if unknown:
            await asyncio.wait(unknown)
        pools = {name: self.verdicts[name] for name in self.pools}
        return {"status": overall_status(pools), "pools": pools}

    async def _probe(self, name: str) -> None:
        async def ping() -> None:
            engine = await self.pools[name].get_engine.remote()
            await engine.ping.remote()

        try:
            await asyncio.wait_for(ping(), PROBE_TIMEOUT_S)
            self.verdicts[name] = "ok"
        except Exception:
            self.verdicts[name] = "unavailable"
