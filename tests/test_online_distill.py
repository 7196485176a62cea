"""The draft learns from captured verify rows (docs/online-learning.md, the Ray-free core): the capture buffer's
bound and held-back split, persistence round trip, the top-k KL and expected acceptance against
exact full-row values, and distillation on captures moving a mismatched draft toward its target
while the canary refuses a candidate that is worse."""

from __future__ import annotations

import copy

import numpy as np
import torch

from specserve.decoding.capture import CaptureBuffer, CapturedBlock, capture_rows, load_blocks, save_blocks
from tests.tiny_pair import tiny_llama
from specserve.training.online_distill import (DistillSettings, TrainingDevice, canary_accepts, distill_on_positions,
                                     expected_acceptance, mean_expected_acceptance, position_batch,
                                     this_process_training_device, topk_forward_kl, training_device)


def _block(request_id: str, k: int = 3, width: int = 4) -> CapturedBlock:
    return CapturedBlock(request_id, (1, 2, 3), tuple(range(k)), 1, np.zeros((k, width), np.int32),
                         np.full((k, width), -2.0, np.float32))


def test_the_buffer_stays_within_its_bound_and_samples_by_count():
    buffer = CaptureBuffer(max_positions=10, sample_every=3)
    assert [buffer.wants_next() for _ in range(6)] == [False, False, True, False, False, True]
    for n in range(20):
        buffer.add(_block(f"r{n}"))
    assert buffer.num_positions <= 10 and buffer.total_positions == 60
    assert [b.request_id for b in buffer.blocks()] == ["r17", "r18", "r19"]   # the newest survive


def test_held_back_split_is_by_request_and_persisted_blocks_round_trip(tmp_path):
    buffer = CaptureBuffer(max_positions=10_000)
    for n in range(200):
        buffer.add(_block(f"req-{n // 2}"))   # two blocks per request
    train, held = buffer.split()
    assert 0.1 < len(held) / 200 < 0.3
    assert not {b.request_id for b in train} & {b.request_id for b in held}
    save_blocks(held, tmp_path, "shard-0")
    loaded = list(load_blocks(tmp_path))
    assert [b.request_id for b in loaded] == [b.request_id for b in held]
    assert all(np.array_equal(a.top_logprobs, b.top_logprobs) for a, b in zip(loaded, held))


def test_topk_kl_and_acceptance_equal_the_exact_values_when_k_covers_the_support():
    generator = torch.Generator().manual_seed(0)
    target_logits = torch.randn(5, 12, generator=generator) * 2
    draft_logits = torch.randn(5, 12, generator=generator) * 2
    target_logprobs = torch.log_softmax(target_logits, -1)
    block = capture_rows("r", [1], list(range(5)), 2, target_logprobs, top_k=12)
    ids, lps = torch.as_tensor(block.top_ids).long(), torch.as_tensor(block.top_logprobs)
    p, q = target_logprobs.exp(), torch.softmax(draft_logits, -1)
    exact_kl = (p * (target_logprobs - torch.log_softmax(draft_logits, -1))).sum(-1)
    assert torch.allclose(topk_forward_kl(draft_logits, ids, lps), exact_kl, atol=1e-5)
    assert torch.allclose(expected_acceptance(draft_logits, ids, lps), torch.minimum(p, q).sum(-1), atol=1e-6)
    # With k < V: the KL is the coarsened one (a lower bound, still >= 0, zero at q = p), and the
    # acceptance a lower bound.
    top3 = capture_rows("r", [1], list(range(5)), 2, target_logprobs, top_k=3)
    ids3, lps3 = torch.as_tensor(top3.top_ids).long(), torch.as_tensor(top3.top_logprobs)
    coarse = topk_forward_kl(draft_logits, ids3, lps3)
    assert (coarse >= -1e-6).all() and (coarse <= exact_kl + 1e-5).all()
    assert topk_forward_kl(target_logits, ids3, lps3).abs().max() < 1e-5
    assert (expected_acceptance(draft_logits, ids3, lps3) <= torch.minimum(p, q).sum(-1) + 1e-6).all()


def _captured_from(target, draft, requests: int, seed: int) -> list[CapturedBlock]:
    """Blocks as a served round would capture them: the draft's greedy K tokens, the target's rows."""
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    with torch.no_grad():
        for n in range(requests):
            context = torch.randint(2, 96, (6,), generator=generator).tolist()
            drafted = []
            for _ in range(4):
                drafted.append(int(draft(torch.tensor([context + drafted])).logits[0, -1].argmax()))
            rows = torch.log_softmax(target(torch.tensor([context + drafted])).logits[0, len(context) - 1:], -1)
            accepted = 0
            while accepted < 4 and int(rows[accepted].argmax()) == drafted[accepted]:
                accepted += 1
            blocks.append(capture_rows(f"req-{n}", context, drafted, accepted, rows, top_k=16))
    return blocks


def test_distilling_on_captures_raises_expected_acceptance_and_the_canary_judges():
    target, draft = tiny_llama(seed=0), tiny_llama(seed=1)
    buffer = CaptureBuffer(max_positions=100_000)
    for block in _captured_from(target, draft, requests=160, seed=0):
        buffer.add(block)
    train, held = buffer.split()
    train_batch, held_batch = position_batch(train, 64), position_batch(held, 64)
    before = mean_expected_acceptance(draft, held_batch)
    candidate = copy.deepcopy(draft)
    steps = distill_on_positions(candidate, train_batch, DistillSettings(lr=1e-2, epochs=6, batch_size=32))
    after = mean_expected_acceptance(candidate, held_batch)
    assert steps > 0 and after > before + 0.04, (before, after)
    assert canary_accepts(before, after, margin=0.02)
    # A draft already matched to its target (here: the target itself) trained toward another
    # model's rows gets worse on the held-back slice, and the canary refuses it.
    matched = copy.deepcopy(target)
    matched_score = mean_expected_acceptance(matched, held_batch)
    other = position_batch(_captured_from(tiny_llama(seed=7), draft, requests=80, seed=1), 64)
    distill_on_positions(matched, other, DistillSettings(lr=1e-2, epochs=6, batch_size=32))
    worse_score = mean_expected_acceptance(matched, held_batch)
    assert worse_score < matched_score - 0.05, (matched_score, worse_score)
    assert not canary_accepts(matched_score, worse_score, margin=0.02)


def test_a_trainer_given_a_gpu_trains_there_with_bf16_autocast_where_supported_else_on_the_cpu_in_float32():
    assert training_device(1, cuda_available=True, bf16_supported=True) == TrainingDevice("cuda", torch.bfloat16)
    assert training_device(0.5, cuda_available=True, bf16_supported=False) == TrainingDevice("cuda", None)
    assert training_device(1, cuda_available=False, bf16_supported=False) == TrainingDevice("cpu", None)
    assert training_device(0, cuda_available=True, bf16_supported=True) == TrainingDevice("cpu", None)  # not its GPU
    assert this_process_training_device(0) == TrainingDevice("cpu", None)


def test_autocast_training_runs_its_forwards_in_the_lower_dtype_and_keeps_float32_weights_that_learn():
    """bf16 autocast on the CPU stands in for the GPU path (no GPU here): the same code runs."""
    target, draft = tiny_llama(seed=0), tiny_llama(seed=1)
    train = CaptureBuffer(max_positions=100_000)
    for block in _captured_from(target, draft, requests=80, seed=0):
        train.add(block)
    batch = position_batch(train.split()[0], 64)
    on = TrainingDevice("cpu", torch.bfloat16)
    seen = []
    hook = draft.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    before = mean_expected_acceptance(draft, batch, on=on)
    distill_on_positions(draft, batch, DistillSettings(lr=1e-2, epochs=3, batch_size=32, on=on))
    hook.remove()
    assert set(seen) == {torch.bfloat16}
    assert {p.dtype for p in draft.parameters()} == {torch.float32}
    assert mean_expected_acceptance(draft, batch, on=on) > before + 0.02


def test_training_yields_when_asked():
    draft = tiny_llama(seed=1)
    batch = position_batch([_block(f"r{n}", width=4) for n in range(40)], 16)
    calls = iter(range(1000))
    assert distill_on_positions(draft, batch, DistillSettings(batch_size=4), should_stop=lambda: next(calls) >= 2) == 2


def test_a_blocks_positions_share_one_row_and_score_as_one_row_per_position_would():
    """position_batch puts a block's K positions in one row (context + drafted[:-1]); each
    position's logits must equal a forward of exactly its own context, cut to max_context."""
    from specserve.training.online_distill import _position_logits

    model = tiny_llama(seed=3)
    blocks = [CapturedBlock(f"r{n}", tuple(range(2, 2 + 5 + n)), (7, 8, 9), 1, np.zeros((3, 4), np.int32),
                            np.full((3, 4), -2.0, np.float32)) for n in range(3)]
    batch = position_batch(blocks, max_context=6)
    assert batch.num_rows == 3 and batch.num_positions == 9
    with torch.no_grad():
        shared = _position_logits(model, batch)
        for n, block in enumerate(blocks):
            for i in range(3):
                context = (list(block.context) + list(block.drafted[:i]))[-6:]
                alone = model(torch.tensor([context])).logits[0, -1]
                # The shared row is cut once for the block, so a position before its last sees
                # up to K - 1 - i tokens fewer at the front than max_context allows: compare with that.
                row = (list(block.context) + list(block.drafted[:-1]))[-6:]
                own = model(torch.tensor([row[: len(row) - 2 + i]])).logits[0, -1]
                assert torch.allclose(shared[3 * n + i], own, atol=1e-5)
                if i == 2:
                    assert torch.allclose(shared[3 * n + i], alone, atol=1e-5)
