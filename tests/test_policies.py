"""Depth policy: pure functions of a request's acceptance history."""

import pytest

from policies.depth import RoundCosts, choose_draft_depth, expected_speedup, expected_tokens_per_round


def test_expected_tokens_matches_the_geometric_formula():
    assert expected_tokens_per_round(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens_per_round(1.0, 4) == pytest.approx(5.0)
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_speedup_penalises_expensive_drafts():
    assert expected_speedup(0.8, 4, 0.1) > expected_speedup(0.8, 4, 0.5)


def test_high_acceptance_drafts_deep():
    assert choose_draft_depth(990, 1000, 0.05, 1, 8) == 8


def test_low_acceptance_drafts_shallow():
    assert choose_draft_depth(100, 1000, 0.2, 1, 8) == 1


def test_low_acceptance_may_stop_speculating_when_allowed():
    assert choose_draft_depth(0, 1000, 0.5, 0, 8) == 0


def test_depth_stays_within_bounds():
    for accepted in range(0, 101, 10):
        assert 2 <= choose_draft_depth(accepted, 100, 0.1, 2, 5) <= 5


def test_new_request_starts_at_a_moderate_depth():
    assert 2 <= choose_draft_depth(0, 0, 0.12, 1, 8) <= 6


def test_per_round_overhead_argues_for_deeper_rounds():
    cheap_transport = choose_draft_depth(30, 60, 0.15, 1, 8, overhead_ratio=0.0)
    costly_transport = choose_draft_depth(30, 60, 0.15, 1, 8, overhead_ratio=1.0)
    assert costly_transport > cheap_transport


def observe(costs: RoundCosts, draft_s: float, num_draft_tokens: int, target_s: float, overhead_s: float) -> None:
    costs.observe_draft(draft_s, num_draft_tokens)
    costs.observe_round(target_s, overhead_s)


def test_round_costs_measure_ratios_in_target_pass_units():
    costs = RoundCosts(draft_cost_ratio=0.5)
    observe(costs, draft_s=0.004, num_draft_tokens=4, target_s=0.010, overhead_s=0.003)
    assert costs.draft_cost_ratio == pytest.approx(0.1)
    assert costs.overhead_ratio == pytest.approx(0.3)


def test_round_costs_keep_the_configured_ratio_until_a_draft_is_timed():
    costs = RoundCosts(draft_cost_ratio=0.2)
    observe(costs, draft_s=0.0, num_draft_tokens=0, target_s=0.010, overhead_s=0.001)
    assert costs.draft_cost_ratio == 0.2
    assert costs.overhead_ratio == pytest.approx(0.1)


def test_round_costs_smooth_out_one_slow_round():
    costs = RoundCosts(draft_cost_ratio=0.1, smoothing=0.1)
    for _ in range(20):
        observe(costs, 0.004, 4, 0.010, 0.002)
    observe(costs, 0.004, 4, 0.100, 0.002)  # one stalled target pass
    assert costs.draft_cost_ratio > 0.05


def test_pipelined_rounds_do_not_drag_the_draft_cost_towards_zero():
    """A round whose block was drafted ahead waits 0 s on the draft, but drafting still cost its
    engine time: the router feeds c the ahead call's own seconds (observe_draft), never a 0."""
    costs = RoundCosts(draft_cost_ratio=0.15)
    observe(costs, draft_s=0.006, num_draft_tokens=4, target_s=0.010, overhead_s=0.001)
    for _ in range(50):  # pipelined rounds: the ahead call drafted 5 tokens in 7.5 ms
        costs.observe_draft(0.0075, 5)
        costs.observe_round(0.010, 0.001)
    assert costs.draft_cost_ratio == pytest.approx(0.15, rel=0.01)


def test_draft_ahead_only_for_a_lone_greedy_request():
    from policies.depth import should_draft_ahead

    assert should_draft_ahead(True, True, 1)
    assert not should_draft_ahead(True, True, 2)    # the draft engine has other work meanwhile
    assert not should_draft_ahead(True, False, 1)   # sampled bonus tokens are rarely guessed
    assert not should_draft_ahead(False, True, 1)
