"""/health's pool monitor: a busy engine is reported live, a dead one unavailable, and /health
never waits on an engine once the pool has been probed (deployments/pool_health.py)."""

import asyncio

from specserve.common.messages import EngineEndpoint
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
            return EngineEndpoint(engine, "127.0.0.1:9")
        self.get_engine = _Remote(get_engine)

def test_overall_status():
    assert overall_status({"target": "ok", "draft": "ok"}) == "ok"
    assert overall_status({"target": "ok", "draft": "unavailable"}) == "degraded"
    assert overall_status({"target": "unavailable", "draft": "ok"}) == "unavailable"
    assert overall_status({"target": "ok"}) == "ok"
    assert overall_status({"target": "ok", "draft": "unavailable"}, started=False) == "starting"
    assert overall_status({"target": "unavailable", "draft": "ok"}, started=False) == "starting"
    assert overall_status({"target": "ok", "draft": "ok"}, started=False) == "ok"

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

def _started(target: _Engine, draft: _Engine) -> PoolHealth:
    """A monitor that has seen both pools answer (start-up is over)."""
    health = PoolHealth({"target": _Pool(target), "draft": _Pool(draft)})
    assert asyncio.run(health.report())["status"] == "ok"
    return health

def test_dead_draft_is_degraded_dead_target_unavailable_slow_probe_times_out(monkeypatch):
    monkeypatch.setattr(pool_health, "PROBE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(pool_health, "PROBE_INTERVAL_S", 0.0)

    async def scenario(health: PoolHealth, pool: str, engine: _Engine) -> str:
        health.pools[pool] = _Pool(engine)
        await health.report()  # the probe that finds it
        await asyncio.sleep(0.3)
        return (await health.report())["status"]

    assert asyncio.run(scenario(_started(_Engine(), _Engine()), "draft", _Engine(dead=True))) == "degraded"
    assert asyncio.run(scenario(_started(_Engine(), _Engine()), "target", _Engine(ping_s=1.0))) == "unavailable"

def test_a_server_whose_pools_have_not_all_answered_is_starting_and_says_so_in_seconds(monkeypatch):
    """A draft still loading (its probe never answers) is not "degraded": the start is not over,
    and may yet fail. The report does not wait out the probe's timeout to say so."""
    monkeypatch.setattr(pool_health, "FIRST_VERDICT_WAIT_S", 0.2)

    async def scenario():
        loading = PoolHealth({"target": _Pool(_Engine()), "draft": _Pool(_Engine(ping_s=60.0))})
        started = asyncio.get_running_loop().time()
        report = await loading.report()
        assert asyncio.get_running_loop().time() - started < 1.0
        assert report == {"status": "starting", "pools": {"target": "ok", "draft": "unavailable"}}
        failed = PoolHealth({"target": _Pool(_Engine(dead=True)), "draft": _Pool(_Engine())})
        assert (await failed.report())["status"] == "starting"

    asyncio.run(scenario())
