"""The paged KV cache (decoding.paged_cache) under BatchedModelRunner: budgets and capacity, blocks
that follow the tokens held (allocated as sequences grow, freed on crop and release, never
leaked), refusal when the budget is spent, and rows equal to per-sequence DynamicCache rows on
ragged batches that cross many block boundaries. (The engine's general equality tests are in
tests/test_batched_runner.py.)"""

import logging
import os
import random
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from specserve.decoding.batched_runner import BatchedModelRunner
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.errors import NoFreeBlocksError, NoFreeSlotError
from specserve.decoding.scheduler import Scheduler, engine_for_model
from tests.reference_runner import ReferenceRunner
from specserve.decoding.paged_cache import (GIB, SAMPLER_ROW_COPIES, PagedKVCache, gpu_kv_budget_bytes, kv_bytes_per_token,
                                            kv_capacity, step_peak_bytes)
from tests.test_batched_runner import ATOL, assert_rows_match, random_ids, ragged_rounds
from tests.tiny_pair import tiny_model

# Llama-3.1-8B's published shapes (shared/CHECKPOINTS.md), no weights needed.
LLAMA_31_8B = LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                          head_dim=128, max_position_embeddings=131072)


def paged_engine(model, block_size: int = 16, budget_blocks: int | None = None, max_model_len: int | None = None,
                 max_sequences: int = 256, prefix_caching: bool = True) -> BatchedModelRunner:
    """A engine whose KV budget is exactly budget_blocks blocks (default: the 4 GiB default)."""
    gb = None
    if budget_blocks is not None:
        gb = budget_blocks * block_size * kv_bytes_per_token(model.config, torch.float32) / GIB
    runner = BatchedModelRunner.__new__(BatchedModelRunner)
    runner._init_from_model(model, max_sequences=max_sequences, model_path="tiny", max_model_len=max_model_len,
                            kv_cache_memory_gb=gb, block_size=block_size, prefix_caching=prefix_caching)
    return Scheduler(runner)


def test_llama_3_1_8b_shapes_fit_one_full_context_or_many_short_requests_in_16_gib():
    assert kv_bytes_per_token(LLAMA_31_8B, torch.bfloat16) == 128 * 1024   # 2 x 32 layers x 8 heads x 128 x 2 B
    capacity = kv_capacity(LLAMA_31_8B, torch.bfloat16, 16 * GIB, max_model_len=131072)
    assert (capacity.tokens, capacity.num_blocks, capacity.full_length_sequences) == (131072, 8192, 1)
    assert capacity.num_blocks // (1024 // capacity.block_size) == 128      # 128 sequences of 1k tokens
    assert "8,192 blocks of 16 tokens = 131,072 tokens, 16.00 GiB" in capacity.describe()
    # The slot cache reserved max_model_len per sequence: one 16 GiB slot each.
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        kv_capacity(LLAMA_31_8B, torch.bfloat16, 8 * GIB, max_model_len=131072)
    assert kv_capacity(LLAMA_31_8B, torch.bfloat16, 8 * GIB, max_model_len=8192).full_length_sequences == 8


def test_a_target_serving_an_eagle3_head_budgets_for_its_features():
    """Three 4,096-wide bf16 features a token (24 KiB) beside its 128 KiB of keys and values: the
    same 16 GiB holds 128/152 of the tokens, and the budget is still all it takes."""
    features = 3 * 4096 * 2
    capacity = kv_capacity(LLAMA_31_8B, torch.bfloat16, 16 * GIB, max_model_len=8192,
                           feature_bytes_per_token=features)
    assert capacity.num_blocks == 16 * GIB // ((128 * 1024 + features) * 16) == 6898
    assert capacity.gib <= 16 < capacity.gib + (128 * 1024 + features) * 16 / GIB
    assert "131,072 bytes a token + 24,576 of target features" in capacity.describe()


def test_bytes_per_token_reads_gpt2_names_and_the_default_head_size():
    gpt2 = GPT2Config(n_layer=3, n_head=4, n_embd=64)
    assert kv_bytes_per_token(gpt2, torch.float32) == 2 * 3 * 4 * 16 * 4
    assert kv_bytes_per_token(LlamaConfig(num_hidden_layers=2, num_attention_heads=8, hidden_size=256),
                              torch.float16) == 2 * 2 * 8 * 32 * 2   # no GQA, head_dim = hidden / heads


def test_the_pools_grow_to_what_a_plan_reserves_within_their_budget():
    cache = PagedKVCache(num_layers=1, num_blocks=200, block_size=4)
    assert cache.capacity == 0
    cache.reserve(64)
    cache.reserve(10)
    assert cache.capacity == 64
    with pytest.raises(ValueError, match="budget is 200"):
        cache.reserve(201)
    assert issubclass(NoFreeBlocksError, NoFreeSlotError)   # the engines' "wait, then overloaded" path


def test_preallocated_pools_are_static_addresses_for_torch_compile_and_growing_ones_are_not():
    """A preallocated pool (CUDA's) never moves, so the compiled forward may treat it as a static
    input, which CUDA graphs need of an input the forward writes into in place
    (tests/test_compiled_forward.py checks the compiled graph itself); a pool that grows (CPU's)
    gets new views as it grows, and stays an ordinary input."""
    from torch._dynamo.utils import get_static_address_type

    keys, values = torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8)
    fixed = PagedKVCache(num_layers=2, num_blocks=16, block_size=4, preallocate=True)
    growing = PagedKVCache(num_layers=2, num_blocks=16, block_size=4)
    growing.reserve(4)
    for cache, kind in ((fixed, "unguarded"), (growing, None)):
        for layer in range(2):
            assert {get_static_address_type(t) for t in cache.pools.layer(layer, keys, values)} == {kind}


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_ragged_rounds_across_many_small_blocks_give_the_unbatched_rows(architecture):
    """Blocks of 4 tokens: every row spans many blocks, rollbacks cut mid-block, released blocks
    are handed to a new sequence (which must not see the old keys). Prefix caching off, so the
    freed blocks are the free ones (with it on they would stay cached: tests/test_prefix_cache.py)."""
    model = tiny_model(architecture)
    batched, reference = paged_engine(model, block_size=4, prefix_caching=False), ReferenceRunner.from_model(model)
    for calls in ragged_rounds():
        assert_rows_match(batched, reference, calls)
    freed = batched.blocks._sequences["b"].tables[0]
    batched.release("b")
    reference.release("b")
    assert_rows_match(batched, reference, [ForwardCall("e", random_ids(5, 9), 3)])
    assert set(batched.blocks._sequences["e"].tables[0]) <= set(freed)


def test_blocks_follow_the_tokens_held_through_growth_crop_and_release():
    engine = paged_engine(tiny_model("llama"), block_size=4)
    history = random_ids(40, 10)
    engine.forward("s", history)
    assert engine.blocks.blocks_held("s") == 3 and engine.blocks.num_free_blocks == engine.runner.kv_capacity.num_blocks - 3
    engine.forward("s", history + [5, 6, 7], num_rows=4)          # a verify: 13 tokens, 4 blocks
    assert engine.blocks.blocks_held("s") == 4
    engine.blocks.rollback("s", 8)                                       # rejected tail: back to 2 blocks
    assert engine.blocks.blocks_held("s") == 2 and engine.blocks.num_cached("s") == 8
    engine.forward("s", history[:8] + [9], num_rows=1)
    assert engine.blocks.blocks_held("s") == 3
    engine.release("s")
    assert engine.kv_usage()["kv_blocks_used"] == 0 and engine.blocks.num_free_blocks == engine.runner.kv_capacity.num_blocks


def test_many_requests_with_rollbacks_leak_no_blocks():
    rng = random.Random(0)
    model = tiny_model("llama")
    engine = paged_engine(model, block_size=4, budget_blocks=400)
    live: dict[str, list[int]] = {}
    for step in range(60):
        if len(live) < 6:
            live[f"r{step}"] = random_ids(step, rng.randint(1, 30))
        calls = []
        for seq_id, history in live.items():
            block = random_ids(1000 + step, rng.randint(0, 5))
            calls.append(ForwardCall(seq_id, history + block, len(block) + 1))
        engine.forward_batch(calls)
        for seq_id in list(live):   # keep part of the block (the rest is rolled back next call)
            call = next(c for c in calls if c.seq_id == seq_id)
            live[seq_id] = list(call.token_ids[:len(live[seq_id]) + rng.randint(1, call.num_rows)])
            if len(live[seq_id]) > 60 or rng.random() < 0.1:
                engine.release(seq_id)
                del live[seq_id]
        held = sum(engine.blocks.blocks_held(seq_id) for seq_id in live)
        assert engine.kv_usage()["kv_blocks_used"] == held
    for seq_id in list(live):
        engine.release(seq_id)
    assert engine.blocks.num_free_blocks == 400 and engine.blocks.active_sequences() == []


def test_a_batch_past_the_budget_is_refused_whole_and_fits_once_blocks_are_freed():
    model = tiny_model("llama", max_position_embeddings=64)
    engine = paged_engine(model, block_size=16, budget_blocks=5)   # 80 tokens; max_model_len 64 (4 blocks)
    engine.forward("a", random_ids(50, 40))                         # 3 blocks
    with pytest.raises(NoFreeBlocksError, match="needs 3 more KV blocks, 2 of 5 are free"):
        engine.forward_batch([ForwardCall("b", random_ids(51, 20)), ForwardCall("a", random_ids(50, 49), 2)])
    assert engine.blocks.active_sequences() == ["a"] and engine.blocks.num_cached("a") == 40 and engine.blocks.blocks_held("a") == 3
    engine.forward("b", random_ids(51, 20))                         # 2 blocks: fits alone
    engine.release("a")
    torch.testing.assert_close(engine.forward("c", random_ids(52, 45), 2),
                               ReferenceRunner.from_model(model).forward("c", random_ids(52, 45), 2), atol=ATOL, rtol=0)


def test_a_failed_forward_gives_back_the_blocks_it_took(monkeypatch):
    engine = paged_engine(tiny_model("llama"), block_size=4)
    engine.forward("a", random_ids(53, 6))
    monkeypatch.setattr(engine.runner, "_logits", lambda *args: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError):
        engine.forward_batch([ForwardCall("a", random_ids(53, 6) + [4] * 10, 2), ForwardCall("new", [3] * 9)])
    assert engine.blocks.active_sequences() == ["a"] and engine.blocks.blocks_held("a") == 2
    assert engine.kv_usage()["kv_blocks_used"] == 2


def test_a_long_max_model_len_and_a_small_budget_run_many_short_sequences_at_once(caplog):
    """max_model_len 4096 and a budget of 4096 + 512 tokens: a slot cache would reserve 4096 tokens
    for each of the 16 sequences; paged, all 16 run together (lockstep greedy decoding, each equal
    to decoding alone), because each holds only its own ~50 tokens."""
    model = tiny_model("llama", max_position_embeddings=4096)
    with caplog.at_level(logging.INFO, logger="specserve.decoding.batched_runner"):
        engine = engine_for_model(model, max_sequences=64, kv_cache_memory_gb=(4096 + 512) *
                                  kv_bytes_per_token(model.config, torch.float32) / GIB)
    assert engine.max_context == 4096 and engine.runner.kv_capacity.tokens == 4096 + 512
    # Start-up says what the budget holds, in tokens and in sequences of max_model_len.
    assert "KV cache: 288 blocks of 16 tokens = 4,608 tokens" in caplog.text
    assert "up to 1 sequences of max_model_len=4,096" in caplog.text
    prompts = {f"r{i}": random_ids(60 + i, 10 + 2 * i) for i in range(16)}
    histories = {seq_id: list(prompt) for seq_id, prompt in prompts.items()}
    for _ in range(12):
        rows = engine.forward_batch([ForwardCall(seq_id, history) for seq_id, history in histories.items()])
        for history, row in zip(histories.values(), rows):
            history.append(int(row[0].argmax()))
    assert engine.kv_usage()["kv_tokens_held"] == sum(map(len, histories.values())) - 16   # last token not fed yet
    for seq_id in ("r0", "r15"):
        alone, ids = ReferenceRunner.from_model(model), list(prompts[seq_id])
        for _ in range(12):
            ids.append(int(alone.forward("s", ids)[0].argmax()))
        assert histories[seq_id] == ids


def test_max_model_len_caps_the_runner_and_cannot_exceed_the_model():
    model = tiny_model("llama", max_position_embeddings=128)
    assert paged_engine(model, max_model_len=32).max_context == 32
    with pytest.raises(ValueError, match="max_model_len=200"):
        paged_engine(model, max_model_len=200)
    assert engine_for_model(tiny_model("mistral", sliding_window=16), max_model_len=64).max_context == 64


@pytest.mark.parametrize("architecture", ["qwen3", "qwen3_moe", "gemma3", "phi3"])
def test_every_architecture_keeps_within_its_kv_budget_and_refuses_one_below_a_sequence(architecture):
    """The budget bounds what the pools reserve, whatever the architecture (heads and head size
    read from the config match the keys its layers store), and one that cannot hold a single
    max_model_len sequence is refused at start."""
    model = tiny_model(architecture, max_position_embeddings=64)
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        paged_engine(model, block_size=16, budget_blocks=3)           # 48 tokens < max_model_len 64
    engine = paged_engine(model, block_size=4, budget_blocks=40)
    budget_bytes = 40 * 4 * kv_bytes_per_token(model.config, torch.float32)
    histories = {f"r{i}": random_ids(70 + i, 20) for i in range(6)}
    with pytest.raises(NoFreeBlocksError):
        for _ in range(40):
            rows = engine.forward_batch([ForwardCall(seq_id, history) for seq_id, history in histories.items()])
            for history, row in zip(histories.values(), rows):
                history.append(int(row[0].argmax()))
    # (A block id holds one KV cache group's layers: Gemma 3's hold one layer each, so 120 ids.)
    assert engine.kv_usage()["kv_blocks_used"] <= engine.runner.kv_capacity.num_blocks
    assert 0 < engine.kv_usage()["kv_bytes_reserved"] <= budget_bytes


def test_a_gpu_kv_budget_is_the_engines_share_less_weights_and_peak_activations():
    """Two engines at num_gpus 0.5 on an 80 GiB device each get 0.9 x 40 GiB, less their weights
    and their profiled activations (not 0.9 x 80 GiB each, which would run the device out)."""
    total = 80 * GIB
    assert gpu_kv_budget_bytes(total, 0.9, 0.5, in_use_bytes=16 * GIB, activation_bytes=2 * GIB) == int(18 * GIB)
    assert gpu_kv_budget_bytes(total, 0.9, 1.0, 16 * GIB, 2 * GIB) == int(54 * GIB)
    assert gpu_kv_budget_bytes(total, 0.9, 2.0, 16 * GIB, 2 * GIB) == int(54 * GIB)   # a group's rank: its device
    assert gpu_kv_budget_bytes(total, 0.9, 0.25, 16 * GIB, 8 * GIB) == 0               # nothing left: refused later


def test_two_engines_sharing_a_device_in_one_process_stay_within_it():
    """A draft and a target at num_gpus 0.5 in one process (the in-process bench, `specserve
    generate`): each subtracts only its own weights and activations from its own share, so together
    they use at most gpu_memory_utilization of the device. Subtracting what the process already
    holds (the first engine's weights and whole pool) as the second's would leave it nothing."""
    total, utilization = 80 * GIB, 0.9
    engines = [(2 * GIB, 1 * GIB), (16 * GIB, 3 * GIB)]   # (weights, step peak) of draft and target
    budgets = [gpu_kv_budget_bytes(total, utilization, 0.5, weights, peak) for weights, peak in engines]
    assert sum(budgets) + sum(weights + peak for weights, peak in engines) <= total * utilization
    assert budgets == [int(33 * GIB), int(17 * GIB)]
    first_pool = budgets[0]
    held_by_the_process = engines[0][0] + first_pool   # what memory_allocated() shows the second engine
    assert gpu_kv_budget_bytes(total, utilization, 0.5, held_by_the_process + engines[1][0], engines[1][1]) == 0


def test_a_steps_peak_counts_the_samplers_rows_for_every_kept_row():
    """The profile's peak is the forward's plus the sampler's vocabulary-wide temporaries over the
    rows the step keeps: 64 verifies of K = 4 keep 320 rows, five times what keeping one row a
    sequence (the old profile) counted: at Llama 3's 128,256 ids that is gigabytes."""
    vocab = 128_256
    verify_batch = step_peak_bytes(forward_peak_bytes=GIB, kept_rows=64 * 5, vocab_size=vocab)
    one_row_each = step_peak_bytes(forward_peak_bytes=GIB, kept_rows=64, vocab_size=vocab)
    assert verify_batch - GIB == 5 * (one_row_each - GIB) == 320 * vocab * 4 * SAMPLER_ROW_COPIES
    assert verify_batch > 2 * GIB


def test_engine_specs_carry_their_gpu_share_and_the_largest_planned_forwards(tmp_path):
    from specserve.cluster.builder import gpu_share, served_model_specs
    from tests.tiny_pair import tiny_pair_config

    assert (gpu_share(0.5), gpu_share(1), gpu_share(0)) == (0.5, 1.0, 1.0)
    config = tiny_pair_config(tmp_path, "tiny", 8000)
    target, draft = served_model_specs(config)
    engine = config.engine_options()
    assert target["profile_batches"] == [[engine["max_batch_rows"], engine["max_step_tokens"]],
                                         [1, engine["prefill_token_budget"]]]
    assert target["gpu_share"] == draft["gpu_share"] == 1.0
    assert target["rollback_tokens"] == draft["rollback_tokens"] == engine["max_step_tokens"]


def test_a_budget_too_small_is_named_as_given_not_rounded():
    """0.0005 GiB said as 0.001 GiB (three decimals) reads as a different setting than the one
    the user gave: the message names the budget's own value, and in MiB."""
    with pytest.raises(ValueError, match=r"budget of 0\.0005 GiB \(0\.512 MiB\) holds"):
        kv_capacity(LLAMA_31_8B, torch.bfloat16, 0.0005 * GIB, max_model_len=1024)


def resident_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm's second field, in pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cpu_pool_grows_without_copying_and_takes_memory_only_where_written():
    cache = PagedKVCache(num_layers=2, num_blocks=4096, block_size=16)   # 2 x 512 MiB a layer at its budget
    cache.reserve(64)
    states = torch.ones(1, 64, 1, 1024)
    keys, values = cache.pools.layer(0, states, states)
    keys[7] = 1.0                                                          # one 4 MiB block written
    before = resident_bytes()
    cache.reserve(4096)
    grown_keys, grown_values = cache.pools.layer(0, states, states)
    assert grown_keys.shape == (4096, 16, 64, 1024) and cache.reserved_bytes() == 2 * 4096 * 16 * 64 * 1024 * 4
    # The same memory, widened: what was written is there, nothing was copied.
    assert grown_keys.data_ptr() == keys.data_ptr() and float(grown_keys[7].sum()) == 16 * 64 * 1024
    assert float(grown_values[4000].abs().sum()) == 0.0
    # Growing a pool by copying (torch.cat into zeros) would have made 1 GiB resident.
    assert resident_bytes() - before < 64 << 20


def test_a_cpu_pool_budget_beyond_the_machines_memory_still_maps():
    """The pools' address space is not charged up front: a budget larger than memory and swap maps
    (its layer made), and would fail only where blocks are written, as a pool grown by copies did."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    block_bytes = 16 * 64 * 1024 * 4
    cache = PagedKVCache(num_layers=1, num_blocks=2 * total // block_bytes + 1, block_size=16)
    cache.reserve(1)
    keys, _ = cache.pools.layer(0, torch.ones(1, 64, 1, 1024), torch.ones(1, 64, 1, 1024))
    assert cache.pools.max_units * block_bytes > 2 * total and keys.shape[0] == 1
