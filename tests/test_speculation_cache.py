"""decoding.speculation_cache: the blocks pre-drafted for picked outcomes, and when a block continues
the history a round ends with (the pure half of speculative speculative decoding)."""

from __future__ import annotations

import numpy as np
import pytest

from specserve.decoding.compact_verify import DraftSupport
from specserve.decoding.proposers import Proposal
from specserve.decoding.speculation_cache import Predraft, block_of, continues, may_continue, predrafts, tokens_thrown_away

HISTORY = (5, 6, 7)
BLOCK = [10, 11, 12]


def test_predrafts_continue_each_picked_outcome_never_with_the_rejected_token():
    picks = [(0, 20), (0, 21), (1, 30), (3, 0), (3, 2), (0, 10)]
    wanted = predrafts(HISTORY, BLOCK, picks)
    assert wanted == [Predraft(HISTORY + (20,)), Predraft(HISTORY + (21,)),      # d1 rejected
                      Predraft(HISTORY + (10, 30)),                               # d1 kept, d2 rejected
                      Predraft(HISTORY + (10, 11, 12), guess_rank=0),             # all kept: bonus guesses
                      Predraft(HISTORY + (10, 11, 12), guess_rank=2)]             # (0, 10): the drafted token, none
    assert predrafts(HISTORY, BLOCK, []) == []
    assert predrafts(HISTORY, [], [(0, 20)]) == []


def test_a_block_continues_exactly_its_history_and_a_bonus_block_only_when_its_guess_came_true():
    rejected_first = Predraft(HISTORY + (20,))
    assert continues(rejected_first, None, HISTORY + (20,))
    assert not continues(rejected_first, None, HISTORY + (21,))
    assert not continues(rejected_first, None, HISTORY + (20, 1))
    assert not continues(rejected_first, None, (1,) + HISTORY[1:] + (20,))
    bonus = Predraft(HISTORY + tuple(BLOCK), guess_rank=0)
    drafted = Proposal([13, 14, 15], None)   # 13 is the guess of the bonus token
    assert may_continue(bonus, HISTORY + tuple(BLOCK) + (99,))
    assert continues(bonus, drafted, HISTORY + tuple(BLOCK) + (13,))
    assert not continues(bonus, drafted, HISTORY + tuple(BLOCK) + (99,))
    assert not continues(bonus, Proposal([13], None), HISTORY + tuple(BLOCK) + (13,))   # a guess, no block
    assert not may_continue(bonus, HISTORY + tuple(BLOCK))


def test_a_hit_is_cut_to_the_rounds_depth_and_its_q_rows_follow_its_tokens():
    ids = np.arange(4 * 3).reshape(4, 3)
    probs = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    drafted = Proposal([13, 14, 15, 16], DraftSupport(ids, probs), draft_version=2,
                       candidates=[[13, 1], [14, 2], [15, 3], [16, 4]])
    bonus = Predraft(HISTORY + tuple(BLOCK), guess_rank=0)
    used = block_of(bonus, drafted, 2)
    assert used.token_ids == [14, 15] and used.draft_version == 2 and used.candidates == [[14, 2], [15, 3]]
    np.testing.assert_array_equal(used.support.ids, ids[1:3])
    np.testing.assert_array_equal(used.support.probs, probs[1:3])
    plain = block_of(Predraft(HISTORY + (20,)), drafted, 9)
    assert plain.token_ids == [13, 14, 15, 16]
    np.testing.assert_array_equal(plain.support.probs, probs)
    assert tokens_thrown_away(bonus, drafted, used) == 1            # 16: the guess came true, 14 15 used
    assert tokens_thrown_away(Predraft(HISTORY + (20,)), drafted, plain) == 0
    assert tokens_thrown_away(bonus, drafted, None) == 4
    assert tokens_thrown_away(bonus, None, None) == 0                # never drafted: nothing lost
