"""`specserve status`: the document and table built from engine stats, the router and Serve."""

from cluster.messages import EngineStats
from cluster.status import UnreachableEngine, render_table, summarize

ENGINES = [
    EngineStats("target", "t1", sequences=3, free_slots=5, queue_depth=2, forwards=10, batch_rows_total=25,
                busy_s=3.0, idle_s=1.0, cost_samples=((5, 0.01),)),
    EngineStats("target", "t2", sequences=1, free_slots=7, queue_depth=0, forwards=10, batch_rows_total=15,
                busy_s=1.0, idle_s=3.0),
    EngineStats("draft", "d1", sequences=4, free_slots=4, queue_depth=1, forwards=4, batch_rows_total=8,
                busy_s=1.0, idle_s=1.0),
    UnreachableEngine("draft", "d2", "RayActorError"),
]
ROUTER = {"active_requests": 4, "queued_requests": 1, "num_draft_tokens": 3,
          "policy": {"num_draft_tokens": {"greedy": 3, "sampled": 2}}}


def test_the_document_sums_each_pool_and_carries_policy_and_load():
    summary = summarize(ENGINES, ROUTER, {"target": 2, "draft": 1})
    target, draft = summary["pools"]["target"], summary["pools"]["draft"]
    assert (target["replicas"], target["sequences"], target["queue_depth"]) == (2, 4, 2)
    assert target["mean_batch_size"] == 2.0 and target["utilisation"] == 0.5
    assert (draft["replicas"], draft["sequences"]) == (1, 4)
    assert summary["policy"]["num_draft_tokens"] == 3
    assert summary["load"] == {"active_requests": 4, "queued_requests": 1}
    assert all("cost_samples" not in engine for engine in target["engines"])


def test_no_router_and_no_engines_read_as_zero_not_a_crash():
    summary = summarize([], None, {})
    assert summary["pools"]["target"]["replicas"] == 0 and summary["load"]["active_requests"] == 0
    assert summary["policy"]["num_draft_tokens"] is None


def test_the_table_names_every_pool_and_an_unreachable_engine():
    table = render_table(summarize(ENGINES, ROUTER, {"target": 2, "draft": 1}))
    lines = table.splitlines()
    assert lines[0].split() == ["pool", "replicas", "sequences", "queue", "batch", "busy"]
    assert lines[1].split()[:3] == ["target", "2", "4"] and lines[2].split()[:3] == ["draft", "1", "4"]
    assert "4 active, 1 queued" in table and "d2: unreachable (RayActorError)" in table
