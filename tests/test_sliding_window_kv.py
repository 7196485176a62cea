"""Sliding-window layers' KV memory is bounded by their window (decoding.paged_cache.KVGroup,
BlockManager._let_go_outside_windows): windowed layers are KV cache groups of their own and
let go of the blocks wholly older than their window, while the rows stay the model's own through
chunked prefill, decode, K-token verify with rollback, deep rollback and fork/adopt; the freed
blocks serve other sequences, the KV budget counts the bound (more sequences fit), and freeing
one block too many is caught. Tiny random fp32 models with windows shorter than the prompts.

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md)."""

import pytest
import torch
from transformers import Gemma3TextConfig

import specserve.decoding.block_manager as block_manager_module
from specserve.decoding.batched_runner import BatchedModelRunner
from specserve.decoding.block_manager import BlockManager, ForwardCall
from specserve.decoding.errors import NoFreeBlocksError
from specserve.decoding.paged_cache import (
    GIB,
    NO_BLOCK,
    KVGroup,
    blocks_for,
    kv_bytes_per_token,
    kv_capacity,
    kv_groups,
    window_blocks,
)
from specserve.decoding.scheduler import CallShape, Scheduler
from tests.reference_runner import full_logits
from tests.test_batched_runner import ATOL, random_ids
from tests.tiny_pair import SHORT_WINDOW, tiny_model

BLOCK_SIZE = 4
ROLLBACK_TOKENS = 4        # a verify of K = 3 drafts rolls back at most 3
PROFILE_BATCHES = ((4, 8),)   # the largest planned forward: 8 new tokens a row
# Each fixture's KV cache groups' windows (tests/tiny_pair.py): Gemma 3's two windowed layers and
# one global layer make three groups of one layer; Gemma 2 alternates; Mistral (sliding_window
# set) and Phi-3 window every layer, one group.
WINDOWED = {"gemma3": [SHORT_WINDOW, SHORT_WINDOW, None], "gemma2": [SHORT_WINDOW, None],
            "mistral": [SHORT_WINDOW], "phi3": [12]}


def windowed_model(architecture: str):
    return tiny_model(architecture, sliding_window=SHORT_WINDOW) if architecture == "mistral" else tiny_model(
        architecture)


def windowed_engine(model, budget_bytes: float | None = None, **options) -> Scheduler:
    runner = BatchedModelRunner.__new__(BatchedModelRunner)
    runner._init_from_model(model, max_sequences=16, model_path="tiny", block_size=BLOCK_SIZE,
                            rollback_tokens=ROLLBACK_TOKENS, profile_batches=PROFILE_BATCHES,
                            kv_cache_memory_gb=None if budget_bytes is None else budget_bytes / GIB, **options)
    return Scheduler(runner)


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Session:
    """Calls a engine the way the engines do and checks every row against the model's own
    cache-free forward, and (check_recompute) that each call computed only what it did not hold."""

    def __init__(self, engine: Scheduler, model, check_recompute: bool = True) -> None:
        self.engine, self.model, self.check_recompute = engine, model, check_recompute
        self.held: dict[str, list[int]] = {}

    def step(self, calls: list[ForwardCall]) -> list[int]:
        expected_new = sum(len(call.token_ids) - min(common_prefix(self.held.get(call.seq_id, []), call.token_ids),
                                                     len(call.token_ids) - call.num_rows) for call in calls)
        rows = self.engine.forward_batch(calls)
        for call, got in zip(calls, rows):
            torch.testing.assert_close(got, full_logits(self.model, list(call.token_ids))[-call.num_rows:],
                                       atol=ATOL, rtol=0, msg=lambda m: f"{call.seq_id}: {m}")
            self.held[call.seq_id] = list(call.token_ids)
        if self.check_recompute:
            assert self.engine.last_num_new_tokens == expected_new, "a call recomputed what it should hold"
        return [int(got[-1].argmax()) for got in rows]


def speculative_session(engine: Scheduler, model, check_recompute: bool = True) -> None:
    """Chunked prefill beside another sequence's decode, decode, K=3 verifies with rejections,
    a rollback, fork/adopt of a branch: all far past the window."""
    session = Session(engine, model, check_recompute)
    prompt, other = random_ids(5, 37), random_ids(6, 12)
    session.step([ForwardCall("b", other, 1)])
    for end in range(10, len(prompt) + 10, 10):   # chunked prefill, b decoding beside it
        token, bonus = session.step([ForwardCall("a", prompt[:end], 1), ForwardCall("b", other, 1)])
        other.append(bonus)
    history = prompt + [token]
    for _ in range(8):   # decode
        history.append(session.step([ForwardCall("a", history, 1)])[0])
    for accepted in (0, 2, 3, 1):   # verify K=3 drafts; keep `accepted` of them, then the bonus token
        drafts = random_ids(len(history), 3)
        session.step([ForwardCall("a", history + drafts, 4)])
        history = history + drafts[:accepted]
        history.append(session.step([ForwardCall("a", history, 1)])[0])
    engine.blocks.rollback("a", len(history) - 2)   # the engine's explicit crop
    session.held["a"] = history[:-2]
    session.step([ForwardCall("a", history, 2)])
    engine.blocks.fork("a", "branch")   # a speculation-cache branch: shares a's blocks, copy-on-write
    session.held["branch"] = list(history)
    branch = history + random_ids(7, 3)
    session.step([ForwardCall("branch", branch, 4), ForwardCall("a", history + [9], 1)])
    session.held["a"] = history + [9]
    engine.blocks.adopt("a", "branch")
    session.held["a"] = session.held.pop("branch")
    session.step([ForwardCall("a", branch + [11], 2)])


@pytest.mark.parametrize("architecture", sorted(WINDOWED))
def test_windowed_rows_equal_the_models_own_while_blocks_outside_the_window_are_let_go(architecture):
    model = windowed_model(architecture)
    engine = windowed_engine(model)
    assert [group.window for group in engine.runner.cache.groups] == WINDOWED[architecture]
    speculative_session(engine, model)
    entry = engine.blocks._sequences["a"]
    for group, table in zip(engine.runner.cache.groups, entry.tables):
        if group.window is None:
            assert NO_BLOCK not in table
        else:
            assert table[0] == NO_BLOCK and engine.blocks.blocks_held("a", engine.runner.cache.groups.index(group)) <= window_blocks(
                group.window, BLOCK_SIZE, ROLLBACK_TOKENS, 0)
    # A crop deeper than rollback_tokens finds the windowed keys let go: the call starts over, and
    # finds the let-go blocks (still cached, every group's) in the prefix cache.
    history, found = engine.blocks._sequences["a"].token_ids[:20] + [3], engine.blocks.prefix_cached_tokens("a")
    torch.testing.assert_close(engine.forward("a", history), full_logits(model, history)[-1:], atol=ATOL, rtol=0)
    assert engine.last_num_new_tokens == 1 and engine.blocks.prefix_cached_tokens("a") - found == 20
    for seq_id in engine.blocks.active_sequences():
        engine.release(seq_id)
    assert engine.blocks.allocator.num_used == 0


def test_kv_groups_follow_each_layers_window_with_as_many_layers_each():
    assert kv_groups([None] * 4) == (KVGroup((0, 1, 2, 3), None),)
    assert kv_groups([8, 8, None, 8, 8, None]) == (KVGroup((0, 1), 8), KVGroup((3, 4), 8), KVGroup((2, 5), None))
    assert kv_groups([8, 8, 8, None]) == (KVGroup((0,), 8), KVGroup((1,), 8), KVGroup((2,), 8), KVGroup((3,), None))
    assert [len(group.layers) for group in windowed_engine(tiny_model("llama")).runner.cache.groups] == [2]   # unchanged


def test_a_windowed_groups_blocks_stay_bounded_while_the_full_groups_grow_and_freed_ones_serve_others():
    """Gemma 3 (window 8, blocks of 4, rollback_tokens 4): decoding to 110 tokens, each windowed
    group holds at most window_blocks(8, 4, 4, 0) = ceil(11 / 4) + 1 = 4 blocks (and reaches it);
    the global layer's group holds ceil(n / 4). The blocks let go serve the other groups and a
    sequence decoding beside it, so the pool never grows past its first 64 blocks (every layer
    keeping 110 tokens would take 3 x 28 ids for one sequence)."""
    model = tiny_model("gemma3")
    engine = windowed_engine(model, prefix_caching=False)
    bound = window_blocks(SHORT_WINDOW, BLOCK_SIZE, ROLLBACK_TOKENS, 0)
    assert bound == 4
    histories = {"a": random_ids(8, 5), "b": random_ids(9, 5)}
    held_before, let_go, by_b, by_global, most = {}, set(), set(), set(), 0
    for step in range(105):
        calls = [ForwardCall(seq_id, history) for seq_id, history in histories.items() if seq_id == "a" or step % 3]
        for call, rows in zip(calls, engine.forward_batch(calls)):
            call.token_ids.append(int(rows[-1].argmax()))
        for index, group in enumerate(engine.runner.cache.groups):
            table = engine.blocks._sequences["a"].tables[index]
            held = engine.blocks.blocks_held("a", index)
            if group.window is None:
                assert held == blocks_for(len(histories["a"]) - 1, BLOCK_SIZE)
            else:
                assert held <= bound
                most = max(most, held)
                let_go |= {block for block in held_before.get(index, ()) if block not in table}
                held_before[index] = [block for block in table if block != NO_BLOCK]
        if "b" in engine.blocks._sequences:
            by_b |= {block for table in engine.blocks._sequences["b"].tables for block in table} & let_go
        by_global |= set(engine.blocks._sequences["a"].tables[2]) & let_go
    assert most == bound and engine.blocks.blocks_held("a", 2) == 28
    assert len(let_go) >= 10 and by_b and by_global
    assert engine.runner.cache.capacity == 64
    # Without the prefix cache, a crop deeper than rollback_tokens recomputes from the start.
    history = histories["a"]
    torch.testing.assert_close(engine.forward("a", history[:50]), full_logits(model, history[:50])[-1:],
                               atol=ATOL, rtol=0)
    assert engine.last_num_new_tokens == 50


def test_the_budget_counts_the_windowed_bound_so_more_sequences_fit_and_too_small_is_refused():
    # Gemma 3 1B's published shapes (26 layers, 1 kv head of 256, a global layer every 6th,
    # window 512, 32k context), bf16, 4 GiB: 4 full-context sequences if every layer kept the whole
    # context, 28 when the 22 windowed layers keep window_blocks(512, 16, 16, 256) = 50 blocks.
    config = Gemma3TextConfig(num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                              hidden_size=1152, sliding_window=512, max_position_embeddings=32768)
    groups = kv_groups([512 if kind == "sliding_attention" else None for kind in config.layer_types])
    assert len(groups) == 13 and all(len(group.layers) == 2 for group in groups)
    before = kv_capacity(config, torch.bfloat16, 4 * GIB, 32768)
    after = kv_capacity(config, torch.bfloat16, 4 * GIB, 32768, groups=groups, rollback_tokens=16, new_tokens=256)
    assert after.gib == pytest.approx(before.gib, rel=1e-3)
    assert (before.full_length_sequences, after.full_length_sequences) == (4, 28)

    # A tiny Gemma 3 (2 windowed layers, 1 global) of max_model_len 128: a budget of 40 blocks of
    # every layer (120 one-layer block ids) held one full-length sequence; a full-length one now
    # takes 32 + 2 x 6 = 44 ids, so two fit, and two sequences decode to 120 tokens at once.
    model = tiny_model("gemma3")
    per_layer_block = BLOCK_SIZE * kv_bytes_per_token(model.config, torch.float32) / 3
    budget = 120.5 * per_layer_block
    assert kv_capacity(model.config, torch.float32, budget * 3 / 3, 128, BLOCK_SIZE).full_length_sequences == 1
    engine = windowed_engine(model, budget_bytes=budget)
    assert engine.runner.kv_capacity.num_blocks == 120 and engine.runner.kv_capacity.full_length_sequences == 2
    histories = {"x": random_ids(10, 8), "y": random_ids(11, 8)}
    while len(histories["x"]) < 120:
        rows = engine.forward_batch([ForwardCall(seq_id, history) for seq_id, history in histories.items()])
        for history, row in zip(histories.values(), rows):
            history.append(int(row[-1].argmax()))
    assert 2 * 3 * blocks_for(119, BLOCK_SIZE) > 120 and engine.blocks.allocator.num_used <= 120
    assert engine.kv_usage()["kv_bytes_reserved"] <= budget
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        windowed_engine(model, budget_bytes=43.5 * per_layer_block)


def test_the_scheduler_plans_a_block_in_every_group_so_what_it_plans_runs():
    """Gemma 3's three groups each take a block per 4 tokens: of three 30-token prompts (24 block
    ids each) in 60 free ids the scheduler plans two and keeps one waiting (counting one table, it
    would plan all three: 72 ids, which the engine refuses); the two run, let go of their
    windowed blocks outside the window, and the third fits."""
    model = tiny_model("gemma3")
    per_layer_block = BLOCK_SIZE * kv_bytes_per_token(model.config, torch.float32) / 3
    engine = windowed_engine(model, budget_bytes=60.5 * per_layer_block)
    scheduler = engine
    prompts = {seq_id: random_ids(20 + i, 30) for i, seq_id in enumerate("xyz")}
    schedule = scheduler.schedule([CallShape(seq_id, prompt) for seq_id, prompt in prompts.items()])
    assert [index for index, _ in schedule.plan.prefills] == [0, 1] and schedule.plan.waiting == [2]
    assert schedule.calls[0].kv_groups == 3
    with pytest.raises(NoFreeBlocksError):
        engine.forward_batch([ForwardCall(seq_id, prompt) for seq_id, prompt in prompts.items()])
    engine.forward_batch([ForwardCall(seq_id, prompts[seq_id]) for seq_id in "xy"])
    # Once run, x and y's windowed groups keep 4 blocks each of their 8: z now fits.
    assert engine.blocks.blocks_held("x") == 8 + 4 + 4
    schedule = scheduler.schedule([CallShape("z", prompts["z"])])
    assert schedule.plan.prefills == [(0, 30)]
    engine.forward_batch([ForwardCall("z", prompts["z"])])


@pytest.mark.parametrize("broken", ["one block too many", "one block too many, unguarded"])
def test_letting_go_of_a_block_still_inside_the_window_is_caught(monkeypatch, broken):
    """Freeing one block more than blocks_before_window allows: the guard that recomputes a
    sequence whose windowed keys are gone makes calls recompute what they held (caught by the
    recompute count); without the guard the rows leave the model's (caught by the tolerance)."""
    original = block_manager_module.blocks_before_window
    monkeypatch.setattr(block_manager_module, "blocks_before_window", lambda *args: original(*args) + 1)
    if broken.endswith("unguarded"):
        monkeypatch.setattr(BlockManager, "_servable", lambda self, entry, length: length)
    model = tiny_model("gemma3")
    with pytest.raises(AssertionError):
        speculative_session(windowed_engine(model), model, check_recompute=not broken.endswith("unguarded"))
