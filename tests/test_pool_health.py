"""/health's pool monitor: a busy engine is reported live, a dead one unavailable, and /health
never waits on an engine once the pool has been probed (deployments/pool_health.py)."""

import asyncio

from specserve.deployments import pool_health
from specserve.deployments.pool_health import PoolHealth, overall_status

class _Remote:
    """The `.remote()` shape of a Ray method: calling it gives an awaitable."""

    def __init__(self, coroutine_function):
        self.remote = coroutine_function

class _Engine:
    def __init__(self, ping_s: float = 0.0, dead: bool = False):
        async def ping():
            if dead:
                raise RuntimeError("actor died")
            await asyncio.sleep(ping_s)
            return True
        self.ping = _Remote(ping)

class _Pool:
    def __init__(self, engine: _Engine):
        async def get_engine():
            return engine
        self.get_engine = _Remote(get_engine)

def test_overall_status():
    assert overall_status({"target": "ok", "draft": "ok"}) == "ok"
    assert overall_status({"target": "ok", "draft": "unavailable"}) == "degraded"
    assert overall_status({"target": "unavailable", "draft": "ok"}) == "unavailable"
    assert overall_status({"target": "ok"}) == "ok"

def test_first_report_waits_for_a_verdict_then_a_busy_engine_stays_ok(monkeypatch):
    monkeypatch.setattr(pool_health, "PROBE_INTERVAL_S", 0.0)

    async def scenario():
        target = _Engine(ping_s=0.0)
        health = PoolHealth({"target": _Pool(target), "draft": None})
        assert await health.report() == {"status": "ok", "pools": {"target": "ok"}}
        # The engine turns busy: its ping now takes far longer than a load balancer waits.
        target.ping = _Engine(ping_s=5.0).ping
        loop = asyncio.get_running_loop()
        started = loop.time()
        for _ in range(5):
            assert (await health.report())["status"] == "ok"
        assert loop.time() - started < 0.5

    asyncio.run(scenario())

def test_dead_draft_is_degraded_dead_target_unavailable_slow_probe_times_out(monkeypatch):
    monkeypatch.setattr(pool_health, "PROBE_TIMEOUT_S", 0.2)

    async def scenario():
        degraded = PoolHealth({"target": _Pool(_Engine()), "draft": _Pool(_Engine(dead=True))})
        assert await degraded.report() == {"status": "degraded", "pools": {"target": "ok", "draft": "unavailable"}}
        down = PoolHealth({"target": _Pool(_Engine(ping_s=1.0)), "draft": _Pool(_Engine())})
        assert (await down.report())["status"] == "unavailable"

    asyncio.run(scenario())
