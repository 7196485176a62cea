"""`specserve status`: the document and table built from engine stats, the router and Serve."""

from specserve.common.messages import EngineStats, KvUsage
from specserve.cluster.status import UnreachableEngine, render_table, summarize

ENGINES = [
    EngineStats("target", "t1", sequences=3, free_slots=5, queue_depth=2, forwards=10, batch_rows_total=25,
                busy_s=3.0, idle_s=1.0, cost_samples=((5, 0.01),),
                kv=KvUsage(10, 90, 16, 150, 1 << 20, 0, blocks_cached=4, prefix_cache_queries=300,
                           prefix_cache_hits=96)),
    EngineStats("target", "t2", sequences=1, free_slots=7, queue_depth=0, forwards=10, batch_rows_total=15,
                busy_s=1.0, idle_s=3.0,
                kv=KvUsage(2, 98, 16, 20, 1 << 20, 0, blocks_cached=1, prefix_cache_queries=100,
                           prefix_cache_hits=4)),
    EngineStats("draft", "d1", sequences=4, free_slots=4, queue_depth=1, forwards=4, batch_rows_total=8,
                busy_s=1.0, idle_s=1.0),
    UnreachableEngine("draft", "d2", "RayActorError"),
]
ROUTER = {"active_requests": 4, "queued_requests": 1, "num_draft_tokens": 3, "draft_kind": "EAGLE-3 head",
          "policy": {"num_draft_tokens": {"greedy": 3, "sampled": 2}}, "channels": {"local": 2, "tcp": 1}}


def test_the_document_sums_each_pool_and_carries_policy_and_load():
    summary = summarize(ENGINES, ROUTER, {"target": 2, "draft": 1})
    target, draft = summary["pools"]["target"], summary["pools"]["draft"]
    assert (target["replicas"], target["sequences"], target["queue_depth"]) == (2, 4, 2)
    assert target["mean_batch_size"] == 2.0 and target["utilisation"] == 0.5
    assert (draft["replicas"], draft["sequences"]) == (1, 4)
    # Prefix caching over the pool: tokens found / tokens looked up; no figures, no rate.
    assert target["kv_blocks_cached"] == 5 and target["prefix_cache_hit_rate"] == 100 / 400
    assert draft["prefix_cache_hit_rate"] is None
    assert target["engines"][0]["kv_prefix_cache_hits"] == 96
    assert summary["policy"]["num_draft_tokens"] == 3
    assert "drafting: EAGLE-3 head" in render_table(summary)
    assert summary["load"] == {"active_requests": 4, "queued_requests": 1}
    assert all("cost_samples" not in engine for engine in target["engines"])


def test_no_router_and_no_engines_read_as_zero_not_a_crash():
    summary = summarize([], None, {})
    assert summary["pools"]["target"]["replicas"] == 0 and summary["load"]["active_requests"] == 0
    assert summary["channels"] == {} and "channels" not in render_table(summary)
    assert summary["policy"]["num_draft_tokens"] is None


def test_the_table_names_every_pool_and_an_unreachable_engine():
    table = render_table(summarize(ENGINES, ROUTER, {"target": 2, "draft": 1}))
    lines = table.splitlines()
    assert lines[0].split() == ["pool", "replicas", "sequences", "queue", "batch", "busy", "cache-hit"]
    assert lines[1].split()[:3] == ["target", "2", "4"] and lines[2].split()[:3] == ["draft", "1", "4"]
    assert lines[1].split()[-1] == "0.25" and lines[2].split()[-1] == "-"
    assert "4 active, 1 queued" in table and "d2: unreachable (RayActorError)" in table
    assert "a router's channels: 2 local, 1 tcp" in table


def test_a_tensor_parallel_engine_shows_its_group_and_each_rank():
    from dataclasses import replace

    from specserve.common.messages import RankStats

    mib = 1 << 20
    ranks = (RankStats(0, "node0123456789", ("0",), 300 * mib, 4096, 256, 700 * mib),
             RankStats(1, None, (), 0, 0, 0, 0, "RayActorError"))
    engines = [replace(ENGINES[0], ranks=ranks), ENGINES[1]]
    summary = summarize(engines, ROUTER, {"target": 2})
    shown = summary["pools"]["target"]["engines"][0]["ranks"]
    assert [rank["rank"] for rank in shown] == [0, 1] and shown[0]["gpu_ids"] == ["0"]
    assert summary["pools"]["target"]["engines"][1]["ranks"] == []
    table = render_table(summary)
    assert "target engine t1: tensor-parallel group of 2" in table
    assert "rank 0: node node0123 gpu 0; weights 300.0 MiB, KV 4,096 tokens, own RSS 700 MiB" in table
    assert "rank 1: failing (RayActorError)" in table
