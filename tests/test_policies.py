"""Depth policy: pure functions of a request's acceptance history."""

import pytest

from policies.depth import choose_draft_depth, expected_speedup, expected_tokens_per_round


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
