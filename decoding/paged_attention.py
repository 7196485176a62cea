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

Three kernels read the paged cache (decoding.paged_cache.PagedBatchView picks one per forward):
flex_attention reading the blocks in place through a block mask made from the block tables
(`flex_paged_attention`: causality and sliding windows as its mask_mod, soft-caps as its
score_mod; C++ on CPU and Triton on CUDA once compiled, so it runs in the compiled forward);
gathering each row's blocks for SDPA (`sdpa_over_gathered`: the eager forward's, and the tests'
reference); and on CUDA with flash-attn installed, its varlen kernel through the block table
(`flash_paged_attention`; never run here: no GPU).
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
    groups = getattr(module, "num_key_value_groups", None)
    attended = paged_batch.attend(module.layer_idx, query, key, value, scaling=scaling,
                                  sliding_window=sliding_window, softcap=softcap,
                                  query_per_kv=groups if isinstance(groups, int) else None)
    return attended.transpose(1, 2).contiguous(), None


def sdpa_over_gathered(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                       scaling: float | None, softcap: float | None) -> torch.Tensor:
    """Attention of query [B, H, T, D] over gathered keys/values [B, kv heads, L, D] under an
    additive mask [B, 1, T, L] (None: every key is seen) -> [B, H, T, D]. A soft-cap (Gemma 2) is
    applied to the scaled scores before the mask, as transformers' eager attention does; SDPA
    cannot, so that path runs the same arithmetic by hand."""
    groups = query.shape[1] // keys.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                              enable_gqa=groups > 1)
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, keys.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
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
# How a forward's attention reads the paged cache (decoding.paged_cache.PagedBatchView).
ATTENTION_KERNELS = ("flex", "gather", "flash")
# Query rows flex_attention's block mask takes per block: more than any step has, so that every
# step (decode, verify, draft or a prefill chunk) is one query block. Every query of a row reads the
# same list of blocks (the mask_mod hides what a query must not see), so finer query blocks would
# only repeat that list; repeated, the compiled kernels read it wrong (broadcast, a row read another
# row's; copied out, the CUDA kernel faulted: docs/gpu.md). A constant, so the compiled kernel does
# not specialize on the number of new tokens; a power of two, as the kernel's query tile must
# divide it.
FLEX_QUERY_BLOCK = 1 << 20
# The key tile of inductor's CUDA flex_attention kernels, which must divide a KV block (their
# default is wider than a small block). A constant, so that the kernel's options depend on nothing
# read while tracing, and a block size on CUDA must be a multiple of it (PagedBatchView checks).
FLEX_KEY_TILE = 16


def flex_block_tables(tables: torch.Tensor, units: int, block_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flex_attention's view of one KV cache group's block tables [B, nb] (NO_BLOCK = -1 for
    blocks a windowed group let go of and past a row's own): (kv_num_blocks [B, 1, 1] int32: the
    blocks row b holds; kv_indices [B, 1, 1, units] int32: those blocks' ids first, in table order;
    key_positions [units x block_size] long: the position of the key in each token slot of the
    pool, a held block's index in its row's table x block_size + the slot's offset, and for a block
    no row holds, as if it were the first). The key tensor is the whole pool ([units x block_size]
    tokens), so the kernel visits exactly a row's blocks, in place. A block sits at the same table
    index in every row that holds it (a block's keys are those of its positions: shared blocks are
    shared prefixes), so one key_positions serves the batch. Positions are looked up, not computed
    from the slot inside the mask: integer arithmetic on the key index there is what inductor's
    CUDA flex template has failed to compile. Device ops only: built once per forward and group,
    shared by its layers."""
    batch, num_read = tables.shape
    held = tables >= 0
    count = held.sum(-1)
    order = torch.argsort((~held).to(torch.int8), dim=1, stable=True)     # held entries first, in table order
    compact = tables.gather(1, order)
    kv_indices = torch.zeros((batch, units), dtype=torch.int32, device=tables.device)
    kv_indices[:, :num_read] = compact.clamp_min(0)
    visited = torch.arange(num_read, device=tables.device).unsqueeze(0) < count.unsqueeze(1)
    logical_block = torch.zeros(units + 1, dtype=torch.long, device=tables.device)   # + a sink for unheld entries
    logical_block.scatter_(0, torch.where(visited, compact, units).reshape(-1), order.reshape(-1))
    offsets = torch.arange(block_size, device=tables.device)
    key_positions = (logical_block[:units, None] * block_size + offsets).reshape(-1)
    kv_num_blocks, kv_indices = count.to(torch.int32).view(batch, 1, 1), kv_indices.view(batch, 1, 1, units)
    # Their ones are ones in a compiled forward too (not symbols of sizes that happen to be 1 now).
    import torch._dynamo as dynamo

    dynamo.mark_static(kv_num_blocks, [1, 2])
    dynamo.mark_static(kv_indices, [1, 2])
    return kv_num_blocks, kv_indices, key_positions


def flex_paged_attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                         tables: torch.Tensor, block_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                         position_ids: torch.Tensor,
                         block_size: int, scaling: float | None, sliding_window: int | None,
                         softcap: float | None) -> torch.Tensor:
    """Attention of query [B, H, T, D] over the blocks of pools [units, block_size, kv heads, D]
    (the new keys already stored), read in place by flex_attention: the block mask lists each
    row's blocks (tables [B, nb], NO_BLOCK = -1; block_tables = flex_block_tables(tables)), each
    key's position is looked up in block_tables' key_positions, and the mask_mod hides keys after
    the query's position and, with a window of W, those at or before position - W (transformers'
    rule); a soft-cap is a score_mod applied to the scaled scores, as transformers' eager
    attention does. -> [B, H, T, D]."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    batch, heads, columns, _ = query.shape
    units, _, kv_heads, head_dim = key_pool.shape
    kv_num_blocks, kv_indices, key_positions = block_tables
    # The tables come into a compiled forward as inputs of their own, each size a symbol of its
    # own: said equal to the query's rows and the pool's units here, they are one symbol each,
    # and inductor need not reason about sizes it cannot tell are the same.
    torch._check(kv_num_blocks.shape[0] == batch)
    torch._check(kv_indices.shape[0] == batch)
    torch._check(kv_indices.shape[-1] == units)
    torch._check(key_positions.shape[0] == units * block_size)
    torch._check(columns <= FLEX_QUERY_BLOCK)

    # The compiled kernels visit only the blocks the block mask lists; flex_attention's eager
    # reference evaluates the mask over the whole pool, so there the block must be checked to be
    # the row's own (inductor's CPU template cannot compile that lookup, and needs none).
    check_rows = not torch.compiler.is_compiling()

    def mask_mod(b, h, q_idx, kv_idx):
        key_position = key_positions[kv_idx]
        distance = position_ids[b, q_idx] - key_position
        # Within a window of W: 0 <= distance < W, which for integers is distance x (W - 1 -
        # distance) >= 0: one comparison with neither a floor division nor an `&`, the two
        # things inductor's CUDA lowering of this mask has failed on (docs/gpu.md).
        visible = distance >= 0 if sliding_window is None else distance * (sliding_window - 1 - distance) >= 0
        if check_rows:
            visible = visible & (tables[b, key_position // block_size] == kv_idx // block_size)
        return visible

    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / softcap) * softcap

    block_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=(FLEX_QUERY_BLOCK, block_size),
                                          mask_mod=mask_mod, seq_lengths=(columns, units * block_size),
                                          compute_q_blocks=False)
    # The pool as one batch of keys, broadcast over the rows (a stride-0 batch crashed inductor's
    # CPU kernel).
    keys = key_pool.view(1, units * block_size, kv_heads, head_dim).transpose(1, 2)
    values = value_pool.view(1, units * block_size, kv_heads, value_pool.shape[-1]).transpose(1, 2)
    kernel_options = {"BLOCK_N": FLEX_KEY_TILE} if query.is_cuda else None
    return flex_attention(query, keys, values, score_mod=score_mod, block_mask=block_mask, scale=scaling,
                          enable_gqa=heads != kv_heads, kernel_options=kernel_options)


def flash_paged_attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, layout,
                          tables: torch.Tensor, scaling: float | None, sliding_window: int | None,
                          softcap: float | None) -> torch.Tensor:
    """CUDA only, never run on this project's machines (no GPU): attention of the padded query
    [B, H, T, D] over the blocks `tables` names (the layer's KV cache group's, [B, nb]; blocks a
    windowed group let go of read as block 0, outside the window), read in place by flash-attn's
    varlen kernel (pools [blocks, block_size, kv heads, D], the new keys already stored), so no
    sequence's history is gathered. Causal alignment is bottom-right (the queries are each row's
    last tokens); a window of W tokens is flash's (W - 1, 0). The maximum lengths are host-known
    bounds (T and the layout's kv_length), so nothing waits on the device. -> [B, H, T, D]."""
    from flash_attn import flash_attn_varlen_func

    batch, heads, columns, head_dim = query.shape
    kv_per_row = layout.position_ids[:, -1] + 1            # padding repeats the last real position
    zero = torch.zeros(1, dtype=torch.int32, device=query.device)
    cu_q = torch.cat([zero, layout.num_new.cumsum(0).to(torch.int32)])
    cu_k = torch.cat([zero, kv_per_row.cumsum(0).to(torch.int32)])
    packed = query.transpose(1, 2).reshape(batch * columns, heads, head_dim).index_select(0, layout.real_tokens)
    out = flash_attn_varlen_func(
        packed, key_pool, value_pool, cu_q, cu_k, max_seqlen_q=columns, max_seqlen_k=layout.kv_length,
        softmax_scale=scaling, causal=True, window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
        softcap=softcap or 0.0, block_table=tables.clamp_min(0).to(torch.int32))
    padded = query.new_zeros((batch * columns, heads, head_dim)).index_copy_(0, layout.real_tokens, out)
    return padded.view(batch, columns, heads, head_dim).transpose(1, 2)


def register() -> None:
    """Make ATTENTION_NAME an attention implementation transformers knows (idempotent). Called by
    the runner, not at import: transformers' modeling module is heavy, and processes that only
    build configs (the CLI, the Serve controller) never need it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
