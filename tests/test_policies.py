"""Depth policy and the acceptance estimator: pure functions of a request's acceptance history."""

import random

import pytest

from specserve.policies.acceptance import (
    PRIOR_ACCEPTED,
    PRIOR_REJECTED,
    acceptance_from_tokens_per_round,
    acceptance_posterior_mean,
    estimate_acceptance_rate,
)
from specserve.policies.depth import RoundCosts, choose_draft_depth, expected_speedup, expected_tokens_per_round


def simulate_rounds(alpha: float, depth: int, num_rounds: int, seed: int = 0) -> tuple[int, int, int, int]:
    """(accepted, drafted, rounds, rounds that ended in a rejection) for rounds of the geometric model."""
    rng = random.Random(seed)
    accepted = rejecting = 0
    for _ in range(num_rounds):
        n = 0
        while n < depth and rng.random() < alpha:
            n += 1
        accepted += n
        rejecting += n < depth
    return accepted, depth * num_rounds, num_rounds, rejecting


# -- acceptance estimator ----------------------------------------------------------------------------

def test_estimate_recovers_per_token_alpha_from_totals():
    accepted, drafted, rounds, _ = simulate_rounds(0.93, 4, 5000)
    assert estimate_acceptance_rate(accepted, drafted, rounds) == pytest.approx(0.93, abs=0.006)


def test_accepted_over_drafted_is_not_alpha():
    """accepted / drafted, easily mistaken for alpha, is (E - 1) / K: about 0.84 at alpha 0.93, K 4."""
    accepted, drafted, rounds, _ = simulate_rounds(0.93, 4, 5000)
    assert accepted / drafted == pytest.approx((expected_tokens_per_round(0.93, 4) - 1) / 4, abs=0.01)
    assert accepted / drafted < 0.86 < estimate_acceptance_rate(accepted, drafted, rounds)


def test_estimate_from_totals_agrees_with_the_exact_truncated_geometric_posterior():
    accepted, drafted, rounds, rejecting = simulate_rounds(0.7, 5, 3000, seed=1)
    exact = acceptance_posterior_mean(accepted, rejecting)
    assert estimate_acceptance_rate(accepted, drafted, rounds) == pytest.approx(exact, abs=0.01)


def test_a_fresh_request_starts_at_the_prior_mean():
    assert estimate_acceptance_rate(0, 0, 0) == pytest.approx(PRIOR_ACCEPTED / (PRIOR_ACCEPTED + PRIOR_REJECTED))


def test_one_unlucky_round_does_not_collapse_the_estimate():
    assert estimate_acceptance_rate(0, 4, 1) == pytest.approx(PRIOR_ACCEPTED / (PRIOR_ACCEPTED + PRIOR_REJECTED + 1))


def test_without_a_prior_the_estimate_is_the_tokens_per_round_fit():
    for accepted, drafted, rounds in [(50, 100, 25), (0, 40, 10), (40, 40, 10), (333, 700, 140)]:
        fit = acceptance_from_tokens_per_round(1 + accepted / rounds, drafted / rounds)
        assert estimate_acceptance_rate(accepted, drafted, rounds, 0.0, 0.0) == pytest.approx(fit, abs=1e-9)


def test_the_benchmark_reports_the_policy_estimator_without_its_prior():
    from specserve.bench.perfmodel import measured_acceptance_rate

    assert measured_acceptance_rate(333, 700, 140) == estimate_acceptance_rate(333, 700, 140, 0.0, 0.0)


def test_estimate_refuses_more_accepted_than_drafted():
    with pytest.raises(ValueError):
        estimate_acceptance_rate(5, 4, 1)


# -- depth ---------------------------------------------------------------------------------------------

def test_high_alpha_drafts_deeper_than_the_ratio_would_have():
    """At alpha 0.93 and c 0.15 the best K is 8 (reading accepted/drafted, 0.84, as alpha gave 5)."""
    accepted, drafted, rounds, _ = simulate_rounds(0.93, 4, 2000)
    assert choose_draft_depth(accepted, drafted, 0.15, 1, 8, num_rounds=rounds) == 8


def test_expected_tokens_matches_the_geometric_formula():
    assert expected_tokens_per_round(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens_per_round(1.0, 4) == pytest.approx(5.0)
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_speedup_penalises_expensive_drafts():
    assert expected_speedup(0.8, 4, 0.1) > expected_speedup(0.8, 4, 0.5)


def test_high_acceptance_drafts_deep():
    assert choose_draft_depth(990, 1000, 0.05, 1, 8, num_rounds=250) == 8


def test_low_acceptance_drafts_shallow():
    assert choose_draft_depth(100, 1000, 0.2, 1, 8, num_rounds=250) == 1


def test_low_acceptance_may_stop_speculating_when_allowed():
    assert choose_draft_depth(0, 1000, 0.5, 0, 8, num_rounds=250) == 0


def test_depth_stays_within_bounds():
    for accepted in range(0, 101, 10):
        assert 2 <= choose_draft_depth(accepted, 100, 0.1, 2, 5, num_rounds=25) <= 5


def test_new_request_starts_at_a_moderate_depth():
    assert 2 <= choose_draft_depth(0, 0, 0.12, 1, 8, num_rounds=0) <= 6


def test_per_round_overhead_argues_for_deeper_rounds():
    cheap_transport = choose_draft_depth(30, 60, 0.15, 1, 8, overhead_ratio=0.0, num_rounds=15)
    costly_transport = choose_draft_depth(30, 60, 0.15, 1, 8, overhead_ratio=1.0, num_rounds=15)
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


def test_rounds_answered_from_the_speculation_cache_do_not_drag_the_draft_cost_towards_zero():
    """A round whose block was pre-drafted waits 0 s on the draft, but drafting still costs: the
    router feeds c only blocks drafted just in time (RoundLoop._propose), never a 0."""
    costs = RoundCosts(draft_cost_ratio=0.15)
    observe(costs, draft_s=0.006, num_draft_tokens=4, target_s=0.010, overhead_s=0.001)
    for _ in range(50):  # speculation cache hits: no draft call observed
        costs.observe_round(0.010, 0.001)
    assert costs.draft_cost_ratio == pytest.approx(0.15, rel=0.01)


# -- what a lone round of depth K costs on the wall clock ------------------------------------------

def test_round_wall_fit_recovers_the_line_a_lone_request_pays():
    from specserve.policies.depth import RoundWallFit

    fit = RoundWallFit()
    rng = random.Random(0)
    for _ in range(200):  # 15 ms + 3 ms a draft token, +-1 ms of noise
        k = rng.randint(2, 8)
        fit.observe(k, 0.015 + 0.003 * k + rng.uniform(-0.001, 0.001))
    intercept, slope = fit.line
    assert intercept == pytest.approx(0.015, abs=0.001)
    assert slope == pytest.approx(0.003, abs=0.0003)
    assert fit.cost_ratios() == (pytest.approx(0.2, abs=0.03), 0.0)


def test_round_wall_fit_gives_no_line_while_k_has_not_varied():
    from specserve.policies.depth import RoundWallFit

    fit = RoundWallFit()
    for _ in range(100):
        fit.observe(6, 0.030)
    assert fit.line is None and fit.cost_ratios() is None


def test_round_wall_fit_keeps_its_line_when_k_settles_and_follows_drift():
    from specserve.policies.depth import RoundWallFit

    fit = RoundWallFit()
    for i in range(100):
        k = 2 + i % 7
        fit.observe(k, 0.010 + 0.001 * k)
    first = fit.line
    for _ in range(300):  # K settles: its spread decays below the bound and the line stays
        fit.observe(5, 0.015)
    assert fit.line == (pytest.approx(first[0]), pytest.approx(first[1]))
    for i in range(300):  # the box slows down: the old rounds are forgotten
        k = 2 + i % 7
        fit.observe(k, 0.020 + 0.004 * k)
    assert fit.line == (pytest.approx(0.020, abs=1e-4), pytest.approx(0.004, abs=1e-5))


def test_a_steep_measured_line_drafts_shallower_than_engine_seconds_say():
    """The 2-core box alone: engine seconds say c ~ 0.1 of a round, the wall clock says 3 ms a
    draft token on a 15 ms intercept; at alpha 0.88 the first picks 8, the second 4 to 6."""
    from specserve.policies.depth import RoundWallFit, best_depth

    fit = RoundWallFit()
    for i in range(60):
        k = 3 + i % 6
        fit.observe(k, 0.015 + 0.003 * k)
    wall_c, wall_o = fit.cost_ratios()
    by_wall = best_depth(0.88, wall_c, 1, 8, wall_o)
    by_engine = best_depth(0.88, 0.1, 1, 8, 0.4)
    assert by_engine == 8 and 4 <= by_wall <= 6
