"""common.metrics without a cluster: names, which response field feeds which counter, labels."""

from __future__ import annotations

from collections import defaultdict

import pytest
from ray.util import metrics as ray_metrics

from specserve.decoding.sequence import SpecStats
from specserve.common.metrics import (
    DISCARDED_AHEAD_FIELD,
    METRICS,
    REQUEST_COUNTER_FIELDS,
    EngineMetrics,
    PolicyMetrics,
    RouterMetrics,
    prometheus_metric_names,
)


@pytest.fixture
def recorded(monkeypatch):
    """Every specserve point recorded, summed per (metric name, frozen tags); gauges keep the last
    value. Ray Serve's own metrics are left out: a handle an earlier module left in this process
    may still record its points from a background thread while a test runs."""
    totals: dict = defaultdict(float)

    def record(self, value, tags=None):
        if not self._name.startswith("specserve_"):
            return
        key = (self._name, frozenset(self._get_final_tags(tags).items()))
        self._validate_tags(dict(key[1]))
        if isinstance(self, ray_metrics.Gauge):
            totals[key] = value
        else:
            totals[key] += value
    monkeypatch.setattr(ray_metrics.Metric, "_record", record)
    return totals


def total(recorded, name: str, **tags) -> float:
    """Sum over the series of `name` whose labels include `tags`."""
    return sum(value for (metric, labels), value in recorded.items()
               if metric == name and set(tags.items()) <= labels)


RESPONSES = [  # `speculation` dicts as responses carry them (only the counted fields matter)
    {"num_emitted": 64, "num_drafted": 70, "num_accepted": 51, "target_passes": 14, "pipelined_rounds": 5,
     "speculation_cache_misses": 3, DISCARDED_AHEAD_FIELD: 9, "acceptance_rate": 0.73},
    {"num_emitted": 1, "num_drafted": 0, "num_accepted": 0, "target_passes": 1, "pipelined_rounds": 0,
     "speculation_cache_misses": 0},
    {"num_emitted": 17, "num_drafted": 12, "num_accepted": 12, "target_passes": 4, "pipelined_rounds": 2,
     "speculation_cache_misses": 1, DISCARDED_AHEAD_FIELD: 0},
]


def test_counter_names_follow_prometheus_conventions():
    for spec in METRICS.values():
        assert spec.name.startswith("specserve_")
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name


def test_prometheus_names_carry_rays_prefix_and_histogram_suffixes():
    names = prometheus_metric_names()
    assert "ray_specserve_draft_tokens_total" in names
    assert "ray_specserve_wasted_draft_tokens_total" in names
    assert {"ray_specserve_engine_batch_size_bucket", "ray_specserve_engine_batch_size_sum",
            "ray_specserve_engine_batch_size_count"} <= names
    assert "ray_specserve_engine_batch_size" not in names


def test_issue_17_names_are_all_declared():
    required = {"specserve_draft_tokens_total", "specserve_accepted_tokens_total",
                "specserve_wasted_draft_tokens_total", "specserve_engine_batch_size",
                "specserve_engine_queue_depth", "specserve_engine_busy_seconds_total",
                "specserve_engine_idle_seconds_total", "specserve_kv_sequences", "specserve_speculation_depth"}
    assert required <= METRICS.keys()
    for name in required - {"specserve_draft_tokens_total", "specserve_accepted_tokens_total",
                            "specserve_wasted_draft_tokens_total", "specserve_speculation_depth"}:
        assert METRICS[name].tag_keys == ("pool", "replica"), name


def test_counted_fields_are_fields_of_the_response_stats():
    assert set(REQUEST_COUNTER_FIELDS) <= set(SpecStats().to_dict())


def test_request_counters_equal_the_sums_of_the_response_fields(recorded):
    router = RouterMetrics(replica="r1")
    for response in RESPONSES:
        router.record_request("length", response)
    for field, name in REQUEST_COUNTER_FIELDS.items():
        assert total(recorded, name) == sum(response[field] for response in RESPONSES), field
    assert total(recorded, "specserve_requests_total", finish_reason="length") == len(RESPONSES)


def test_wasted_tokens_split_rejected_and_discarded_ahead(recorded):
    router = RouterMetrics()
    for response in RESPONSES:
        router.record_request("stop", response)
    drafted = sum(response["num_drafted"] for response in RESPONSES)
    accepted = sum(response["num_accepted"] for response in RESPONSES)
    assert total(recorded, "specserve_wasted_draft_tokens_total", reason="rejected") == drafted - accepted
    assert total(recorded, "specserve_wasted_draft_tokens_total", reason="discarded_ahead") == 9


def test_a_request_without_a_finish_reason_counts_as_aborted(recorded):
    RouterMetrics().record_request(None, SpecStats().to_dict())  # all zero: nothing else to add
    assert total(recorded, "specserve_requests_total", finish_reason="aborted") == 1
    assert total(recorded, "specserve_output_tokens_total") == 0


def test_round_records_latency_and_depth(recorded):
    router = RouterMetrics()
    router.record_round(0.012, 4)
    router.record_round(0.009, 0)
    assert total(recorded, "specserve_round_latency_s") == pytest.approx(0.021)
    assert total(recorded, "specserve_speculation_depth") == 4


def test_active_requests_are_labelled_with_the_router_replica(recorded):
    RouterMetrics(replica="abc").set_active_requests(3)
    assert total(recorded, "specserve_active_requests", replica="abc") == 3


def test_engine_points_carry_pool_and_replica(recorded):
    engine = EngineMetrics("target", "t1")
    engine.record_forward(batch_rows=8, busy_s=0.05, idle_s=0.0)
    engine.record_forward(batch_rows=2, busy_s=0.02, idle_s=0.01)
    engine.set_load(queue_depth=3, sequences=5)
    engine.record_prefix_cache(queries=40, hits=16)
    engine.record_prefix_cache(queries=10, hits=0)
    for (name, labels), _ in recorded.items():
        assert {("pool", "target"), ("replica", "t1")} <= labels, name
    assert total(recorded, "specserve_engine_busy_seconds_total") == pytest.approx(0.07)
    assert total(recorded, "specserve_engine_idle_seconds_total") == pytest.approx(0.01)
    assert total(recorded, "specserve_engine_batch_size") == 10
    assert total(recorded, "specserve_kv_sequences") == 5
    assert total(recorded, "specserve_engine_queue_depth") == 3
    assert total(recorded, "specserve_prefix_cache_queries_total") == 50
    assert total(recorded, "specserve_prefix_cache_hits_total") == 16


def test_policy_decisions_are_gauges_per_class_and_pool(recorded):
    policy = PolicyMetrics()
    policy.record_decision({"greedy": 6, "sampled": 3}, {"draft": 1, "target": 2})
    policy.record_decision({"greedy": 2}, {})
    assert total(recorded, "specserve_policy_num_draft_tokens", request_class="greedy") == 2
    assert total(recorded, "specserve_policy_num_draft_tokens", request_class="sampled") == 3
    assert total(recorded, "specserve_policy_target_replicas", pool="target") == 2


def test_rounds_count_by_draft_version_and_a_draft_engine_shows_its_version(recorded):
    from specserve.common.metrics import DraftVersionMetrics

    router = RouterMetrics()
    router.record_version_round(0, drafted=5, accepted=3)
    router.record_version_round(1, drafted=4, accepted=4)
    router.record_version_round(1, drafted=2, accepted=0)
    assert total(recorded, "specserve_draft_tokens_by_version_total", draft_version="1") == 6
    assert total(recorded, "specserve_accepted_tokens_by_version_total", draft_version="0") == 3
    engine = DraftVersionMetrics("d1")
    engine.set_version(0)
    engine.set_version(2)
    assert total(recorded, "specserve_draft_version", replica="d1") == 2
