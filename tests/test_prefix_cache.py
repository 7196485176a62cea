"""Prefix caching in the engine (decoding.block_manager, run on BatchedModelRunner): full
blocks stay findable by their chained hash after their sequence lets go of them, a new or diverging
sequence starts from its longest cached block-aligned prefix, blocks other sequences hold are never
written (copy-on-write), cached blocks are evicted LRU only when the pool needs the room, and every
reference is given back. Rows with the cache on must equal rows with it off and the cache-free
reference engine's (tiny random models, fp32, CPU)."""

import random

import pytest
import torch

from specserve.decoding.block_manager import BlockAllocator, ForwardCall, block_key, salt_hash
from specserve.decoding.errors import NoFreeBlocksError
from specserve.decoding.scheduler import Scheduler
from tests.reference_runner import ReferenceRunner
from tests.test_batched_runner import ATOL, assert_rows_match, random_ids
from tests.test_paged_cache import paged_engine
from tests.tiny_pair import tiny_model

BLOCK = 4


def engines(architecture: str = "llama", budget_blocks: int | None = None, **model_options
            ) -> tuple[Scheduler, Scheduler, ReferenceRunner]:
    """(cache on, cache off, cache-free reference) over one tiny model, blocks of 4 tokens; the
    cache on gets budget_blocks (the others need more: they share nothing)."""
    model = tiny_model(architecture, **model_options)
    return (paged_engine(model, block_size=BLOCK, budget_blocks=budget_blocks),
            paged_engine(model, block_size=BLOCK, prefix_caching=False),
            ReferenceRunner.from_model(model))


def assert_same_rows(engines_: tuple, calls: list[ForwardCall]) -> list[torch.Tensor]:
    """Every engine gives the same rows for calls; -> the cached engine's rows."""
    cached, uncached, reference = engines_
    rows = cached.forward_batch(calls)
    for call, got, off in zip(calls, rows, uncached.forward_batch(calls)):
        expected = reference.forward(call.seq_id, call.token_ids, call.num_rows)
        torch.testing.assert_close(got, off, atol=ATOL, rtol=0, msg=lambda m: f"{call.seq_id} on vs off: {m}")
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=lambda m: f"{call.seq_id}: {m}")
    return rows


def assert_no_leak(engine: Scheduler) -> None:
    """Nothing referenced once every sequence is released; every cached block is findable by the
    key it holds and by nothing else."""
    cache = engine.blocks.allocator
    assert engine.blocks.active_sequences() == []
    assert cache._refs == {} and cache.num_used == 0 and cache.num_free == cache.num_blocks
    assert set(cache._cached) == set(cache._key_of)
    assert {block: key for key, block in cache._block_of.items()} == cache._key_of


def greedy_lockstep(engines_: tuple, histories: dict[str, list[int]], steps: int) -> None:
    """Decode every history greedily in one batch per step, on all engines alike."""
    for _ in range(steps):
        rows = assert_same_rows(engines_, [ForwardCall(seq_id, h) for seq_id, h in histories.items()])
        for history, row in zip(histories.values(), rows):
            history.append(int(row[0].argmax()))


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_choices_of_one_prompt_share_its_full_blocks_and_give_the_uncached_rows(architecture):
    """n > 1: the second choice finds the first one's prompt blocks (the block holding the last
    prompt token is recomputed: its row is asked for), and both decode as they would alone."""
    trio = engines(architecture)
    cached = trio[0]
    prompt = random_ids(1, 19)                                   # 4 full blocks + 3 tokens
    assert_same_rows(trio, [ForwardCall("n0", prompt)])
    assert_same_rows(trio, [ForwardCall("n1", prompt)])
    assert cached.blocks.prefix_cached_tokens("n0") == 0 and cached.blocks.prefix_cached_tokens("n1") == 16
    assert cached.blocks._sequences["n1"].tables[0][:4] == cached.blocks._sequences["n0"].tables[0][:4]
    assert all(cached.blocks.allocator.refs(block) == 2 for block in cached.blocks._sequences["n0"].tables[0][:4])
    greedy_lockstep(trio, {"n0": list(prompt), "n1": list(prompt), "n2": list(prompt)}, steps=6)
    # vLLM's counters: each admission looked up all but the row it asked for; decode steps none.
    assert cached.blocks.prefix_cache_hits == 16 + 16 and cached.blocks.prefix_cache_queries == 18 * 3
    for seq_id in ("n0", "n1", "n2"):
        cached.release(seq_id)
    assert_no_leak(cached)


def test_a_chats_next_turn_prefills_only_what_the_last_turn_did_not_hold():
    trio = engines()
    cached = trio[0]
    turn1 = random_ids(2, 13)
    history = {"turn1": list(turn1)}
    greedy_lockstep(trio, history, steps=8)
    for engine in trio:
        engine.release("turn1")
    assert cached.blocks.allocator.num_cached == 5                          # 21 tokens held: 5 full blocks stay cached
    turn2 = history["turn1"] + random_ids(3, 7)                  # the answer is in, then the next question
    assert cached.blocks.cached_prefix_length("turn2", turn2) == 20
    assert_same_rows(trio, [ForwardCall("turn2", turn2, 2)])
    assert cached.blocks.prefix_cached_tokens("turn2") == 20 and cached.blocks.allocator.num_cached == 0
    assert cached.last_num_new_tokens == len(turn2) - 20      # what the engine's cost sample counts
    cached.release("turn2")
    assert_no_leak(cached)


def test_a_prefill_chunk_takes_the_blocks_another_sequence_finished_meanwhile():
    """Two requests with one prompt arrive together: the engine chunks both prefills. The second's
    next chunk finds the blocks the first one's chunk filled, and its cached_tokens count them."""
    trio = engines()
    cached = trio[0]
    prompt = random_ids(16, 30)
    assert_same_rows(trio, [ForwardCall("first", prompt[:20]), ForwardCall("second", prompt[:6])])
    assert_same_rows(trio, [ForwardCall("first", prompt), ForwardCall("second", prompt[:22])])
    assert cached.blocks.prefix_cached_tokens("second") == 16 and cached.blocks.prefix_cached_tokens("first") == 0
    assert cached.blocks._sequences["second"].tables[0][1:5] == cached.blocks._sequences["first"].tables[0][1:5]
    assert cached.blocks._sequences["second"].tables[0][0] != cached.blocks._sequences["first"].tables[0][0]
    for seq_id in ("first", "second"):
        cached.release(seq_id)
    assert_no_leak(cached)


def test_a_call_always_recomputes_the_rows_it_asks_for_even_when_all_its_blocks_are_cached():
    trio = engines()
    prompt = random_ids(4, 16)                                   # exactly 4 blocks
    assert_same_rows(trio, [ForwardCall("a", prompt)])
    trio[0].release("a")
    assert_same_rows(trio, [ForwardCall("b", prompt)])           # last block recomputed for its last row
    assert trio[0].blocks.prefix_cached_tokens("b") == 12
    assert_same_rows(trio, [ForwardCall("c", prompt, num_rows=16)])  # prompt log-probabilities: nothing reused
    assert trio[0].blocks.prefix_cached_tokens("c") == 0


def test_a_diverging_history_takes_cached_blocks_past_what_it_held():
    """A sequence whose history changes (a router's re-sent history) drops its tail and picks up
    the blocks another sequence computed for the new tokens."""
    trio = engines()
    cached = trio[0]
    common, left, right = random_ids(5, 6), random_ids(6, 9), random_ids(7, 9)
    assert_same_rows(trio, [ForwardCall("x", common + left), ForwardCall("y", common + right)])
    assert_same_rows(trio, [ForwardCall("x", common + right + [5], 2)])
    # x kept its own first block (both computed it in one batch: y's copy stayed private) and
    # took y's next two.
    assert cached.blocks._sequences["x"].tables[0][1:3] == cached.blocks._sequences["y"].tables[0][1:3]
    assert cached.blocks._sequences["x"].tables[0][0] != cached.blocks._sequences["y"].tables[0][0]
    for seq_id in ("x", "y"):
        cached.release(seq_id)
    assert_no_leak(cached)


@pytest.mark.parametrize("broken", [False, True])
def test_rolling_back_into_a_shared_block_copies_it_and_never_writes_the_shared_one(monkeypatch, broken):
    """Two identical sequences share every full block, speculative tail included; one rolls
    back into the middle of a shared block and writes other tokens there: it gets its own copy,
    and the other sequence's rows are untouched. The broken variant writes in place and is caught."""
    trio = engines()
    cached = trio[0]
    if broken:
        monkeypatch.setattr(cached.blocks, "_make_last_block_writable",
                            lambda entry: cached.blocks.allocator.unpublish(entry.tables[0][-1]) or [])
    history = random_ids(8, 14)
    block = random_ids(9, 6)                                     # a verify of K=5: fills blocks 3 and 4
    assert_same_rows(trio, [ForwardCall("a", history)])
    assert_same_rows(trio, [ForwardCall("a", history + block, 6)])
    assert_same_rows(trio, [ForwardCall("b", history + block)])     # finds blocks 0-3
    shared = cached.blocks._sequences["a"].tables[0][3]
    assert cached.blocks._sequences["b"].tables[0][3] == shared and cached.blocks.allocator.refs(shared) == 2
    # a accepted 1 of the 5 (position 15 is mid-block 3) and verifies a new block.
    rolled = history + block[:1] + [2, 3, 4, 5]
    if broken:
        assert_same_rows(trio, [ForwardCall("a", rolled, 5)])    # a's own rows are right ...
        with pytest.raises(AssertionError, match="b on vs off"):  # ... but it wrote b's block
            assert_same_rows(trio, [ForwardCall("b", history + block + [6], 2)])
        return
    assert_same_rows(trio, [ForwardCall("a", rolled, 5)])
    assert cached.blocks._sequences["a"].tables[0][3] != shared and cached.blocks.allocator.refs(shared) == 1
    assert_same_rows(trio, [ForwardCall("b", history + block + [6], 2)])
    # A rollback to a block boundary writes only new blocks: the shared ones before it stay shared.
    assert_same_rows(trio, [ForwardCall("b", history[:12] + [7, 8], 2)])
    assert cached.blocks._sequences["b"].tables[0][:3] == cached.blocks._sequences["a"].tables[0][:3]
    for seq_id in ("a", "b"):
        cached.release(seq_id)
    assert_no_leak(cached)


def test_eviction_under_pressure_takes_only_unreferenced_blocks_least_recently_freed_first():
    """A pool of 16 blocks: two running sequences share a prompt, finished ones leave cached
    blocks; filling the pool evicts the oldest cached blocks, never a referenced one, and the
    running sequences' rows stay exact throughout."""
    trio = engines(budget_blocks=16, max_position_embeddings=64)
    cached = trio[0]
    prompt = random_ids(10, 17)
    assert_same_rows(trio, [ForwardCall("s1", prompt)])
    assert_same_rows(trio, [ForwardCall("s2", prompt)])       # shares s1's 4 full blocks
    histories = {"s1": list(prompt), "s2": list(prompt)}
    greedy_lockstep(trio, histories, steps=2)                  # 18 tokens held each: 4 shared + 1 own
    old, recent = random_ids(11, 9), random_ids(12, 9)
    for seq_id, ids in (("old", old), ("recent", recent)):
        assert_same_rows(trio, [ForwardCall(seq_id, ids)])
        if seq_id == "old":
            old_blocks = cached.blocks._sequences["old"].tables[0][:2]
        for engine in trio:
            engine.release(seq_id)
    assert (cached.blocks.allocator.num_used, cached.blocks.allocator.num_cached, cached.blocks.allocator.num_free) == (6, 4, 10)
    referenced = set(cached.blocks._sequences["s1"].tables[0] + cached.blocks._sequences["s2"].tables[0])
    # 32 new tokens need 8 blocks: the 6 never-keyed ones, then the 2 least recently freed cached
    # ones (the older sequence's).
    assert_same_rows(trio, [ForwardCall("big", random_ids(13, 32))])
    assert not referenced & set(cached.blocks._sequences["big"].tables[0])
    assert set(old_blocks) <= set(cached.blocks._sequences["big"].tables[0])
    assert cached.blocks.cached_prefix_length("again", old) == 0
    assert cached.blocks.cached_prefix_length("again", recent) == 8   # the recent one is still cached
    with pytest.raises(NoFreeBlocksError):                     # 2 free, 3 needed: refused whole
        cached.forward_batch([ForwardCall("s1", histories["s1"] + [1] * 13, 14)])
    greedy_lockstep(trio, histories, steps=3)                  # grows both: evicts the recent blocks too
    assert cached.blocks.allocator.num_free == 0 and cached.blocks.allocator.num_cached == 0
    for seq_id in ("s1", "s2", "big"):
        cached.release(seq_id)
    assert_no_leak(cached)


def test_many_requests_sharing_prefixes_with_rollbacks_and_evictions_stay_exact_and_leak_nothing():
    """A random workload over a small pool: requests share a few system prompts, verify blocks,
    keep part of each, finish; rows match the reference engine; references are never negative
    nor left behind."""
    rng = random.Random(0)
    cached, _, reference = engines(budget_blocks=40, max_position_embeddings=96)
    systems = [random_ids(20 + i, rng.randint(5, 14)) for i in range(3)]
    live: dict[str, list[int]] = {}
    for step in range(40):
        if len(live) < 4:
            live[f"r{step}"] = rng.choice(systems) + random_ids(step, rng.randint(1, 6))
        calls = []
        for seq_id, history in live.items():
            block = random_ids(1000 + step, rng.randint(0, 4))
            calls.append(ForwardCall(seq_id, history + block, len(block) + 1))
        assert_rows_match(cached, reference, calls)
        for call in calls:
            live[call.seq_id] = list(call.token_ids[:len(live[call.seq_id]) + rng.randint(1, call.num_rows)])
            if len(live[call.seq_id]) > 40 or rng.random() < 0.15:
                cached.release(call.seq_id)
                reference.release(call.seq_id)
                del live[call.seq_id]
        assert cached.blocks.allocator.num_used == len({b for s in live for b in cached.blocks._sequences[s].tables[0]})
        assert all(refs > 0 for refs in cached.blocks.allocator._refs.values())
    assert cached.blocks.prefix_cache_hits > 0
    for seq_id in list(live):
        cached.release(seq_id)
    assert_no_leak(cached)


def test_the_cache_salt_keeps_blocks_of_other_weights_from_being_found():
    """A draft's hot-swapped version salts its chains differently: the same tokens find nothing."""
    cached = engines()[0]
    prompt = random_ids(14, 12)
    cached.forward("a", prompt)
    cached.release("a")
    assert cached.blocks.cached_prefix_length("b", prompt) == 8
    cached.blocks._salt = salt_hash("tiny@version-2")
    assert cached.blocks.cached_prefix_length("b", prompt) == 0


def test_a_requests_cache_salt_finds_only_blocks_of_the_same_salt():
    """vLLM's per-request cache_salt: tenants with other salts (or none) never find each other's
    blocks, the same salt does; the salt stays through a preemption's release, goes with a forget,
    and a fork (a pre-draft branch) keys its blocks under its parent's."""
    cached, _, reference = engines()
    blocks, prompt = cached.blocks, random_ids(16, 12)
    blocks.salt_sequence("a", "tenant-a")
    rows = cached.forward("a", prompt)
    blocks.release("a")                        # as a preemption lets it go: its salt stays
    assert blocks.cached_prefix_length("a", prompt) == 8
    for other, salt in (("b", "tenant-b"), ("plain", None)):
        blocks.salt_sequence(other, salt)
        assert blocks.cached_prefix_length(other, prompt) == 0
        cached.forward(other, prompt)
        assert blocks.prefix_cached_tokens(other) == 0
    blocks.salt_sequence("a2", "tenant-a")
    again = cached.forward("a2", prompt)
    assert blocks.prefix_cached_tokens("a2") == 8
    torch.testing.assert_close(again, rows, atol=ATOL, rtol=0)
    torch.testing.assert_close(again, reference.forward("a2", prompt), atol=ATOL, rtol=0)
    blocks.fork("a2", "branch")
    cached.forward("branch", prompt + random_ids(17, 6))       # fills blocks under tenant-a's chain
    cached.release("branch")
    blocks.salt_sequence("a3", "tenant-a")
    assert blocks.cached_prefix_length("a3", prompt + random_ids(17, 6)) == 16
    assert blocks.cached_prefix_length("plain2", prompt + random_ids(17, 6)) == 12   # the unsalted run's
    cached.release("a2")                       # the engine forgets the request: its salt goes too
    assert blocks.cached_prefix_length("a2", prompt) == 8 and "a2" not in blocks._tenant_salts
    for seq_id in ("a", "b", "plain", "a3"):
        cached.release(seq_id)
    assert_no_leak(cached)


def test_with_prefix_caching_off_released_blocks_are_simply_free():
    _, uncached, _ = engines()
    prompt = random_ids(15, 12)
    uncached.forward("a", prompt)
    uncached.release("a")
    assert uncached.blocks.allocator.num_cached == 0 and uncached.blocks.cached_prefix_length("b", prompt) == 0
    uncached.forward("b", prompt)
    assert uncached.blocks.prefix_cached_tokens("b") == 0 and uncached.kv_usage()["prefix_cache_hits"] == 0


def test_the_allocator_evicts_cached_blocks_only_at_its_budget():
    cache = BlockAllocator(num_blocks=70)
    first = cache.allocate(3)
    for index, block in enumerate(first):
        cache.publish(block, block_key(0, [index]))
    cache.free(first[::-1])
    assert (cache.num_cached, cache.num_free) == (3, 70)
    assert cache.allocate(61) == list(range(3, 64))              # never-keyed blocks first
    assert cache.allocate(4) == [64, 65, 66, 67]                 # then the pool grows
    assert cache.allocate(2) == [68, 69] and cache.num_cached == 3
    assert set(cache.allocate(2)) == {first[2], first[1]}        # then eviction, least recently freed first
    assert cache.find(block_key(0, [2])) is None and cache.find(block_key(0, [0])) == first[0]
    cache.share(first[0])                                        # a hit takes it out of the eviction order
    with pytest.raises(NoFreeBlocksError):
        cache.allocate(1)
