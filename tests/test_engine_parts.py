"""The small pieces an engine keeps beside its step (deployments.engine_parts) and the typed
messages engines, routers and the policy actor exchange (common.messages)."""

import pickle

import pytest

from specserve.common.messages import CallSpan, ClassReport, EngineStats, KvUsage, PolicyDecision, RouterReport
from specserve.deployments.engine_loop import SequenceReleasedError
from specserve.deployments.engine_parts import IdleSequences, ReleasedIds


def test_a_released_id_is_refused_until_it_ages_out_of_the_bounded_set():
    released = ReleasedIds(kept=2)
    released.check("a")                      # never released: fine
    released.add("a")
    with pytest.raises(SequenceReleasedError):
        released.check("a")
    released.add("b")
    released.add("c")                        # "a" is the oldest of three: forgotten
    released.check("a")
    with pytest.raises(SequenceReleasedError):
        released.check("c")


def test_only_sequences_untouched_for_the_ttl_expire_and_a_forgotten_one_never_does():
    idle = IdleSequences(ttl_s=10.0)
    idle.touch(["old", "gone"], now=0.0)
    idle.touch(["fresh"], now=8.0)
    idle.forget("gone")
    assert idle.expired(now=12.0) == ["old"]


def test_messages_survive_pickling_as_ray_sends_them():
    messages = [CallSpan(1.0, 1.5, 2.0),
                EngineStats("target", "t1", 1, 7, 0, 3, 5, 0.2, 0.8, ("0",), "node", ((4, 0.01),),
                            KvUsage(2, 18, 16, 20, 4096, 0)),
                RouterReport("r1", 2, {"greedy": 2, "sampled": 0}, {"greedy": ClassReport(3, 12, 9, (3, 3), (3, 2))},
                             0.004),
                PolicyDecision({"greedy": 4, "sampled": 2}, 1, None, 3, ["why"])]
    for message in messages:
        assert pickle.loads(pickle.dumps(message)) == message


def test_engine_stats_flatten_to_the_keys_specserve_status_shows():
    stats = EngineStats("target", "t1", 1, 7, 0, 3, 5, 0.2, 0.8, kv=KvUsage(2, 18, 16, 20, 4096, 1))
    flat = stats.to_dict()
    assert list(flat)[:9] == ["pool", "replica", "sequences", "free_slots", "queue_depth", "forwards",
                              "batch_rows_total", "busy_s", "idle_s"]
    assert (flat["kv_blocks_used"], flat["kv_preemptions"]) == (2, 1) and "kv" not in flat
    assert "kv_blocks_used" not in EngineStats("draft", "d1", 0, 8, 0, 0, 0, 0.0, 0.0).to_dict()
