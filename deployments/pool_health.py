"""Liveness of the worker pools as /health reports it, answered without waiting on an engine.

Why a monitor rather than a probe per request: a load balancer polls /health with a short timeout
of its own, and an engine busy with a long forward (or a Serve handle's first call, which waits for
the controller to publish the replica set) can take seconds to answer. Probing inline made /health
answer 503 exactly when the server was loaded, so a load balancer would pull a busy pod. Here one
background probe per pool runs at a time with a generous timeout; /health reads its last verdict.
A pool whose probe is still running keeps its previous verdict: busy is not dead. Only a probe that
fails, or that outlasts PROBE_TIMEOUT_S, marks a pool unavailable.

Start-up is its own state: until every pool has answered once (the engines are still loading, or
a start that is about to fail), the status is "starting", never "degraded": a server whose draft
is still loading, or will never load, must not look ready to a client that waits for it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

PROBE_INTERVAL_S = 2.0   # how often each pool is probed while /health is being asked
PROBE_TIMEOUT_S = 15.0   # a probe slower than this counts as a dead engine (far beyond any forward)
FIRST_VERDICT_WAIT_S = 2.0  # how long a report waits for a pool's first probe (a loading engine answers none)


def overall_status(pools: dict[str, str], started: bool = True) -> str:
    """ok when every pool answers; before every pool has answered once (started False), starting;
    then degraded when only the draft pool does not (requests run target-only); unavailable when
    the target pool does not (requests would get 503)."""
    if not started and not all(state == "ok" for state in pools.values()):
        return "starting"
    if pools.get("target") != "ok":
        return "unavailable"
    return "ok" if all(state == "ok" for state in pools.values()) else "degraded"


class PoolHealth:
    """Last known liveness of each pool's engine, refreshed in the background."""

    def __init__(self, pools: dict[str, Any]) -> None:
        """pools: name -> a Serve handle whose get_engine() returns an EngineEndpoint (its actor has ping())."""
        self.pools = {name: handle for name, handle in pools.items() if handle is not None}
        self.verdicts: dict[str, str] = {}
        self._probes: dict[str, asyncio.Task] = {}
        self._probed_at: dict[str, float] = {}
        self.started = False  # every pool has answered once

    async def report(self) -> dict[str, Any]:
        """{"status": ..., "pools": {pool: "ok" | "unavailable"}}. Waits up to FIRST_VERDICT_WAIT_S
        only for a pool never probed yet (so the first report after start-up is real, and a
        health check of a server still loading is answered "starting" in seconds, not after a
        probe's timeout); otherwise answers from the last verdicts at once."""
        now = time.monotonic()
        for name in self.pools:
            probe = self._probes.get(name)
            if (probe is None or probe.done()) and now - self._probed_at.get(name, -PROBE_INTERVAL_S) >= PROBE_INTERVAL_S:
                self._probed_at[name] = now
                self._probes[name] = asyncio.get_running_loop().create_task(self._probe(name))
        unknown = [self._probes[name] for name in self.pools if name not in self.verdicts]
        if unknown:
            await asyncio.wait(unknown, timeout=FIRST_VERDICT_WAIT_S)
        pools = {name: self.verdicts.get(name, "unavailable") for name in self.pools}
        status = overall_status(pools, self.started)
        self.started = status != "starting"
        return {"status": status, "pools": pools}

    async def _probe(self, name: str) -> None:
        async def ping() -> None:
            engine = await self.pools[name].get_engine.remote()
            await engine.actor.ping.remote()

        try:
            await asyncio.wait_for(ping(), PROBE_TIMEOUT_S)
            self.verdicts[name] = "ok"
        except Exception:
            self.verdicts[name] = "unavailable"
