"""decoding.speculation.drafted_ahead: when a block drafted during verification may be used."""

from __future__ import annotations

import numpy as np

from decoding.proposers import Proposal
from decoding.speculation import drafted_ahead

AHEAD_OF = [5, 6, 7, 10, 11]          # history 5 6 7 + proposal 10 11
AHEAD = Proposal([12, 13, 14, 15], None)  # 12 guesses the bonus token


def test_usable_when_everything_was_accepted_and_the_bonus_guessed():
    assert drafted_ahead(AHEAD_OF + [12], AHEAD_OF, AHEAD, 4) == Proposal([13, 14, 15], None)
    assert drafted_ahead(AHEAD_OF + [12], AHEAD_OF, AHEAD, 2) == Proposal([13, 14], None)


def test_probability_rows_follow_their_tokens():
    probs = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    proposal = drafted_ahead(AHEAD_OF + [12], AHEAD_OF, Proposal([12, 13, 14, 15], probs), 2)
    assert proposal.token_ids == [13, 14]
    np.testing.assert_array_equal(proposal.probs, probs[1:3])


def test_unusable_after_a_rejection_a_wrong_guess_or_another_history():
    assert drafted_ahead([5, 6, 7, 10, 9], AHEAD_OF, AHEAD, 4) is None     # 11 rejected, 9 instead
    assert drafted_ahead(AHEAD_OF + [99], AHEAD_OF, AHEAD, 4) is None      # bonus is not the guess
    assert drafted_ahead([1, 6, 7, 10, 11, 12], AHEAD_OF, AHEAD, 4) is None
    assert drafted_ahead(AHEAD_OF + [12], AHEAD_OF, Proposal([12], None), 4) is None  # guess only
    assert drafted_ahead(AHEAD_OF + [12], AHEAD_OF, AHEAD, 0) is None
