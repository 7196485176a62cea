"""policies.fan_out: which verification outcomes a round's pre-drafted blocks go to, from the
draft's own numbers as the rounds the draft engine sees calibrate them."""

from __future__ import annotations

import random

import pytest

from specserve.decoding.draft_odds import DraftOdds
from specserve.policies.fan_out import (ACCEPT_BINS, OutcomeCalibration, accept_odds, may_predraft,
                                        recovered_order, share_fan_out)

BLOCK = [10, 11, 12]
CANDIDATES = [[10, 20, 21, 22], [30, 11, 31, 32], [12, 40, 41, 42]]


def greedy_odds(drafted_q: float, candidate_q=(0.5, 0.2, 0.1, 0.05)) -> DraftOdds:
    return DraftOdds(tuple(candidate_q), None, drafted_q, None)


def test_accept_odds_read_the_drafts_row_as_the_targets():
    assert accept_odds(greedy_odds(0.7)) == 0.7
    # sampled: min(1, q(d) / q_drawn(d)); a token drawn more often than the row says is kept less
    assert accept_odds(DraftOdds((0.5,), (0.3,), 0.1, 0.2)) == pytest.approx(0.5)
    assert accept_odds(DraftOdds((0.5,), (0.3,), 0.4, 0.2)) == 1.0


def test_recovered_order_ranks_by_the_residual_a_lowered_q_leaves_and_never_the_drafted_token():
    # Lowered by Saguaro sampling: 21 lost most of its mass, so the residual is on it first.
    lowered = DraftOdds((0.4, 0.3, 0.2, 0.1), (0.35, 0.1, 0.05, 0.5), 0.4, 0.35, residual_mass=0.4)
    assert recovered_order(lowered, [10, 20, 21, 22], 10) == [20, 21, 22]
    assert recovered_order(lowered, [20, 21, 10, 22], 10) == [21, 20, 22]
    assert recovered_order(greedy_odds(0.5), [10, 20, 21, 22], 10) == [20, 21, 22]   # greedy: the row's order


def test_a_confident_block_puts_its_fan_out_on_the_bonus_and_a_shaky_one_on_its_first_position():
    calibration = OutcomeCalibration()
    sure = share_fan_out(BLOCK, CANDIDATES, [greedy_odds(0.95)] * 3, 2, calibration)
    assert sure == [(3, 0), (3, 1)]
    shaky = share_fan_out(BLOCK, CANDIDATES, [greedy_odds(0.05)] * 3, 2, calibration)
    assert shaky == [(0, 20), (0, 21)]
    assert share_fan_out(BLOCK, CANDIDATES, [greedy_odds(0.5)] * 3, 0, calibration) == []
    picks = share_fan_out(BLOCK, CANDIDATES, [greedy_odds(0.6)] * 3, 16, calibration)
    assert len(picks) == len(set(picks)) and all(token != BLOCK[a] for a, token in picks if a < 3)
    with pytest.raises(ValueError, match="candidates and odds"):
        share_fan_out(BLOCK, CANDIDATES[:2], [greedy_odds(0.5)] * 3, 2)


def test_calibration_learns_what_the_drafts_numbers_mean():
    """A draft whose argmax probability reads 0.1 but is kept 80% of the time, and whose rejected
    tokens are replaced by its third alternative: the calibration learns both, and the fan-out
    moves from the first position's alternatives to the bonus and the first position's third alternative."""
    rng = random.Random(0)
    calibration = OutcomeCalibration()
    odds = [greedy_odds(0.1)] * 3
    before = share_fan_out(BLOCK, CANDIDATES, odds, 2, calibration)
    for _ in range(400):
        kept = 0
        while kept < 3 and rng.random() < 0.8:
            kept += 1
        emitted = BLOCK[:kept] + ([CANDIDATES[kept][3]] if kept < 3 else [77])
        calibration.observe(BLOCK, CANDIDATES, odds, emitted, [77, 78])
    assert calibration.accept(0.1) == pytest.approx(0.8, abs=0.05)
    assert calibration.recovered_chance(2) > 0.9 and calibration.bonus_chance(0) > 0.9
    after = share_fan_out(BLOCK, CANDIDATES, odds, 2, calibration)
    assert before == [(0, 20), (0, 21)]
    assert after == [(3, 0), (0, 22)]


def test_a_round_that_ended_the_request_teaches_nothing_about_the_position_it_stopped_at():
    calibration = OutcomeCalibration()
    seen = list(calibration.seen)
    calibration.observe(BLOCK, CANDIDATES, [greedy_odds(0.95)] * 3, [10], [])
    index = ACCEPT_BINS - 1
    assert calibration.seen[index] == seen[index] + 1   # d1 kept; d2 never verified


def test_a_head_pre_drafts_for_every_request_but_a_seeded_sampled_one_and_n_grams_never():
    """A head's hit block is not the block drafting just in time would draw (it reads the head's
    own features): a seeded sampled request must not depend on which a round used."""
    assert may_predraft("draft", seeded_sampled=True) and may_predraft("draft", seeded_sampled=False)
    assert may_predraft("eagle3", seeded_sampled=False) and not may_predraft("eagle3", seeded_sampled=True)
    assert not may_predraft("ngram", seeded_sampled=False) and not may_predraft("none", seeded_sampled=False)
