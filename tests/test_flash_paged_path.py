"""The CUDA paged-kernel path's plumbing, run on CPU against a stand-in for flash-attn.

flash-attn's `flash_attn_varlen_func` cannot run here (no GPU). The stand-in below implements its
documented contract in plain torch (queries packed by cu_seqlens_q; keys read through block_table
from pools [blocks, block_size, kv heads, D] up to cu_seqlens_k; causal aligned bottom-right;
window_size (left, 0); softcap; GQA), so what is tested is this project's side: token-major
stores, the block table, the cumulative lengths, and scattering rows back. The real kernel's
arithmetic is not tested (docs/gpu.md: what has not run on a GPU).

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md)."""

import sys
import types

import pytest
import torch

import specserve.decoding.paged_attention as paged_attention
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.scheduler import engine_for_model
from specserve.decoding.paged_cache import NO_BLOCK
from tests.reference_runner import full_logits
from tests.tiny_pair import tiny_model

ATOL = 1e-4


def varlen_stand_in(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                    causal=False, window_size=(-1, -1), softcap=0.0, block_table=None, **_):
    heads, kv_heads, block_size = q.shape[1], k.shape[2], k.shape[1]
    out = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        kv_len = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        blocks = block_table[b, :-(-kv_len // block_size)].long()
        keys = k[blocks].reshape(-1, kv_heads, k.shape[-1])[:kv_len].transpose(0, 1)     # [kvH, L, D]
        values = v[blocks].reshape(-1, kv_heads, v.shape[-1])[:kv_len].transpose(0, 1)
        keys, values = keys.repeat_interleave(heads // kv_heads, 0), values.repeat_interleave(heads // kv_heads, 0)
        query = q[q0:q1].transpose(0, 1)                                                      # [H, Tq, D]
        scores = query @ keys.transpose(1, 2) * (softmax_scale or query.shape[-1] ** -0.5)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(q1 - q0).view(-1, 1) + kv_len - (q1 - q0)                      # bottom-right
        k_pos = torch.arange(kv_len).view(1, -1)
        hidden = k_pos > q_pos
        if window_size[0] >= 0:
            hidden |= k_pos < q_pos - window_size[0]
        scores = scores.masked_fill(hidden, float("-inf"))
        out[q0:q1] = (torch.softmax(scores, -1) @ values).transpose(0, 1)
    return out


@pytest.fixture
def stand_in_flash(monkeypatch):
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = varlen_stand_in
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(paged_attention, "flash_kernel_available", lambda device: True)
    import specserve.decoding.batched_runner as batched_runner

    monkeypatch.setattr(batched_runner, "flash_kernel_available", lambda device: True)
    monkeypatch.setattr(batched_runner, "FLASH_BLOCK_SIZE", 4)   # small blocks: rows span several


@pytest.mark.parametrize("architecture", ["llama", "gemma2", "gemma3"])
def test_flash_path_rows_equal_the_models_own(stand_in_flash, architecture):
    model = tiny_model(architecture)
    engine = engine_for_model(model)
    assert engine.runner.cache.flash and engine.runner.block_size == 4
    histories = {"a": list(range(3, 40)), "b": list(range(50, 63)), "c": [7, 9, 11, 13, 15]}
    engine.forward_batch([ForwardCall(seq_id, history[:-3], 1) for seq_id, history in histories.items()])
    rows = engine.forward_batch([ForwardCall(seq_id, history, 4 if len(history) > 4 else 1)
                                 for seq_id, history in histories.items()])
    for history, got in zip(histories.values(), rows):
        torch.testing.assert_close(got, full_logits(model, history)[-len(got):], atol=ATOL, rtol=0)
    # Gemma's windowed layers' groups read through their own tables, whose blocks before the
    # window were let go (read as block 0, outside the window flash-attn is given).
    let_go = [NO_BLOCK in table for table in engine.blocks._sequences["a"].tables]
    assert any(let_go) == (architecture != "llama") and not all(let_go)
