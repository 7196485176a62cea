"""Replica decisions per pool, the load view built from reports, and the Decider's hysteresis."""

import pytest

from specserve.common.messages import ClassReport, EngineStats, RouterReport
from specserve.policies.decision import Decider, PolicySettings
from specserve.policies.depth import expected_tokens_per_round
from specserve.policies.load import LoadTracker, accept_rate_from_rounds
from specserve.policies.replicas import PoolLoad, ScalingThresholds, decide_replicas

BOUNDS = {"target": (1, 4), "draft": (1, 3)}
LONG_AGO = {"target": 1e9, "draft": 1e9}


def decide(target: PoolLoad, draft: PoolLoad, active: int = 8, since=LONG_AGO, previous=None):
    return decide_replicas({"target": target, "draft": draft}, active, BOUNDS, since, previous)


# --- replica decisions ------------------------------------------------------------------------

def test_growing_verify_queues_scale_the_target_pool_up():
    wanted, reasons = decide(PoolLoad(2, 0.70, queue_depth=5.0), PoolLoad(1, 0.5, 0.0))
    assert wanted == {"target": 3, "draft": 1}
    assert any("queued" in r for r in reasons)


def test_a_target_busy_all_the_time_scales_up():
    wanted, _ = decide(PoolLoad(1, 0.95, 0.0), PoolLoad(1, 0.4, 0.0))
    assert wanted["target"] == 2


def test_targets_idling_while_drafts_are_saturated_scale_the_draft_pool_up():
    wanted, reasons = decide(PoolLoad(2, 0.30, 0.0), PoolLoad(1, 0.95, 0.0))
    assert wanted == {"target": 2, "draft": 2}
    assert any("draft: busy" in r for r in reasons)


def test_idle_targets_without_requests_do_not_grow_the_draft_pool():
    wanted, _ = decide(PoolLoad(1, 0.0, 0.0), PoolLoad(1, 0.95, 0.0), active=0)
    assert wanted["draft"] == 1


def test_idle_pools_scale_down_one_step_at_a_time():
    wanted, _ = decide(PoolLoad(4, 0.05, 0.0), PoolLoad(3, 0.05, 0.0), active=0)
    assert wanted == {"target": 3, "draft": 2}


def test_no_scale_down_if_one_replica_fewer_would_be_busy():
    # 29% busy on 2 replicas projects to 58% on one: below the default 60%, so it may go; with a
    # 50% limit the same load must keep both.
    wanted, _ = decide(PoolLoad(2, 0.29, 0.0), PoolLoad(2, 0.29, 0.0), active=2)
    assert wanted == {"target": 1, "draft": 1}
    thresholds = ScalingThresholds(projected_busy_max=0.5)
    wanted, _ = decide_replicas({"target": PoolLoad(2, 0.29, 0.0), "draft": PoolLoad(2, 0.29, 0.0)}, 2,
                                BOUNDS, LONG_AGO, None, thresholds)
    assert wanted == {"target": 2, "draft": 2}


def test_the_band_between_thresholds_holds_the_count():
    wanted, reasons = decide(PoolLoad(2, 0.6, 0.5), PoolLoad(2, 0.6, 0.0))
    assert wanted == {"target": 2, "draft": 2} and reasons == []


def test_counts_stay_within_min_and_max():
    up, _ = decide(PoolLoad(4, 0.99, 9.0), PoolLoad(3, 0.99, 0.0))
    down, _ = decide(PoolLoad(1, 0.0, 0.0), PoolLoad(1, 0.0, 0.0), active=0)
    assert up["target"] == 4 and down == {"target": 1, "draft": 1}


def test_one_stream_keeping_its_target_busy_does_not_grow_the_pool():
    # A lone request stays on its engines: a second replica would get no work (measured flapping).
    wanted, _ = decide(PoolLoad(1, 0.95, 0.0), PoolLoad(1, 0.95, 0.0), active=1)
    assert wanted == {"target": 1, "draft": 1}
    wanted, _ = decide(PoolLoad(1, 0.95, 0.0), PoolLoad(1, 0.4, 0.0), active=2)
    assert wanted["target"] == 2


def test_more_replicas_than_requests_scale_down_even_if_the_one_in_use_is_busy():
    # 1 stream on 2 target replicas: mean busy 45% is above busy_low, but one replica serves nobody.
    wanted, reasons = decide(PoolLoad(2, 0.45, 0.0), PoolLoad(1, 0.9, 0.0), active=1)
    assert wanted["target"] == 1 and any("1 active requests for 2 replicas" in r for r in reasons)
    held, _ = decide(PoolLoad(2, 0.45, 0.0), PoolLoad(1, 0.9, 0.0), active=2)
    assert held["target"] == 2


def test_a_recent_change_is_held_through_the_cooldown():
    wanted, reasons = decide(PoolLoad(1, 0.1, 0.0), PoolLoad(1, 0.1, 0.0), active=0,
                             since={"target": 3.0, "draft": 1e9}, previous={"target": 2, "draft": 1})
    assert wanted["target"] == 2


def test_a_replica_asked_for_and_still_starting_is_not_given_up():
    # we asked for 3 targets, 2 report so far, load is unchanged: keep asking for 3, not 2 + 1 again
    wanted, _ = decide(PoolLoad(2, 0.95, 0.0), PoolLoad(1, 0.4, 0.0), previous={"target": 3, "draft": 1})
    assert wanted["target"] == 3
    steady, _ = decide(PoolLoad(2, 0.6, 0.0), PoolLoad(1, 0.6, 0.0), previous={"target": 3, "draft": 1})
    assert steady["target"] == 3


def test_a_pool_nobody_reports_on_gets_no_opinion():
    wanted, _ = decide_replicas({"target": PoolLoad(1, 0.5, 0.0)}, 1, BOUNDS, LONG_AGO)
    assert wanted == {"target": 1, "draft": None}


# --- load from reports ------------------------------------------------------------------------

def engine(pool: str, replica: str, busy_s: float, idle_s: float, queue_depth: int = 0, samples=()):
    return EngineStats(pool, replica, sequences=3, free_slots=10, queue_depth=queue_depth, forwards=1,
                       batch_rows_total=1, busy_s=busy_s, idle_s=idle_s, cost_samples=tuple(samples))


def router(name: str, active: int, rounds: int, drafted: int, accepted: int, active_by_class=None):
    return RouterReport(name, active, {"greedy": active} if active_by_class is None else active_by_class,
                        {"greedy": ClassReport(rounds, drafted, accepted)})


def test_busy_share_is_measured_between_reports_not_over_the_lifetime():
    tracker = LoadTracker()
    tracker.add_engine(engine("target", "a", busy_s=100.0, idle_s=900.0), now=0.0)   # lifetime 10% busy
    tracker.add_engine(engine("target", "a", busy_s=100.9, idle_s=900.1), now=1.0)   # last second 90%
    assert tracker.snapshot(1.0).pools["target"].busy_share == pytest.approx(0.9)
    tracker.add_engine(engine("target", "a", busy_s=100.9, idle_s=901.1), now=2.0)   # idle since
    assert tracker.snapshot(2.0).pools["target"].busy_share == pytest.approx(0.0)


def test_pre_drafts_count_as_idle_for_scaling_and_as_busy_for_the_fan_out():
    """A draft engine busy 90% of a second, 60 points of it pre-drafting only: the pool reads 30%
    busy to the autoscaler (optional work never adds replicas) and 90% to the fan-out, which then
    gives way; a draft pool with room keeps the configured fan-out."""
    from dataclasses import replace

    from specserve.policies.fan_out import fan_out_under_load

    tracker = LoadTracker()
    tracker.add_engine(engine("draft", "a", busy_s=10.0, idle_s=10.0), now=0.0)
    tracker.add_engine(replace(engine("draft", "a", busy_s=10.9, idle_s=10.1), speculative_s=0.6), now=1.0)
    pool = tracker.snapshot(1.0).pools["draft"]
    assert pool.busy_share == pytest.approx(0.3) and pool.busy_share_all == pytest.approx(0.9)
    assert fan_out_under_load(3, pool) == 0
    assert fan_out_under_load(3, PoolLoad(1, 0.1, 0.0, busy_share_all=0.2)) == 3
    assert 0 < fan_out_under_load(4, PoolLoad(1, 0.1, 0.0, busy_share_all=0.5)) < 4
    assert fan_out_under_load(3, None) == 3 and fan_out_under_load(0, pool) == 0


def test_pool_load_averages_engines_and_sums_sequences():
    tracker = LoadTracker()
    tracker.add_engine(engine("target", "a", 1.0, 1.0, queue_depth=4), now=0.0)
    tracker.add_engine(engine("target", "b", 0.0, 2.0, queue_depth=0), now=0.0)
    load = tracker.snapshot(0.5)
    assert load.pools["target"] == PoolLoad(replicas=2, busy_share=0.25, queue_depth=2.0, busy_share_all=0.25)
    assert load.sequences["target"] == 6


def test_silent_sources_expire():
    tracker = LoadTracker(ttl_s=5.0)
    tracker.add_engine(engine("draft", "a", 1.0, 1.0), now=0.0)
    tracker.add_router(router("r1", 3, 0, 0, 0), now=0.0)
    tracker.add_engine(engine("draft", "b", 1.0, 1.0), now=4.0)
    load = tracker.snapshot(6.0)
    assert load.pools["draft"].replicas == 1 and load.active_requests == 0


def test_active_requests_sum_over_routers_and_split_by_class():
    tracker = LoadTracker()
    tracker.add_router(router("r1", 3, 0, 0, 0, {"greedy": 2, "sampled": 1}), now=0.0)
    tracker.add_router(router("r2", 4, 0, 0, 0, {"greedy": 1, "sampled": 3}), now=0.0)
    load = tracker.snapshot(0.0)
    assert load.active_requests == 7
    assert load.classes["greedy"].active_requests == 3 and load.classes["sampled"].active_requests == 4


def test_acceptance_estimate_inverts_expected_tokens_per_round():
    # rounds at K = 4 with alpha = 0.8 accept E - 1 tokens each on average
    accepted_per_round = expected_tokens_per_round(0.8, 4) - 1
    assert accept_rate_from_rounds(1000, 4000, 1000 * accepted_per_round) == pytest.approx(0.8, abs=1e-6)
    assert accept_rate_from_rounds(10, 40, 40) == pytest.approx(0.99)


def test_acceptance_follows_the_recent_window():
    tracker = LoadTracker(ttl_s=100.0)
    tracker.add_router(router("r1", 1, 1000, 4000, 4000), now=0.0)        # long history: all accepted
    tracker.add_router(router("r1", 1, 1100, 4400, 4000), now=60.0)       # since: nothing accepted
    tracker.add_router(router("r1", 1, 1110, 4440, 4000), now=61.0)
    assert tracker.snapshot(61.0).classes["greedy"].accept_rate < 0.05


# --- the Decider ------------------------------------------------------------------------------

def loaded_tracker(target_busy: float, draft_busy: float, active: int) -> LoadTracker:
    tracker = LoadTracker(ttl_s=100.0)
    samples = [(tokens, 0.010 + 0.00001 * tokens) for tokens in (1, 2, 4, 8, 16)]
    for now in (0.0, 1.0):
        tracker.add_engine(engine("target", "t1", target_busy * now, (1 - target_busy) * now, samples=samples), now)
        tracker.add_engine(engine("draft", "d1", draft_busy * now, (1 - draft_busy) * now, samples=samples), now)
        tracker.add_router(router("r1", active, 100, 400, 300, {"greedy": active, "sampled": 0}), now)
    return tracker


def test_decider_uses_the_default_depth_until_costs_are_measurable():
    decider = Decider(PolicySettings(default_k=3, target_bounds=(1, 4), draft_bounds=(1, 4)))
    tracker = LoadTracker()
    tracker.add_engine(engine("target", "t1", 1.0, 1.0), 0.0)
    decision = decider.decide(tracker.snapshot(0.0), now=0.0)
    assert decision.num_draft_tokens == {"greedy": 3, "sampled": 3}


def test_decider_scales_the_bottleneck_and_versions_only_changes():
    decider = Decider(PolicySettings(target_bounds=(1, 4), draft_bounds=(1, 4)))
    first = decider.decide(loaded_tracker(0.3, 0.95, active=4).snapshot(1.0), now=100.0)
    assert (first.target_replicas, first.draft_replicas) == (1, 2)
    again = decider.decide(loaded_tracker(0.3, 0.95, active=4).snapshot(1.0), now=101.0)
    assert again.version == first.version == 1
    assert decider.decide(loaded_tracker(0.3, 0.95, active=4).snapshot(1.0), now=101.0).draft_replicas == 2


def test_decision_serialises_to_the_documented_shape():
    decision = Decider(PolicySettings()).decision.to_dict()
    assert set(decision) >= {"num_draft_tokens", "target_replicas", "draft_replicas", "version", "reasons"}
    assert set(decision["num_draft_tokens"]) == {"greedy", "sampled"}
    assert PolicySettings.from_dict(PolicySettings(draft_bounds=(1, 3)).to_dict()) == PolicySettings(draft_bounds=(1, 3))
