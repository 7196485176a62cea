"""`specserve status [--json]`: what the running local cluster holds and decides, at a glance.

Reads the engines directly (named actors in the `specserve` namespace, `stats()`), the router
(`Router.status()`: active and queued requests, the policy's depth) and Serve's own replica
view. `summarize` (pure) turns those into the JSON; `render_table` into the text form.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from specserve.common.messages import POOLS, EngineStats, KvUsage
from specserve.common.naming import DRAFT_TRAINER_PREFIX, ENGINE_NAMESPACE, parse_engine_actor_name

POOL_DEPLOYMENTS = {"draft": "DraftWorker", "target": "TargetWorker"}
TRAINING_FIELDS = ("draft_version", "trained_at", "trained_positions", "expected_acceptance_before",
                   "expected_acceptance_after", "live_acceptance_before", "live_acceptance_after",
                   "captured_positions", "captured_total", "passes", "training_now", "failed_loads")
STATS_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class UnreachableEngine:
    """A named engine actor whose stats could not be read (dying, or too busy to answer in time)."""

    pool: str
    replica: str
    error: str


def summarize(engine_stats: Sequence[EngineStats | UnreachableEngine], router_status: Mapping[str, Any] | None,
              running_replicas: Mapping[str, int], trainer_status: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The status document: per pool replicas, KV sequences, queue depth and engines; the policy's
    depth; the load; online draft training when it runs (the draft trainer's status). An engine
    whose stats could not be read appears with "error"."""
    pools: dict[str, dict[str, Any]] = {}
    for pool in POOLS:
        engines = [stats for stats in engine_stats if stats.pool == pool]
        alive = [e for e in engines if isinstance(e, EngineStats)]
        busy = sum(e.busy_s for e in alive)
        idle = sum(e.idle_s for e in alive)
        forwards = sum(e.forwards for e in alive)
        pools[pool] = {
            "replicas": int(running_replicas.get(pool, 0)),
            "sequences": sum(e.sequences for e in alive),
            "queue_depth": sum(e.queue_depth for e in alive),
            # Paged KV (decoding.paged_cache): blocks in use and free over the pool's engines.
            "kv_blocks_used": sum(e.kv.blocks_used for e in alive if e.kv is not None),
            "kv_blocks_free": sum(e.kv.blocks_free for e in alive if e.kv is not None),
            "kv_blocks_cached": sum(e.kv.blocks_cached for e in alive if e.kv is not None),
            # Prefix caching: the share of admitted sequences' tokens found in the cache (vLLM's hit rate).
            "prefix_cache_hit_rate": _hit_rate([e.kv for e in alive if e.kv is not None]),
            "mean_batch_size": sum(e.batch_rows_total for e in alive) / forwards if forwards else None,
            "utilisation": busy / (busy + idle) if busy + idle > 0 else None,
            "engines": [_engine_row(e) for e in engines],
        }
    router = dict(router_status or {})
    decision = router.get("policy") or {}
    return {
        "pools": pools,
        "policy": {"num_draft_tokens": router.get("num_draft_tokens"), "draft_kind": router.get("draft_kind"),
                   "decision": decision or None},
        "load": {"active_requests": int(router.get("active_requests", 0)),
                 "queued_requests": int(router.get("queued_requests", 0))},
        # How the answering router reaches its engines and ingress replicas: "local" sockets on
        # its host, "tcp" across hosts (common/channel.py).
        "channels": dict(router.get("channels") or {}),
        "draft_training": None if trainer_status is None else {
            key: trainer_status.get(key) for key in TRAINING_FIELDS},
    }


def _hit_rate(usages: Sequence[KvUsage]) -> float | None:
    queries = sum(usage.prefix_cache_queries for usage in usages)
    return sum(usage.prefix_cache_hits for usage in usages) / queries if queries else None


def _engine_row(engine: EngineStats | UnreachableEngine) -> dict[str, Any]:
    if isinstance(engine, UnreachableEngine):
        return asdict(engine)
    return {key: value for key, value in engine.to_dict().items() if key != "cost_samples"}


def render_table(summary: Mapping[str, Any]) -> str:
    """A few aligned lines a person reads at a glance."""
    def fmt(value: Any, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    rows = [("pool", "replicas", "sequences", "queue", "batch", "busy", "cache-hit")]
    for pool, info in summary["pools"].items():
        rows.append((pool, fmt(info["replicas"]), fmt(info["sequences"]), fmt(info["queue_depth"]),
                     fmt(info["mean_batch_size"]), fmt(info["utilisation"]), fmt(info["prefix_cache_hit_rate"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    load, policy = summary["load"], summary["policy"]
    lines.append(f"requests: {load['active_requests']} active, {load['queued_requests']} queued; "
                 f"draft depth for a greedy request now: {fmt(policy['num_draft_tokens'])} "
                 f"(drafting: {fmt(policy.get('draft_kind'))})")
    channels = summary.get("channels")
    if channels:
        lines.append("a router's channels: " + ", ".join(f"{count} {transport}"
                                                        for transport, count in sorted(channels.items())))
    training = summary.get("draft_training")
    if training:
        trained = "-" if training["trained_at"] is None else time.strftime(
            "%Y-%m-%d %H:%M:%S", time.localtime(training["trained_at"]))
        lines.append(f"draft version {training['draft_version']}: trained {trained} on "
                     f"{training['trained_positions']} captured positions; expected acceptance "
                     f"{fmt(training['expected_acceptance_before'])} -> {fmt(training['expected_acceptance_after'])}, "
                     f"live {fmt(training['live_acceptance_before'])} -> {fmt(training['live_acceptance_after'])}; "
                     f"{training['captured_positions']} positions held")
        for engine, failed in (training.get("failed_loads") or {}).items():
            lines.append(f"  draft engine {engine} could not load version {failed['version']} "
                         f"({failed['failures']} times; {failed['error']}); it keeps its weights")
    for pool, info in summary["pools"].items():
        for engine in info["engines"]:
            if "error" in engine:
                lines.append(f"  {pool} engine {engine.get('replica', '?')}: unreachable ({engine['error']})")
            elif engine.get("ranks"):
                lines.append(f"  {pool} engine {engine['replica']}: tensor-parallel group of {len(engine['ranks'])}")
                lines.extend(f"    {_rank_line(rank)}" for rank in engine["ranks"])
    return "\n".join(lines)


def _rank_line(rank: Mapping[str, Any]) -> str:
    """One rank of a tensor-parallel engine: where it runs and what it holds."""
    if rank.get("error"):
        return f"rank {rank['rank']}: failing ({rank['error']})"
    mib = 2 ** 20
    gpus = ",".join(rank["gpu_ids"]) or "none"
    return (f"rank {rank['rank']}: node {str(rank['node_id'])[:8]} gpu {gpus}; weights {rank['weight_bytes'] / mib:,.1f} "
            f"MiB, KV {rank['kv_tokens']:,} tokens, own RSS {rank['private_rss_bytes'] / mib:,.0f} MiB")


def read_engine_stats(timeout_s: float = STATS_TIMEOUT_S) -> list[EngineStats | UnreachableEngine]:
    """stats() of every named engine actor in the connected cluster; a dying one reads as unreachable."""
    import ray

    engine_stats = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        parsed = parse_engine_actor_name(entry["name"]) if entry["namespace"] == ENGINE_NAMESPACE else None
        if parsed is None:
            continue
        pool, replica = parsed
        try:
            actor = ray.get_actor(entry["name"], namespace=ENGINE_NAMESPACE)
            engine_stats.append(ray.get(actor.stats.remote(), timeout=timeout_s))
        except Exception as exc:  # a dying engine is reported, not fatal
            engine_stats.append(UnreachableEngine(pool, replica, type(exc).__name__))
    return engine_stats


def running_replicas() -> dict[str, int]:
    """RUNNING replicas per pool, as Serve sees them."""
    from ray import serve

    from specserve.cluster.builder import APP_NAME

    running = {}
    application = serve.status().applications.get(APP_NAME)
    for pool, deployment in POOL_DEPLOYMENTS.items():
        info = application.deployments.get(deployment) if application else None
        running[pool] = sum(count for state, count in (info.replica_states.items() if info else [])
                            if str(getattr(state, "value", state)) == "RUNNING")
    return running


def router_status(timeout_s: float = STATS_TIMEOUT_S) -> dict[str, Any] | None:
    """Router.status() of one router replica, or None when no router answers."""
    from ray import serve

    from specserve.cluster.builder import APP_NAME

    try:
        return serve.get_deployment_handle("Router", APP_NAME).status.remote().result(timeout_s=timeout_s)
    except Exception:
        return None


def trainer_status(timeout_s: float = STATS_TIMEOUT_S) -> dict[str, Any] | None:
    """The draft trainer's status (docs/online-learning.md), or None when none runs."""
    import ray

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == ENGINE_NAMESPACE and entry["name"].startswith(DRAFT_TRAINER_PREFIX):
            try:
                return ray.get(ray.get_actor(entry["name"], namespace=ENGINE_NAMESPACE).status.remote(),
                               timeout=timeout_s)
            except Exception:
                return None
    return None


def collect(address: str | None) -> dict[str, Any]:
    """Connect to the running cluster and gather the status document."""
    import ray

    ray.init(address=address or "auto", log_to_driver=False, configure_logging=False)
    return summarize(read_engine_stats(), router_status(), running_replicas(), trainer_status())


def main(address: str | None, as_json: bool) -> int:
    try:
        summary = collect(address)
    except ConnectionError as exc:
        print(f"specserve status: no running cluster found ({exc}); start one with `specserve serve`")
        return 2
    print(json.dumps(summary, indent=1) if as_json else render_table(summary))
    return 0
