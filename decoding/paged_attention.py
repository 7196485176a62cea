"""Attention over the paged KV cache, registered in transformers' AttentionInterface.

Why: an engine should serve any decoder transformers can run, batched, without a model forward
of its own per architecture. Every decoder in transformers 5 computes q/k/v (fused or not, with
per-head norms, rotary of any kind, MoE blocks around it) in its own modules and then calls
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, scaling=...,
sliding_window=..., softcap=..., **kwargs)`, where kwargs are whatever the caller passed to the
model's forward. vLLM's Transformers backend and transformers' own continuous batching ride this
hook; so does this module: the runner registers it (`register`), sets the model's implementation to
ATTENTION_NAME and passes the batch's `PagedBatchView` as the `paged_batch` keyword. The function stores the new keys and
values in the sequence's blocks (nothing is kept by the model: it runs with use_cache=False) and
attends over each row's blocks under that layer's own sliding window and logit soft-cap.

On CPU a row's blocks are gathered into a padded tensor and SDPA runs with an additive mask (there
is no paged kernel for CPU); with a soft-cap, the same arithmetic runs eagerly. On CUDA with
flash-attn installed, `flash_attn_varlen_func` reads the blocks through the block table and nothing
is gathered (`flash_paged_attention`; never run here: no GPU).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

ATTENTION_NAME = "specserve_paged"


class PagedAttentionError(RuntimeError):
    """The model asked the paged attention for something it does not do (attention sinks)."""


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, softcap: float | None = None,
                            paged_batch=None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, H, T, D], this forward's key/value
    [B, kv heads, T, D] -> ([B, T, H, D], None). `module.layer_idx` picks the layer's pools."""
    if paged_batch is None:
        # Not the engine's forward (or a layer that drops forward's keyword arguments, which
        # the runner's start-up check refuses): attend over this call's keys alone.
        return _plain_attention(query, key, value, attention_mask, scaling, softcap)
    if kwargs.get("s_aux") is not None:
        raise PagedAttentionError("attention sinks (s_aux) are not supported by the paged attention")
    attended = paged_batch.attend(module.layer_idx, query, key, value, scaling=scaling,
                                  sliding_window=sliding_window, softcap=softcap)
    return attended.transpose(1, 2).contiguous(), None


def sdpa_over_gathered(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                       scaling: float | None, softcap: float | None) -> torch.Tensor:
    """Attention of query [B, H, T, D] over gathered keys/values [B, kv heads, L, D] under an
    additive mask [B, 1, T, L] -> [B, H, T, D]. A soft-cap (Gemma 2) is applied to the scaled
    scores before the mask, as transformers' eager attention does; SDPA cannot, so that path runs
    the same arithmetic by hand."""
    groups = query.shape[1] // keys.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                              enable_gqa=groups > 1)
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, keys.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values)


def _plain_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float | None, softcap: float | None) -> tuple[torch.Tensor, None]:
    """The model called directly, not by the engine (a test's oracle, HF `generate`, a training
    copy): transformers' own arithmetic over this call's keys, under the additive mask
    transformers built for it (eager_mask, registered below), so the model stays usable."""
    if mask is None:
        length = key.shape[2]
        mask = torch.full((query.shape[2], length), torch.finfo(query.dtype).min, dtype=query.dtype,
                          device=query.device).triu(length - query.shape[2] + 1)
    return sdpa_over_gathered(query, key, value, mask, scaling, softcap).transpose(1, 2).contiguous(), None


def flash_kernel_available(device: torch.device) -> bool:
    """True on CUDA when flash-attn with a paged (block-table) varlen kernel is installed."""
    if torch.device(device).type != "cuda":
        return False
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return False
    return "block_table" in inspect.signature(flash_attn_varlen_func).parameters


# flash-attn's paged kernel reads blocks of a multiple of 256 tokens.
FLASH_BLOCK_SIZE = 256


def flash_paged_attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, layout,
                          block_table: torch.Tensor, scaling: float | None, sliding_window: int | None,
                          softcap: float | None) -> torch.Tensor:
    """CUDA only, never run on this project's machines (no GPU): attention of the padded query
    [B, H, T, D] over the blocks block_table names (the layer's KV cache group's, [B, nb]; blocks a
    windowed group let go of read as block 0, outside the window), read in place by flash-attn's
    varlen kernel (pools [blocks, block_size, kv heads, D], the new keys already stored), so no
    sequence's history is gathered. Causal alignment is bottom-right (the queries are each row's
    last tokens); a window of W tokens is flash's (W - 1, 0). -> [B, H, T, D]."""
    from flash_attn import flash_attn_varlen_func

    batch, heads, columns, head_dim = query.shape
    rows, cols = layout.source_rows, layout.source_columns
    new_per_row = torch.bincount(rows, minlength=batch)
    kv_per_row = layout.position_ids[:, -1] + 1            # padding repeats the last real position
    zero = torch.zeros(1, dtype=torch.int32, device=query.device)
    cu_q = torch.cat([zero, new_per_row.cumsum(0).to(torch.int32)])
    cu_k = torch.cat([zero, kv_per_row.cumsum(0).to(torch.int32)])
    out = flash_attn_varlen_func(
        query.transpose(1, 2)[rows, cols], key_pool, value_pool, cu_q, cu_k,
        max_seqlen_q=int(new_per_row.max()), max_seqlen_k=int(kv_per_row.max()), softmax_scale=scaling,
        causal=True, window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1), softcap=softcap or 0.0,
        block_table=block_table.to(torch.int32))
    padded = query.new_zeros((batch, columns, heads, head_dim))
    padded[rows, cols] = out
    return padded.transpose(1, 2)


def register() -> None:
    """Make ATTENTION_NAME an attention implementation transformers knows (idempotent). Called by
    the runner, not at import: transformers' modeling module is heavy, and processes that only
    build configs (the CLI, the Serve controller) never need it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
