"""Every Ray metric specserve exports, in one place, and the few cheap calls that record them.

Why one module: the names are a contract (dashboards, alerts, the README, the dashboard test
all read them), so they are declared once as data (`METRICS`) and every class builds its
metrics from that table. Prometheus sees each name with Ray's ``ray_`` prefix.

Counters that agree with responses: `RouterMetrics.record_request` adds a finished request's
``speculation`` dict (the one its response carries) to the counters, field for field
(`REQUEST_COUNTER_FIELDS`), so over any set of finished requests each counter equals the sum
of its field over their responses exactly.

Cost: one record is a few microseconds (a dict merge and a call into Ray's C++ recorder);
per-round calls record two histogram points, per-forward calls at most three points.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ray.util import metrics

from specserve.common.messages import MAX_DRAFT_TOKENS

PROMETHEUS_PREFIX = "ray_"  # Ray's metrics agent prefixes every application metric with it

MetricKind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: its Ray name (without ``ray_``), kind, help text, labels, buckets."""

    name: str
    kind: MetricKind
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()

    def build(self, default_tags: Mapping[str, str] | None = None) -> metrics.Metric:
        if self.kind == "counter":
            metric = metrics.Counter(self.name, self.description, tag_keys=self.tag_keys)
        elif self.kind == "gauge":
            metric = metrics.Gauge(self.name, self.description, tag_keys=self.tag_keys)
        else:
            metric = metrics.Histogram(self.name, self.description, boundaries=list(self.boundaries),
                                       tag_keys=self.tag_keys)
        return metric.set_default_tags(dict(default_tags)) if default_tags else metric

    @property
    def prometheus_names(self) -> tuple[str, ...]:
        """The series names a scrape shows: histograms expand to _bucket, _sum and _count."""
        base = PROMETHEUS_PREFIX + self.name
        if self.kind == "histogram":
            return (f"{base}_bucket", f"{base}_sum", f"{base}_count")
        return (base,)


ENGINE_TAGS = ("pool", "replica")
_SECONDS_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
_DEPTH_BUCKETS = (0.5, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, MAX_DRAFT_TOKENS)  # K >= 0; Ray wants bounds > 0
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

METRICS: dict[str, MetricSpec] = {spec.name: spec for spec in (
    # Router: one series set per router replica, summed by Prometheus queries.
    MetricSpec("specserve_requests_total", "counter", "Requests finished, by finish reason",
               ("finish_reason",)),
    MetricSpec("specserve_output_tokens_total", "counter", "Tokens committed to outputs"),
    MetricSpec("specserve_draft_tokens_total", "counter", "Draft tokens proposed for verification"),
    MetricSpec("specserve_accepted_tokens_total", "counter", "Draft tokens the target accepted"),
    MetricSpec("specserve_wasted_draft_tokens_total", "counter",
               "Draft tokens computed for nothing: rejected by the target, or pre-drafted and dropped",
               ("reason",)),
    MetricSpec("specserve_target_passes_total", "counter",
               "Target forwards on behalf of requests, prefill included (output tokens / passes = tokens per pass)"),
    MetricSpec("specserve_pipelined_rounds_total", "counter",
               "Rounds whose block was ready when the verify answered: speculation cache hits"),
    MetricSpec("specserve_speculation_cache_misses_total", "counter",
               "Rounds drafted just in time although blocks were pre-drafted for the verification's outcomes"),
    MetricSpec("specserve_speculation_fan_out", "histogram",
               "Blocks pre-drafted per round for the verification's likely outcomes (0: plain rounds)",
               boundaries=(0.5, 1, 2, 3, 4, 6, 8, 12, 16)),
    MetricSpec("specserve_round_latency_s", "histogram", "Wall time of one speculative round",
               boundaries=_SECONDS_BUCKETS),
    MetricSpec("specserve_time_to_first_token_s", "histogram",
               "Router-side time from request start to its first token (Serve exports no TTFT)",
               boundaries=_SECONDS_BUCKETS + (1.0, 2.0, 5.0)),
    MetricSpec("specserve_speculation_depth", "histogram", "Draft tokens K verified per round",
               boundaries=_DEPTH_BUCKETS),
    MetricSpec("specserve_draft_failures_total", "counter", "Draft engine failures"),
    MetricSpec("specserve_active_requests", "gauge", "Requests in flight on this router replica",
               ("replica",)),
    # Policy actor: its latest decisions.
    MetricSpec("specserve_policy_num_draft_tokens", "gauge",
               "Depth K the policy allows a typical request of this class", ("request_class",)),
    MetricSpec("specserve_policy_target_replicas", "gauge",
               "Replicas the policy asks Serve for, per pool", ("pool",)),
    # Engines: one series set per engine, labelled pool (draft/target) and replica.
    MetricSpec("specserve_engine_batch_size", "histogram", "Sequences (rows) per engine forward",
               ENGINE_TAGS, _BATCH_BUCKETS),
    MetricSpec("specserve_engine_queue_depth", "gauge", "Calls waiting for this engine's next forward",
               ENGINE_TAGS),
    MetricSpec("specserve_engine_busy_seconds_total", "counter", "Seconds this engine spent in forwards",
               ENGINE_TAGS),
    MetricSpec("specserve_engine_idle_seconds_total", "counter",
               "Seconds between this engine's forwards (pipeline bubbles)", ENGINE_TAGS),
    MetricSpec("specserve_kv_sequences", "gauge", "Sequences whose KV cache this engine holds", ENGINE_TAGS),
    # vLLM's prefix-cache counters (vllm:prefix_cache_queries / _hits): hits / queries is the hit rate.
    MetricSpec("specserve_prefix_cache_queries_total", "counter",
               "Prompt tokens this engine looked for in its prefix cache (a new sequence's, a prefill chunk's)",
               ENGINE_TAGS),
    MetricSpec("specserve_prefix_cache_hits_total", "counter",
               "Prompt tokens this engine found in its prefix cache (not prefilled)", ENGINE_TAGS),
    # Online draft training (docs/online-learning.md): which weights draft, and how well each does.
    MetricSpec("specserve_draft_version", "gauge", "Draft weights version this draft engine serves "
               "(0: those the server started with)", ("replica",)),
    MetricSpec("specserve_draft_tokens_by_version_total", "counter",
               "Draft tokens proposed for verification, by the draft version that drafted them", ("draft_version",)),
    MetricSpec("specserve_accepted_tokens_by_version_total", "counter",
               "Draft tokens the target accepted, by the draft version that drafted them", ("draft_version",)),
)}

# A finished request's `speculation` field -> the counter it adds to. Every field is an int.
# wasted_draft_tokens_total{reason="rejected"} is num_drafted - num_accepted of the same dict.
REQUEST_COUNTER_FIELDS: dict[str, str] = {
    "num_emitted": "specserve_output_tokens_total",          # == usage.completion_tokens
    "num_drafted": "specserve_draft_tokens_total",
    "num_accepted": "specserve_accepted_tokens_total",
    "target_passes": "specserve_target_passes_total",
    "pipelined_rounds": "specserve_pipelined_rounds_total",
    "speculation_cache_misses": "specserve_speculation_cache_misses_total",
}
DISCARDED_AHEAD_FIELD = "num_discarded_ahead"  # -> wasted_draft_tokens_total{reason="discarded_ahead"}
WASTE_REASONS = ("rejected", "discarded_ahead")


def prometheus_metric_names() -> set[str]:
    """Every series name the project exports, as Prometheus sees it (for dashboards and tests)."""
    return {name for spec in METRICS.values() for name in spec.prometheus_names}


def _build(name: str, default_tags: Mapping[str, str] | None = None) -> metrics.Metric:
    return METRICS[name].build(default_tags)


def _inc(counter: metrics.Counter, value: float, tags: dict[str, str] | None = None) -> None:
    """Ray counters refuse increments <= 0; a zero is simply nothing to add."""
    if value > 0:
        counter.inc(value, tags=tags)


class RouterMetrics:
    """What a router replica records: per round, per finished request, and its load.

    The attribute names of the first seven metrics are those the router used before this module
    existed, so call sites like ``self.metrics.round_latency.observe(s)`` keep working."""

    def __init__(self, replica: str = "") -> None:
        self.requests = _build("specserve_requests_total")
        self.tokens = _build("specserve_output_tokens_total")
        self.drafted = _build("specserve_draft_tokens_total")
        self.accepted = _build("specserve_accepted_tokens_total")
        self.round_latency = _build("specserve_round_latency_s")
        self.draft_failures = _build("specserve_draft_failures_total")
        self.active = _build("specserve_active_requests", {"replica": replica or "router"})
        self.wasted = _build("specserve_wasted_draft_tokens_total")
        self.target_passes = _build("specserve_target_passes_total")
        self.pipelined_rounds = _build("specserve_pipelined_rounds_total")
        self.speculation_cache_misses = _build("specserve_speculation_cache_misses_total")
        self.fan_out = _build("specserve_speculation_fan_out")
        self.time_to_first_token = _build("specserve_time_to_first_token_s")
        self.speculation_depth = _build("specserve_speculation_depth")
        self.drafted_by_version = _build("specserve_draft_tokens_by_version_total")
        self.accepted_by_version = _build("specserve_accepted_tokens_by_version_total")
        by_name = {metric.info["name"]: metric for metric in vars(self).values()}
        self._counters = {field: by_name[name] for field, name in REQUEST_COUNTER_FIELDS.items()}

    def record_round(self, round_wall_s: float, num_draft_tokens: int) -> None:
        """One speculative round: its wall time and the K it verified (0 = a plain target step)."""
        self.round_latency.observe(round_wall_s)
        self.speculation_depth.observe(num_draft_tokens)

    def record_fan_out(self, num_blocks: int) -> None:
        """Blocks a round's draft engine was asked to pre-draft for its outcomes."""
        self.fan_out.observe(num_blocks)

    def record_version_round(self, draft_version: int, drafted: int, accepted: int) -> None:
        """One verified block of draft_version: drafted tokens and how many the target kept."""
        tags = {"draft_version": str(draft_version)}
        _inc(self.drafted_by_version, drafted, tags)
        _inc(self.accepted_by_version, accepted, tags)

    def record_first_token(self, time_to_first_token_s: float) -> None:
        self.time_to_first_token.observe(time_to_first_token_s)

    def record_draft_failure(self) -> None:
        self.draft_failures.inc()

    def set_active_requests(self, active_requests: int) -> None:
        self.active.set(active_requests)

    def record_request(self, finish_reason: str | None, speculation: Mapping[str, float]) -> None:
        """Add one finished request to the counters, from the `speculation` dict its response
        carries (or would have carried: aborted requests count too, as finish_reason "aborted")."""
        self.requests.inc(tags={"finish_reason": finish_reason or "aborted"})
        for field, counter in self._counters.items():
            _inc(counter, speculation.get(field, 0))
        _inc(self.wasted, speculation.get("num_drafted", 0) - speculation.get("num_accepted", 0),
             {"reason": "rejected"})
        _inc(self.wasted, speculation.get(DISCARDED_AHEAD_FIELD, 0), {"reason": "discarded_ahead"})


class PolicyMetrics:
    """The policy actor's latest decisions, as gauges."""

    def __init__(self) -> None:
        self.num_draft_tokens = _build("specserve_policy_num_draft_tokens")
        self.target_replicas = _build("specserve_policy_target_replicas")

    def record_decision(self, num_draft_tokens: Mapping[str, int], target_replicas: Mapping[str, int]) -> None:
        """num_draft_tokens by request class (e.g. greedy, sampled); target_replicas by pool."""
        for request_class, depth in num_draft_tokens.items():
            self.num_draft_tokens.set(depth, tags={"request_class": request_class})
        for pool, replicas in target_replicas.items():
            self.target_replicas.set(replicas, tags={"pool": pool})


class DraftVersionMetrics:
    """The draft weights version a draft engine serves."""

    def __init__(self, replica: str) -> None:
        self.version = _build("specserve_draft_version", {"replica": replica})

    def set_version(self, draft_version: int) -> None:
        self.version.set(draft_version)


class EngineMetrics:
    """What one engine records, labelled with its pool (draft / target) and replica."""

    def __init__(self, pool: str, replica: str) -> None:
        tags = {"pool": pool, "replica": replica}
        self.batch_size = _build("specserve_engine_batch_size", tags)
        self.queue_depth = _build("specserve_engine_queue_depth", tags)
        self.busy_seconds = _build("specserve_engine_busy_seconds_total", tags)
        self.idle_seconds = _build("specserve_engine_idle_seconds_total", tags)
        self.kv_sequences = _build("specserve_kv_sequences", tags)
        self.prefix_cache_queries = _build("specserve_prefix_cache_queries_total", tags)
        self.prefix_cache_hits = _build("specserve_prefix_cache_hits_total", tags)

    def record_forward(self, batch_rows: int, busy_s: float, idle_s: float) -> None:
        """One forward over batch_rows sequences, busy_s long, after idle_s without a forward."""
        self.batch_size.observe(batch_rows)
        _inc(self.busy_seconds, busy_s)
        _inc(self.idle_seconds, idle_s)

    def set_load(self, queue_depth: int, sequences: int) -> None:
        """Calls waiting now and KV sequences held now (call when either changes, or per forward)."""
        self.queue_depth.set(queue_depth)
        self.kv_sequences.set(sequences)

    def record_prefix_cache(self, queries: int, hits: int) -> None:
        """Tokens looked up in the prefix cache and found there since the last call."""
        _inc(self.prefix_cache_queries, queries)
        _inc(self.prefix_cache_hits, hits)
