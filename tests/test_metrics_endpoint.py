"""The local Prometheus endpoint: which port it gets, and (on a real local Ray cluster) that it
serves Prometheus text carrying what common.metrics records, under the documented names."""

from __future__ import annotations

import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from specserve.common.config import SpecServeConfig
from specserve.cluster.local import init_local_ray, metrics_export_port, metrics_system_config, metrics_url
from specserve.common.metrics import METRICS, EngineMetrics, RouterMetrics
from tests.local_server import free_port


def _config(port: int, interval_ms: int = 10_000) -> SpecServeConfig:
    return SpecServeConfig.model_validate(
        {"observability": {"metrics_export_port": port, "metrics_report_interval_ms": interval_ms}})


def test_default_metrics_port_is_8080_like_the_kuberay_head():
    assert SpecServeConfig().observability.metrics_export_port == 8080


def test_a_free_configured_port_is_used():
    assert metrics_export_port(_config(9123), is_free=lambda port: True) == 9123


def test_a_taken_port_lets_ray_pick_one_rather_than_hang_at_startup():
    assert metrics_export_port(_config(9123), is_free=lambda port: False) is None


def test_port_zero_means_any_free_port():
    assert metrics_export_port(_config(0), is_free=lambda port: True) is None


@ray.remote(num_cpus=0)
class TinyEngine:
    """Stands in for an engine and a router: records through common.metrics only. It keeps
    its metric objects alive, as real ones do: a gauge whose object is collected stops exporting."""

    def record(self, pool: str) -> float:
        self.engine = engine = EngineMetrics(pool, f"{pool}-0")
        engine.record_forward(batch_rows=3, busy_s=0.25, idle_s=0.5)
        engine.record_forward(batch_rows=5, busy_s=0.25, idle_s=0.25)
        engine.set_load(queue_depth=2, sequences=7)
        engine.record_prefix_cache(queries=32, hits=16)
        self.router = router = RouterMetrics(replica=f"router-{pool}")
        router.set_active_requests(1)
        router.record_request("length", {"num_emitted": 11, "num_drafted": 12, "num_accepted": 9,
                                         "target_passes": 3, "pipelined_rounds": 1, "num_discarded_ahead": 4})
        started = time.perf_counter()
        for _ in range(1000):
            router.record_round(0.01, 4)
        return (time.perf_counter() - started) / 1000  # seconds per round recorded


def _scrape(url: str) -> dict[str, list]:
    """{family name: [samples]} of one scrape, parsed by prometheus_client's own parser."""
    families: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            families.setdefault(sample.name, []).append(sample)
    return families


def _value(samples, **labels) -> float:
    return sum(s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.ray
def test_endpoint_serves_parsable_prometheus_text_with_our_metrics():
    port = free_port()
    config = _config(port, interval_ms=500)
    init_local_ray(num_cpus=2, include_dashboard=False, _metrics_export_port=metrics_export_port(config),
                   _system_config=metrics_system_config(config))
    try:
        url = metrics_url()
        assert url.endswith(f":{port}/metrics")
        actors = [TinyEngine.remote() for _ in range(2)]
        seconds_per_round = ray.get([actor.record.remote(pool) for actor, pool in zip(actors, ("draft", "target"))])
        print(f"record_round costs {1e6 * max(seconds_per_round):.1f} us inside a Ray actor")
        assert max(seconds_per_round) < 1e-3  # cheap enough to run every round

        wanted = {"ray_specserve_wasted_draft_tokens_total", "ray_specserve_engine_busy_seconds_total",
                  "ray_specserve_engine_batch_size_count", "ray_specserve_kv_sequences",
                  "ray_specserve_speculation_depth_count", "ray_specserve_active_requests"}
        deadline, families = time.monotonic() + 90, {}
        while time.monotonic() < deadline:  # Ray exports on its report interval: poll, don't sleep blindly
            families = _scrape(url)
            if wanted <= families.keys() and _value(families["ray_specserve_speculation_depth_count"]) == 2000:
                break
            time.sleep(0.5)
        assert wanted <= families.keys(), sorted(k for k in families if "specserve" in k)

        engine_metrics = [spec for spec in METRICS.values() if spec.tag_keys == ("pool", "replica")]
        for spec in engine_metrics:  # every engine metric appears for both pools
            name = spec.prometheus_names[-1]
            for pool in ("draft", "target"):
                assert _value(families[name], pool=pool, replica=f"{pool}-0") > 0, (name, pool)
        assert _value(families["ray_specserve_engine_busy_seconds_total"], pool="target") == pytest.approx(0.5)
        assert _value(families["ray_specserve_engine_idle_seconds_total"], pool="draft") == pytest.approx(0.75)
        assert _value(families["ray_specserve_kv_sequences"], pool="draft") == 7
        assert _value(families["ray_specserve_output_tokens_total"]) == 22
        assert _value(families["ray_specserve_wasted_draft_tokens_total"], reason="rejected") == 6
        assert _value(families["ray_specserve_wasted_draft_tokens_total"], reason="discarded_ahead") == 8
        assert _value(families["ray_specserve_requests_total"], finish_reason="length") == 2
        assert _value(families["ray_specserve_speculation_depth_count"]) == 2000
        assert _value(families["ray_specserve_active_requests"], replica="router-draft") == 1
    finally:
        ray.shutdown()
