"""The shipped Grafana dashboard queries only metrics that exist: the project's (introspected from
common.metrics) or Serve's own (names read from ray/serve/_private, listed below)."""

import json
import re
from pathlib import Path

from specserve.common.metrics import prometheus_metric_names

DASHBOARD = Path(__file__).resolve().parents[1] / "monitoring" / "specserve_grafana_dashboard.json"
# ray/serve/_private/deployment_state.py (replica health) and request_ingress_metrics.py
# (f"serve_{protocol}_request_latency_ms", a histogram), with Ray's "ray_" prefix.
SERVE_METRICS = {"ray_serve_deployment_replica_healthy", "ray_serve_http_request_latency_ms_bucket"}
METRIC_NAME = re.compile(r"\bray_[a-zA-Z0-9_]+")
PANELS_WANTED = ["Throughput", "Acceptance", "Wasted", "utilisation", "bubbles", "batch size", "depth K",
                 "Speculation cache",
                 "Replicas per pool", "Time to first token", "Request latency"]


def panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def test_every_query_names_an_exported_metric():
    known = prometheus_metric_names() | SERVE_METRICS
    for panel in panels():
        for target in panel["targets"]:
            names = METRIC_NAME.findall(target["expr"])
            assert names, (panel["title"], target["expr"])
            assert set(names) <= known, (panel["title"], sorted(set(names) - known))


def test_the_dashboard_covers_what_an_operator_needs():
    titles = " | ".join(panel["title"] for panel in panels())
    for wanted in PANELS_WANTED:
        assert wanted in titles, wanted


def test_a_misspelled_metric_would_be_caught():
    assert "ray_specserve_output_token_total" not in prometheus_metric_names() | SERVE_METRICS
