"""Acceptance by draft position: counting, estimating, and what it changes in the depth choice.

Where drafts are accepted in streaks, the geometric model (one alpha for every
position) under-rates deep blocks; these tests pin the counters, the estimator and the effect."""

import random

import pytest

from specserve.common.messages import ClassReport, RouterReport
from specserve.policies.acceptance import (count_round_positions, expected_tokens_by_position, expected_tokens_per_round,
                                 position_accept_rates)
from specserve.policies.cost_curve import CostCurve
from specserve.policies.goodput import ClassLoad, choose_depths
from specserve.policies.load import MAX_POSITIONS, LoadTracker, accept_rate_from_rounds

# Streaky acceptance: once the first drafts are taken, the later ones are likelier to be.
STREAKY = (0.70, 0.80, 0.86, 0.90, 0.92, 0.94, 0.95, 0.96)


def simulate(rates: tuple[float, ...], depth: int, rounds: int, seed: int) -> tuple[list[int], list[int], list[int]]:
    """(reached, accepted, tokens emitted per round) of `rounds` seeded rounds at depth K."""
    rng = random.Random(seed)
    reached: list[int] = []
    accepted: list[int] = []
    emitted = []
    for _ in range(rounds):
        taken = 0
        while taken < depth and rng.random() < rates[taken]:
            taken += 1
        count_round_positions(reached, accepted, depth, taken)
        emitted.append(taken + 1)
    return reached, accepted, emitted


def true_tokens(rates: tuple[float, ...], depth: int) -> float:
    return expected_tokens_by_position(rates, depth)


def test_a_round_counts_the_positions_it_reached_and_accepted():
    reached: list[int] = []
    accepted: list[int] = []
    count_round_positions(reached, accepted, 4, 2)   # 2 taken, the 3rd rejected, the 4th never judged
    assert (reached, accepted) == ([1, 1, 1, 0], [1, 1, 0, 0])
    count_round_positions(reached, accepted, 4, 4)   # the whole block
    count_round_positions(reached, accepted, 2, 0)   # rejected at once, a shorter block
    assert (reached, accepted) == ([3, 2, 2, 1], [2, 2, 1, 1])
    count_round_positions(reached, accepted, 6, 9)   # out of range: clipped, never raised on the round path
    assert (reached, accepted) == ([4, 3, 3, 2, 1, 1], [3, 3, 2, 2, 1, 1])


def test_the_estimate_recovers_streaky_rates_and_the_tokens_of_a_deep_round():
    reached, accepted, emitted = simulate(STREAKY, 8, 20_000, seed=1)
    rates = position_accept_rates(reached, accepted, 8)
    for estimated, truth in zip(rates, STREAKY):
        assert estimated == pytest.approx(truth, abs=0.02)
    assert expected_tokens_by_position(rates, 8) == pytest.approx(sum(emitted) / len(emitted), rel=0.02)


def test_from_shallow_rounds_it_predicts_a_deep_round_better_than_the_geometric_fit():
    """Measured at K = 4, asked about K = 8 (what the policy does before it ever drafted 8 deep)."""
    reached, accepted, emitted = simulate(STREAKY, 4, 20_000, seed=2)
    rounds, took = len(emitted), sum(emitted) - len(emitted)
    geometric = expected_tokens_per_round(accept_rate_from_rounds(rounds, 4 * rounds, took), 8)
    by_position = expected_tokens_by_position(position_accept_rates(reached, accepted, 8), 8)
    truth = true_tokens(STREAKY, 8)
    assert geometric < 0.85 * truth                      # one alpha for every position: more than 15% short
    assert abs(by_position - truth) < 0.5 * abs(geometric - truth)


def test_positions_never_drafted_continue_the_last_one_measured():
    rates = position_accept_rates([100, 80], [80, 72], 5, first_prior=0.5)
    assert rates[2] == rates[3] == rates[4] == rates[1]
    assert rates[1] == pytest.approx((72 + 4 * rates[0]) / (80 + 4))
    assert position_accept_rates([], [], 3, first_prior=0.6) == pytest.approx((0.6, 0.6, 0.6))


def test_the_same_totals_read_by_position_draft_deeper_when_acceptance_is_streaky():
    """A CPU-like target (each verify token costs), a cheap draft: the geometric fit of streaky rounds
    stops short of the deepest K; the positional model sees that deep blocks pay and drafts deeper."""
    reached, accepted, emitted = simulate(STREAKY, 6, 5_000, seed=3)
    rounds, took = len(emitted), sum(emitted) - len(emitted)
    alpha = accept_rate_from_rounds(rounds, 6 * rounds, took)
    target = CostCurve(fixed_s=0.009, per_token_s=0.0006)
    draft = CostCurve(fixed_s=0.0012, per_token_s=0.00005)
    geometric, _ = choose_depths({"greedy": ClassLoad(2, alpha)}, target, draft, 1, 1, 1, 8)
    streaky = ClassLoad(2, alpha, position_accept_rates(reached, accepted, 8, alpha))
    by_position, _ = choose_depths({"greedy": streaky}, target, draft, 1, 1, 1, 8)
    assert by_position["greedy"] > geometric["greedy"]


def test_the_load_view_reads_position_counters_over_the_window():
    tracker = LoadTracker(ttl_s=100.0)
    before = ClassReport(10, 40, 20, reached=(10, 8, 6, 4), accepted_at=(8, 6, 4, 2))
    after = ClassReport(20, 80, 60, reached=(20, 18, 16, 14), accepted_at=(18, 16, 14, 12))
    tracker.add_router(RouterReport("r", 2, {"greedy": 2}, {"greedy": before}), now=0.0)
    tracker.add_router(RouterReport("r", 2, {"greedy": 2}, {"greedy": after}), now=1.0)
    greedy = tracker.snapshot(1.0).classes["greedy"]
    assert len(greedy.accept_by_position) == MAX_POSITIONS
    alpha = accept_rate_from_rounds(10, 40, 40)             # the window: every drafted token taken
    assert greedy.accept_rate == pytest.approx(alpha)
    assert greedy.accept_by_position[:4] == pytest.approx(position_accept_rates([10] * 4, [10] * 4, 4, alpha))


def test_a_class_without_position_counters_leaves_the_geometric_model():
    tracker = LoadTracker()
    tracker.add_router(RouterReport("r", 1, {"greedy": 1}, {"greedy": ClassReport(5, 20, 10)}), now=0.0)
    greedy = tracker.snapshot(0.0).classes["greedy"]
    assert greedy.accept_by_position == ()
    assert greedy.expected_tokens(4) == pytest.approx(expected_tokens_per_round(greedy.accept_rate, 4))


def test_a_request_leans_on_its_class_until_its_own_rounds_say_otherwise():
    from specserve.policies.acceptance import request_position_rates

    class_rates = (0.8, 0.9, 0.9)
    assert request_position_rates([], [], class_rates) == pytest.approx(class_rates)
    hard = request_position_rates([40, 8, 2], [8, 2, 0], class_rates)      # rejected early, round after round
    assert all(own < rate for own, rate in zip(hard, class_rates))
    assert hard[0] == pytest.approx((8 + 4 * 0.8) / (40 + 4))


def test_alone_a_streaky_request_drafts_deeper_than_its_geometric_fit_says():
    from specserve.policies.depth import best_depth, best_depth_by_position

    reached, accepted, emitted = simulate(STREAKY, 4, 5_000, seed=4)
    rounds, took = len(emitted), sum(emitted) - len(emitted)
    alpha = accept_rate_from_rounds(rounds, 4 * rounds, took)
    cost_ratio, overhead_ratio = 0.12, 0.5
    geometric = best_depth(alpha, cost_ratio, 1, 8, overhead_ratio)
    by_position = best_depth_by_position(position_accept_rates(reached, accepted, 8, alpha), cost_ratio, 1, 8,
                                         overhead_ratio)
    assert geometric < by_position == 8
