"""BlockManager alone, with no model: what each planned step's tables, copies and starts are, and
that every block comes back. (The same plans run through a model: tests/test_prefix_cache.py,
tests/test_sliding_window_kv.py, tests/test_speculation_cache.py.)"""

import random

import pytest

from specserve.decoding.block_manager import BlockAllocator, BlockManager, ForwardCall
from specserve.decoding.errors import NoFreeBlocksError, NoFreeSlotError, SequenceStateError
from specserve.decoding.paged_cache import NO_BLOCK, KVGroup

BLOCK = 4


def manager(num_blocks: int = 64, groups=(KVGroup((0, 1), None),), max_sequences: int = 8,
            rollback_tokens: int = 0, prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BLOCK, groups, max_sequences, max_context=256, rollback_tokens=rollback_tokens,
                        prefix_caching=prefix_caching, cache_salt="test")


def step(blocks: BlockManager, *calls: ForwardCall):
    """Plan and commit, as a forward that succeeded."""
    plan = blocks.plan(calls)
    blocks.commit(plan)
    return plan


def test_the_allocator_grows_by_half_again_up_to_its_budget_and_hands_out_lowest_blocks_first():
    allocator = BlockAllocator(num_blocks=200)
    assert (allocator.capacity, allocator.num_free) == (0, 200)
    assert allocator.allocate(3) == [0, 1, 2] and allocator.capacity == 64
    allocator.allocate(70)
    assert allocator.capacity == 96
    allocator.free([1, 0])
    assert allocator.allocate(2) == [0, 1]
    allocator.allocate(127)
    assert allocator.capacity == 200 and allocator.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        allocator.allocate(1)


def test_a_new_sequence_gets_fresh_blocks_covering_its_history_and_runs_all_of_it():
    blocks = manager()
    plan = step(blocks, ForwardCall("a", list(range(10)), 1))
    assert plan.starts == (0,) and plan.input_ids == (tuple(range(10)),) and plan.num_rows == (1,)
    assert plan.group_tables == (((0, 1, 2),),) and plan.copies == ()
    assert plan.pool_blocks >= 3 and plan.num_new_tokens == 10
    assert blocks.num_cached("a") == 10 and blocks.blocks_held("a") == 3


def test_a_held_sequence_runs_only_what_it_does_not_hold_and_a_rollback_crops_its_blocks():
    blocks = manager()
    step(blocks, ForwardCall("a", list(range(10)), 1))
    plan = step(blocks, ForwardCall("a", list(range(13)), 2))
    assert plan.starts == (10,) and plan.input_ids == ((10, 11, 12),)
    plan = step(blocks, ForwardCall("a", list(range(13)), 2))   # rows asked for are recomputed
    assert plan.starts == (11,) and plan.input_ids == ((11, 12),)
    plan = step(blocks, ForwardCall("a", list(range(5)) + [99], 1))   # a rejected tail: back to 5 tokens
    assert plan.starts == (5,) and plan.input_ids == ((99,),) and blocks.blocks_held("a") == 2


def test_a_second_sequence_with_the_same_prefix_shares_its_full_blocks():
    blocks = manager()
    first = step(blocks, ForwardCall("a", list(range(10)), 1))
    second = step(blocks, ForwardCall("b", list(range(9)) + [50, 51], 1))
    # Two full blocks (8 tokens) are found; b computes from there.
    assert second.starts == (8,) and second.group_tables[0][0][:2] == first.group_tables[0][0][:2]
    assert blocks.prefix_cache_hits == 8 and blocks.prefix_cached_tokens("b") == 8
    assert blocks.cached_prefix_length("c", list(range(12))) == 8


def test_without_prefix_caching_nothing_is_shared():
    blocks = manager(prefix_caching=False)
    step(blocks, ForwardCall("a", list(range(10)), 1))
    assert step(blocks, ForwardCall("b", list(range(10)), 1)).starts == (0,)
    assert blocks.prefix_cache_hits == 0


def test_a_released_sequences_full_blocks_stay_findable_until_their_room_is_needed():
    blocks = manager(num_blocks=4)
    step(blocks, ForwardCall("a", list(range(12)), 1))
    blocks.release("a")
    assert blocks.allocator.num_cached == 3 and blocks.num_free_blocks == 4
    assert step(blocks, ForwardCall("b", list(range(12)) + [7], 1)).starts == (12,)
    blocks.release("b")
    step(blocks, ForwardCall("c", [9] * 16, 1))   # needs every block: the cached ones are evicted
    assert blocks.allocator.num_cached == 0 and blocks.cached_prefix_length("d", list(range(13))) == 0


def test_a_fork_shares_every_block_and_its_first_write_into_a_shared_block_is_a_copy():
    blocks = manager()
    parent = step(blocks, ForwardCall("a", list(range(10)), 1))
    blocks.fork("a", "a#1")
    assert blocks.allocator.refs(parent.group_tables[0][0][2]) == 2
    plan = step(blocks, ForwardCall("a#1", list(range(10)) + [77], 1))
    source = parent.group_tables[0][0][2]
    (copy_source, copy), = plan.copies
    assert copy_source == source and plan.group_tables[0][0] == (*parent.group_tables[0][0][:2], copy)
    # The parent's block is untouched and still its own; the branch writes into the copy.
    assert blocks.allocator.refs(source) == 1 and blocks.allocator.refs(copy) == 1
    plan = step(blocks, ForwardCall("a", list(range(11)), 1))
    assert plan.copies == () and plan.group_tables[0][0] == parent.group_tables[0][0]


def test_adopt_hands_the_branchs_blocks_to_the_sequence_and_frees_its_own():
    blocks = manager()
    step(blocks, ForwardCall("a", list(range(10)), 1))
    blocks.fork("a", "a#1")
    step(blocks, ForwardCall("a#1", list(range(10)) + [5, 6, 7], 1))
    blocks.adopt("a", "a#1")
    assert blocks.active_sequences() == ["a"] and blocks.num_cached("a") == 13
    blocks.release("a")
    assert blocks.allocator.num_used == 0


def test_a_windowed_group_lets_go_of_blocks_outside_its_window_and_a_deep_rollback_recomputes():
    groups = (KVGroup((0,), None), KVGroup((1,), 4))
    blocks = manager(groups=groups, rollback_tokens=2)
    step(blocks, ForwardCall("a", list(range(20)), 1))
    # Keys a query 2 tokens behind the end sees: positions 15 on; blocks 0-2 (tokens 0-11) go.
    full, windowed = blocks._sequences["a"].tables
    assert len(full) == 5 and windowed[:3] == [NO_BLOCK] * 3 and NO_BLOCK not in windowed[3:]
    assert blocks.blocks_held("a", group=0) == 5 and blocks.blocks_held("a", group=1) == 2
    assert step(blocks, ForwardCall("a", list(range(18)) + [3], 1)).starts == (18,)   # within rollback_tokens
    # Deeper: the window's keys of tokens 4-7 are gone from its table, so it holds nothing it can
    # start from; its first two blocks come back from the prefix cache (both groups published them).
    hits = blocks.prefix_cache_hits
    assert step(blocks, ForwardCall("a", list(range(8)) + [3], 1)).starts == (8,)
    assert blocks.prefix_cache_hits == hits + 8


def test_a_batch_past_the_budget_is_refused_whole_and_changes_nothing():
    blocks = manager(num_blocks=4)
    step(blocks, ForwardCall("a", list(range(8)), 1))
    with pytest.raises(NoFreeBlocksError):
        blocks.plan([ForwardCall("a", list(range(12)), 1), ForwardCall("b", [5] * 9, 1)])
    assert blocks.active_sequences() == ["a"] and blocks.allocator.num_used == 2


def test_bad_calls_and_too_many_sequences_are_refused_before_anything_changes():
    blocks = manager(max_sequences=1)
    with pytest.raises(ValueError, match="once"):
        blocks.plan([ForwardCall("a", [1, 2], 1), ForwardCall("a", [1, 2], 1)])
    with pytest.raises(SequenceStateError, match="num_rows"):
        blocks.plan([ForwardCall("a", [1, 2], 3)])
    with pytest.raises(SequenceStateError, match="context"):
        blocks.plan([ForwardCall("a", [1] * 257, 1)])
    with pytest.raises(NoFreeSlotError):
        blocks.plan([ForwardCall("a", [1], 1), ForwardCall("b", [2], 1)])
    assert blocks.active_sequences() == [] and blocks.allocator.num_used == 0


def test_an_aborted_plan_gives_back_what_it_took_and_keeps_what_was_held():
    blocks = manager()
    step(blocks, ForwardCall("a", list(range(6)), 1))
    plan = blocks.plan([ForwardCall("a", list(range(12)), 1), ForwardCall("b", list(range(30, 40)), 1)])
    blocks.abort(plan)
    assert blocks.active_sequences() == ["a"] and blocks.num_cached("a") == 6 and blocks.blocks_held("a") == 2


def test_an_aborted_copy_on_write_crops_to_the_last_full_block():
    blocks = manager()
    step(blocks, ForwardCall("a", list(range(10)), 1))
    blocks.fork("a", "a#1")
    plan = blocks.plan([ForwardCall("a#1", list(range(10)) + [77], 1)])
    assert plan.copies
    blocks.abort(plan)   # the runner may not have made the copy: the block it would fill is not kept
    assert blocks.num_cached("a#1") == 8 and blocks.blocks_held("a#1") == 2


def test_load_weights_reset_forgets_every_sequence_and_no_old_block_is_found():
    blocks = manager()
    step(blocks, ForwardCall("a", list(range(12)), 1))
    blocks.reset("new weights")
    assert blocks.active_sequences() == [] and blocks.cached_prefix_length("b", list(range(13))) == 0


def test_random_rounds_with_forks_rollbacks_and_windows_leak_no_block():
    rng = random.Random(0)
    blocks = manager(num_blocks=400, groups=(KVGroup((0,), None), KVGroup((1,), 6)), max_sequences=16,
                     rollback_tokens=4)
    histories: dict[str, list[int]] = {}
    for _ in range(300):
        seq_id = rng.choice("abcdef")
        history = histories.get(seq_id, [rng.randrange(4) for _ in range(rng.randrange(1, 20))])
        history = history[:max(1, len(history) - rng.randrange(5))] + [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        histories[seq_id] = history[:200]
        step(blocks, ForwardCall(seq_id, histories[seq_id], rng.randint(1, min(3, len(histories[seq_id])))))
        if rng.random() < 0.2:
            branch = f"{seq_id}#b"
            blocks.fork(seq_id, branch)
            step(blocks, ForwardCall(branch, histories[seq_id] + [1, 2], 1))
            blocks.adopt(seq_id, branch) if rng.random() < 0.5 else blocks.release(branch)
            histories.pop(seq_id)
            blocks.release(seq_id)
        if rng.random() < 0.1:
            blocks.release(rng.choice("abcdef"))
    for seq_id in blocks.active_sequences():
        blocks.release(seq_id)
    assert blocks.allocator.num_used == 0 and blocks.num_free_blocks == 400
