"""A paged KV cache: fixed-size blocks in one pool per layer, a block table per sequence.

Why: a slot per sequence sized at the model's context reserves max_model_len tokens for every
sequence, so a long-context model (131,072 tokens) cannot hold even one short request in a sane
budget. Here memory follows the tokens sequences actually hold, as vLLM's PagedAttention and
nano-vllm's BlockManager do: per layer, keys and values live in [num_blocks, kv_heads, block_size,
head_dim] pools, a sequence owns a list of blocks (its block table), gets a new block when it
grows past its last one and gives blocks back when it is cropped (rollback) or released. With
prefix caching (on by default, as in vLLM) a full block given back stays findable by a hash chained
over its tokens until the pool needs its room, so a later sequence with the same prefix (a shared
system prompt, n choices, a chat's next turn) shares it instead of computing it again. Block ids,
tables and the prefix cache live with the scheduler (decoding.block_manager); this module is the
memory behind the ids (PagedKVCache) and the arithmetic of the budget.

Attention reads a sequence's keys through its table. There is no paged-attention kernel on CPU,
so `PagedBatchView.update` (the `past_key_values.update` that transformers' attention and
decoding.lean_forward call) writes the new tokens into their blocks and gathers each row's blocks
into a padded [B, kv_heads, L, head_dim] tensor, L = the longest sequence in THIS batch, with ONE
index_select per layer (the gather index is built once per forward). The additive mask hides a
row's padding and everything past its own tokens, exactly as for the slot cache. Measured against
the slot cache in docs/kv-memory.md.

Sliding-window layers (Gemma 2/3, Mistral v0.1, Phi-3) need only their window's keys, so their
blocks are a KV cache group of their own (`KVGroup`, vLLM's hybrid allocator): every group keeps a
block table per sequence, a windowed group lets go of the blocks wholly older than its window
(decoding.block_manager), and all groups draw block ids from one allocator. A block id is
memory for one block of `layers_per_block` layers, the same tensors for every group (a group's
layers are laid over the pools' slots), so a block freed by a windowed group serves any group. A
model without windowed layers has one group of all its layers: the pools, tables and arithmetic
are the single-table ones. docs/kv-memory.md has the bound and the prefix-caching rule.

The pool grows by half again up to its budget on CPU (so an idle engine holds little memory, and
at most a third of what it holds is headroom; each growth copies the pool, amortized), and
is allocated whole up front on CUDA (growing there would need twice the memory for a moment).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.decoding.paged_attention import flash_paged_attention, sdpa_over_gathered

DEFAULT_BLOCK_SIZE = 16  # tokens per block (vLLM's default)
GIB = 1 << 30


def kv_bytes_per_token(config, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes one token's keys and values take over all layers: 2 x layers x kv_heads x head_dim x
    element size, from a (text) config alone (GPT-2's n_head / n_embd map onto the same names); on
    one rank of a tensor-parallel group, its kv_heads / tensor_parallel_size heads."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    element = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else torch.iinfo(dtype).bits // 8
    return 2 * int(config.num_hidden_layers) * (kv_heads // tensor_parallel_size) * head_dim * element


@dataclass(frozen=True)
class KVGroup:
    """Layers whose keys and values share block tables: the same attention type (window) and
    `layers_per_block` of them, laid in order over the pools' slots."""

    layers: tuple[int, ...]
    window: int | None   # tokens each query sees (transformers' rule: keys in (q - window, q]); None: all


def kv_groups(windows: Sequence[int | None]) -> tuple[KVGroup, ...]:
    """The KV cache groups of a model whose layer i attends over windows[i] tokens (None: full
    attention). Every group holds the same number of layers, the gcd of each attention type's
    layer count (Gemma 3's 5 windowed layers to 1 global: groups of 1 layer), so one block id is the
    same memory in every group and no slot is wasted; a model with one attention type has one
    group of all its layers (vLLM pads unequal groups instead; the gcd needs no padding)."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    return tuple(KVGroup(tuple(layers[i:i + size]), window) for window, layers in by_window.items()
                 for i in range(0, len(layers), size))


def full_attention(num_layers: int) -> tuple[KVGroup, ...]:
    """The one group of a model without windowed layers."""
    return (KVGroup(tuple(range(num_layers)), None),)


def blocks_before_window(num_tokens: int, window: int, rollback_tokens: int, block_size: int) -> int:
    """Leading blocks of a sequence of num_tokens that a windowed group no longer needs: wholly
    older than the keys a query rollback_tokens behind the end sees (position num_tokens -
    rollback_tokens - window + 1 on). The window applies per query position, so a later call
    starting there, however many tokens it brings, finds all its queries' keys."""
    return max(0, num_tokens - rollback_tokens - window + 1) // block_size


def window_blocks(window: int, block_size: int, rollback_tokens: int, new_tokens: int) -> int:
    """Most blocks a windowed group holds for one sequence: after a forward it keeps the keys a
    query `rollback_tokens` back from the sequence's end still sees (window - 1 before it), and
    during a forward of new_tokens more it holds those too: a span of window - 1 + rollback_tokens
    + new_tokens tokens, over at most one block more than it fills."""
    return blocks_for(window - 1 + rollback_tokens + new_tokens, block_size) + 1


@dataclass(frozen=True)
class KVCapacity:
    """What a KV budget holds, for the start-up log line and the engine's stats."""

    num_blocks: int
    block_size: int
    bytes_per_token: int       # one token's keys and values over ALL layers
    max_model_len: int
    layers_per_block: int      # layers one block id holds (all of them with one KV cache group)
    num_layers: int
    sequence_blocks: int       # block ids one max_model_len sequence takes at most, over every group

    @property
    def tokens(self) -> int:
        """Tokens of every layer's keys and values the budget holds."""
        return self.num_blocks * self.block_size * self.layers_per_block // self.num_layers

    @property
    def gib(self) -> float:
        return self.tokens * self.bytes_per_token / GIB

    @property
    def full_length_sequences(self) -> int:
        """Sequences of max_model_len tokens the pool holds at once (short ones fit many more)."""
        return self.num_blocks // self.sequence_blocks

    def describe(self) -> str:
        groups = "" if self.layers_per_block == self.num_layers else (
            f"; KV cache groups of {self.layers_per_block} layers, sliding-window ones bounded by their window")
        return (f"KV cache: {self.num_blocks:,} blocks of {self.block_size} tokens = {self.tokens:,} tokens, "
                f"{self.gib:.2f} GiB ({self.bytes_per_token:,} bytes a token); up to "
                f"{self.full_length_sequences:,} sequences of max_model_len={self.max_model_len:,}{groups}")


def kv_capacity(config, dtype: torch.dtype, budget_bytes: float, max_model_len: int,
                block_size: int = DEFAULT_BLOCK_SIZE, tensor_parallel_size: int = 1,
                groups: Sequence[KVGroup] | None = None, rollback_tokens: int = 0,
                new_tokens: int = 0) -> KVCapacity:
    """The blocks a budget holds (a rank's budget for its heads, under tensor parallelism). With
    KV cache groups (kv_groups), a max_model_len sequence takes its full length in every full-
    attention group and at most window_blocks(rollback_tokens, new_tokens: the largest forward's
    new tokens a row) in every windowed one, so a windowed model fits more sequences.
    ValueError when it cannot hold one max_model_len sequence (as vLLM refuses to start then):
    lower max_model_len or raise the budget."""
    num_layers = int(config.num_hidden_layers)
    groups = groups or full_attention(num_layers)
    bytes_per_token = kv_bytes_per_token(config, dtype, tensor_parallel_size)
    per_block_layer = bytes_per_token // num_layers * block_size
    layers_per_block = len(groups[0].layers)
    full = blocks_for(max_model_len, block_size)
    sequence_blocks = sum(full if group.window is None else
                          min(full, window_blocks(group.window, block_size, rollback_tokens, new_tokens))
                          for group in groups)
    capacity = KVCapacity(int(budget_bytes // (per_block_layer * layers_per_block)), block_size, bytes_per_token,
                          max_model_len, layers_per_block, num_layers, sequence_blocks)
    if capacity.full_length_sequences < 1:
        raise ValueError(
            f"the KV cache budget of {budget_bytes / GIB:.6g} GiB ({budget_bytes / (1 << 20):.6g} MiB) holds {capacity.tokens:,} tokens "
            f"({bytes_per_token:,} bytes a token), fewer than max_model_len={max_model_len:,}: raise "
            "kv_cache_memory_gb (or gpu_memory_utilization) or lower max_model_len")
    return capacity


def gpu_kv_budget_bytes(total_bytes: int, gpu_memory_utilization: float, device_share: float, in_use_bytes: int,
                        activation_bytes: int) -> int:
    """vLLM's rule, per engine: the engine may use gpu_memory_utilization of ITS share of the device
    (Ray's num_gpus: two engines at 0.5 on one GPU get half each, not 90% each); the KV cache gets
    what is left of that after what this engine holds (in_use_bytes: its own weights, never another
    engine's weights or pool in the same process, which its own share already pays for) and the
    peak activations of the largest step the scheduler can plan (step_peak_bytes, profiled at start)."""
    allowed = int(total_bytes * gpu_memory_utilization * min(1.0, device_share))
    return max(0, allowed - in_use_bytes - activation_bytes)


# Rows x vocabulary float32 tensors alive at once while a step's kept rows are sampled and verified
# (decoding/sampling.py's process_rows and the verify): the float32 logits, their processed copy, a
# sort's values and int64 indices (two) for top-k/top-p, the probabilities and their cumulative sum.
SAMPLER_ROW_COPIES = 7


def step_peak_bytes(forward_peak_bytes: int, kept_rows: int, vocab_size: int) -> int:
    """Device memory at the peak of one planned step beyond its keys and values: the forward's own
    (measured on a throw-away cache) and the sampler's temporaries over the rows it keeps (a verify
    keeps K + 1 rows a sequence, so a batch of B verifies samples B x (K + 1) vocabulary rows)."""
    return forward_peak_bytes + kept_rows * vocab_size * 4 * SAMPLER_ROW_COPIES


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def positions_and_mask(starts: Sequence[int], num_new: Sequence[int], dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(position_ids [B, T], additive mask [B, 1, T, kv_length], kv_length) of a ragged batch.

    Row b holds starts[b] cached tokens and brings num_new[b] >= 1 new ones, right-padded to
    T = max(num_new). Token t of row b sits at position starts[b] + t and sees cache positions
    [0, starts[b] + t]; a padding token (t >= num_new[b]) is treated as a copy of the row's last
    real token, so no query row is ever fully masked (which would give NaN rows) and positions
    stay within the context (GPT-2 looks them up in a position table)."""
    num_columns = max(num_new)
    kv_length = max(start + n for start, n in zip(starts, num_new))
    positions = [[start + min(t, n - 1) for t in range(num_columns)] for start, n in zip(starts, num_new)]
    position_ids = torch.tensor(positions, dtype=torch.long)
    if len(starts) == 1 and num_columns == 1:
        attention_mask = torch.zeros((1, 1, kv_length), dtype=dtype)   # one token sees the whole row
    else:
        hidden = torch.arange(kv_length).view(1, 1, kv_length) > position_ids.unsqueeze(2)   # [B, T, L]
        attention_mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, torch.finfo(dtype).min)
    return position_ids, attention_mask.unsqueeze(1), kv_length


# A windowed group's table entry for a block it has let go of (wholly older than its window):
# never written, read as block 0 and hidden by the window's mask.
NO_BLOCK = -1


@dataclass(frozen=True)
class GroupLayout:
    """Where one KV cache group's tables put a forward's tokens."""

    read_blocks: torch.Tensor      # LongTensor [B, nb]: each row's first nb blocks (padding and NO_BLOCK: block 0)
    write_blocks: torch.Tensor     # LongTensor [N]: the block each real new token goes to
    single_write: tuple[int, int] | None  # (block, offset) when one row's new tokens fit one block: a slice copy


@dataclass(frozen=True)
class PagedLayout:
    """Index tensors of one batched forward, built once and shared by every layer."""

    groups: tuple[GroupLayout, ...]   # one per KV cache group, in the cache's group order
    # One entry per real new token (N = sum of n_b):
    write_offsets: torch.Tensor    # LongTensor [N]: its place in its block
    source_rows: torch.Tensor      # LongTensor [N]: its row b in the batch ...
    source_columns: torch.Tensor   # LongTensor [N]: ... and its column t among the new tokens
    kv_length: int                 # attend over positions [0, kv_length) of each row
    position_ids: torch.Tensor     # LongTensor [B, T]; padding repeats the row's last position
    attention_mask: torch.Tensor   # float [B, 1, T, kv_length]: 0 visible, finfo.min hidden


def paged_layout(group_tables: Sequence[Sequence[Sequence[int]]], starts: Sequence[int], num_new: Sequence[int],
                 block_size: int, dtype: torch.dtype, device: torch.device) -> PagedLayout:
    """Where each row's new tokens go (group_tables[g][b], row b's table in KV cache group g, must
    already cover starts[b] + num_new[b] tokens) and what each of them may see (see
    positions_and_mask)."""
    position_ids, attention_mask, kv_length = positions_and_mask(starts, num_new, dtype)
    num_read = blocks_for(kv_length, block_size)
    first, *others = group_tables
    # (block in the first group, offset, row, column) of each real new token; other groups put it
    # at the same offset of their own block of the same index.
    writes = [(table[position // block_size], position % block_size, b, t)
              for b, (table, start, n) in enumerate(zip(first, starts, num_new))
              for t, position in enumerate(range(start, start + n))]
    write_blocks, write_offsets, source_rows, source_columns = torch.tensor(writes, dtype=torch.long).T.to(device)
    groups = [_group_layout(first, writes[0][:2], writes[-1][0], write_blocks, num_read, device)]
    if others:
        indices = [position // block_size for start, n in zip(starts, num_new) for position in range(start, start + n)]
        rows = [row for _, _, row, _ in writes]
        for tables in others:
            blocks = [tables[b][index] for b, index in zip(rows, indices)]
            groups.append(_group_layout(tables, (blocks[0], writes[0][1]), blocks[-1],
                                        torch.tensor(blocks, dtype=torch.long).to(device), num_read, device))
    return PagedLayout(groups=tuple(groups), write_offsets=write_offsets, source_rows=source_rows,
                       source_columns=source_columns, kv_length=kv_length,
                       position_ids=position_ids.to(device), attention_mask=attention_mask.to(device))


def _readable(blocks: Sequence[int]) -> list[int]:
    """blocks with a windowed group's leading NO_BLOCK run read as block 0 (outside the window:
    masked; flash-attn's window skips them)."""
    if blocks and blocks[0] == NO_BLOCK:
        return [max(block, 0) for block in blocks]
    return list(blocks)


def _group_layout(tables: Sequence[Sequence[int]], first_write: tuple[int, int], last_block: int,
                  write_blocks: torch.Tensor, num_read: int, device: torch.device) -> GroupLayout:
    """One group's read and write blocks (first_write: its first new token's (block, offset);
    last_block: its last new token's block)."""
    read_blocks = [_readable(table[:num_read]) + [0] * (num_read - min(len(table), num_read)) for table in tables]
    # A lone row's decode step or verify usually lands in one block: write it as a slice (the hot
    # path of a single stream), not through the scatter.
    one_block = len(tables) == 1 and first_write[0] == last_block
    return GroupLayout(read_blocks=torch.tensor(read_blocks, dtype=torch.long).to(device), write_blocks=write_blocks,
                       single_write=first_write if one_block else None)


class LayerPools:
    """Keys and values per layer (per slot, when KV cache groups share them), each [units, kv
    heads, unit_len, head size]: the storage of a KV cache whose unit is a block (PagedKVCache).

    A layer's tensors are shaped lazily from the first keys it writes (kv heads and head size
    differ between architectures), so they need no model configuration; `grow` adds units to
    every layer at once."""

    def __init__(self, num_layers: int, unit_len: int, token_major: bool = False) -> None:
        self.unit_len = unit_len
        self.token_major = token_major   # [units, unit_len, kv heads, D]: the layout flash-attn's paged kernel reads
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.capacity = 0  # units every layer has room for so far

    def grow(self, num_units: int) -> range:
        """Room for num_units more units in every layer; -> the new units' ids."""
        old = self.capacity
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            if keys is not None:
                self.keys[layer] = torch.cat([keys, keys.new_zeros((num_units, *keys.shape[1:]))])
                self.values[layer] = torch.cat([values, values.new_zeros((num_units, *values.shape[1:]))])
        self.capacity = old + num_units
        return range(old, self.capacity)

    def layer(self, layer_idx: int, like_keys: torch.Tensor, like_values: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer layer_idx's keys and values, made on first use in like_keys' shape, dtype and device."""
        if self.keys[layer_idx] is None:
            _, kv_heads, _, head_dim = like_keys.shape
            middle = (self.unit_len, kv_heads) if self.token_major else (kv_heads, self.unit_len)
            self.keys[layer_idx] = like_keys.new_zeros((self.capacity, *middle, head_dim))
            self.values[layer_idx] = like_values.new_zeros((self.capacity, *middle, like_values.shape[-1]))
        keys = self.keys[layer_idx]
        heads, head_dim = (keys.shape[2], keys.shape[3]) if self.token_major else (keys.shape[1], keys.shape[3])
        if (heads, head_dim) != (like_keys.shape[1], like_keys.shape[3]):
            # KV cache groups lay several layers over one slot; they must be alike.
            raise ValueError(f"layers laid over pool slot {layer_idx} differ in kv heads x head size: "
                             f"{heads} x {head_dim} and {like_keys.shape[1]} x {like_keys.shape[3]}")
        return keys, self.values[layer_idx]

    def reserved_bytes(self) -> int:
        """Bytes the layers hold now (allocated tensors, used or not)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)


class PagedKVCache:
    """Block pools for every layer: the memory behind the block ids decoding.block_manager hands
    out (the ids, their reference counts and the prefix cache live there, with the scheduler).

    Layer pools are shaped lazily from the first keys a layer writes (kv heads and head size
    differ between architectures); num_blocks comes from the budget (kv_capacity). With several
    KV cache groups (KVGroup) the pools have one slot per layer of a group, and layer l of group g
    reads and writes slot `slot_of[l]` at the blocks of group g's tables."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 device: torch.device | str = "cpu", preallocate: bool | None = None, flash: bool = False,
                 groups: Sequence[KVGroup] | None = None) -> None:
        """flash: pools in flash-attn's layout, read in place by its paged kernel (CUDA only).
        groups: the KV cache groups (kv_groups; default: one full-attention group of num_layers).
        preallocate (default: on CUDA): room for every block now, else as `reserve` asks."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.flash = flash
        self.groups = tuple(groups or full_attention(num_layers))
        # layer -> (its group's index, its slot in the pools)
        self.slot_of = {layer: (g, slot) for g, group in enumerate(self.groups)
                        for slot, layer in enumerate(group.layers)}
        self.pools = LayerPools(len(self.groups[0].layers), block_size, token_major=flash)
        if self.device.type == "cuda" if preallocate is None else preallocate:
            self.reserve(num_blocks)

    @property
    def capacity(self) -> int:
        """Blocks the pools have room for so far."""
        return self.pools.capacity

    def reserve(self, num_blocks: int) -> None:
        """Room for block ids below num_blocks (at most the budget's): a plan's pool_blocks. The
        block manager grows it by half again at a time, so the copies growth makes are amortized."""
        if num_blocks > self.num_blocks:
            raise ValueError(f"a plan asks for {num_blocks} KV blocks, the pool's budget is {self.num_blocks}")
        if num_blocks > self.capacity:
            self.pools.grow(num_blocks - self.capacity)

    @torch.inference_mode()   # the pools are inference tensors (made in the forward)
    def copy_block(self, source: int, destination: int) -> None:
        """Copy-on-write: destination gets source's keys and values in every layer."""
        for pool in self.pools.keys + self.pools.values:
            if pool is not None:
                pool[destination] = pool[source]

    def reserved_bytes(self) -> int:
        """Bytes the pools hold now (allocated tensors, used or not)."""
        return self.pools.reserved_bytes()

    def view(self, layout: PagedLayout) -> PagedBatchView:
        """The object to pass as `past_key_values` for one forward laid out by `layout`."""
        return PagedBatchView(self, layout)


class PagedBatchView:
    """One batched forward's access to the paged cache, handed to every attention layer
    (decoding.paged_attention): `attend` stores the layer's new keys/values in their blocks and
    attends over each row's blocks under the layer's sliding window and soft-cap; `update` is the
    store-and-gather half, which the lean forward uses."""

    def __init__(self, cache: PagedKVCache, layout: PagedLayout) -> None:
        self.cache = cache
        self.layout = layout
        self._gathers: dict[int, torch.Tensor] = {}   # group -> [B * H * nb]: (block, head) rows of a pool, in output order
        self._window_masks: dict[int, torch.Tensor] = {}
        # The layers that came through attend, and each one's window (the start-up check and grouping).
        self.windows: dict[int, int | None] = {}

    def attend(self, layer_idx: int, query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
               scaling: float | None = None, sliding_window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """query [B, H, T, D] and this forward's keys/values [B, kv heads, T, D] -> [B, H, T, D]."""
        self.windows[layer_idx] = sliding_window
        if self.cache.flash:
            keys, values = self._store(key_states, value_states, layer_idx)
            block_table = self.layout.groups[self.cache.slot_of[layer_idx][0]].read_blocks
            return flash_paged_attention(query, keys, values, self.layout, block_table, scaling, sliding_window,
                                         softcap)
        keys, values = self.update(key_states, value_states, layer_idx)
        return sdpa_over_gathered(query, keys, values, self.mask(sliding_window), scaling, softcap)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """The additive mask [B, 1, T, kv_length] of a layer whose window is sliding_window tokens
        (None: full attention). transformers' rule: a query at position q sees keys at positions
        (q - window, q]. Built once per window and forward."""
        layout = self.layout
        if sliding_window is None or sliding_window >= layout.kv_length:
            return layout.attention_mask
        mask = self._window_masks.get(sliding_window)
        if mask is None:
            keys = torch.arange(layout.kv_length, device=layout.position_ids.device).view(1, 1, -1)
            too_old = keys <= layout.position_ids.unsqueeze(2) - sliding_window           # [B, T, L]
            mask = layout.attention_mask.masked_fill(too_old.unsqueeze(1), torch.finfo(layout.attention_mask.dtype).min)
            self._window_masks[sliding_window] = mask
        return mask

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens, then return each row's keys/values gathered: [B, H, kv_length, D]."""
        keys, values = self._store(key_states, value_states, layer_idx)
        group = self.cache.slot_of[layer_idx][0]
        return self._read(keys, group), self._read(values, group)

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the real new tokens [B, H, T, D] to their (block, offset); -> the layer's pools."""
        layout = self.layout
        group, slot = self.cache.slot_of[layer_idx]
        blocks = layout.groups[group]
        keys, values = self.cache.pools.layer(slot, key_states, value_states)
        if self.cache.flash:   # pools [blocks, block_size, H, D]
            rows, columns = layout.source_rows, layout.source_columns
            keys[blocks.write_blocks, layout.write_offsets] = key_states.transpose(1, 2)[rows, columns]
            values[blocks.write_blocks, layout.write_offsets] = value_states.transpose(1, 2)[rows, columns]
        elif blocks.single_write is not None:
            block, offset = blocks.single_write   # one row, no padding, one block
            keys[block, :, offset:offset + key_states.shape[2]] = key_states[0]
            values[block, :, offset:offset + value_states.shape[2]] = value_states[0]
        else:
            # [B, H, T, D] -> [N, H, D] for the real tokens, scattered to (block, offset).
            rows, columns = layout.source_rows, layout.source_columns
            keys[blocks.write_blocks, :, layout.write_offsets] = key_states.transpose(1, 2)[rows, columns]
            values[blocks.write_blocks, :, layout.write_offsets] = value_states.transpose(1, 2)[rows, columns]
        return keys, values

    def _read(self, pool: torch.Tensor, group: int) -> torch.Tensor:
        """Rows' blocks as [B, H, kv_length, D] in one copy: the pool seen as [(block, head), bs, D]
        rows, picked in (row, head, block) order, is already the padded batch tensor."""
        gather = self._gathers.get(group)
        if gather is None:   # once per forward and group: its layers have the same heads and blocks
            num_pool_blocks, heads, block_size, head_dim = pool.shape
            read_blocks = self.layout.groups[group].read_blocks
            batch, num_read = read_blocks.shape
            head = torch.arange(heads, device=pool.device).view(1, heads, 1)
            gather = self._gathers[group] = (read_blocks.unsqueeze(1) * heads + head).reshape(-1)
            self._rows_shape = (-1, block_size, head_dim)
            self._batch_shape = (batch, heads, num_read * block_size, head_dim)
        gathered = pool.view(self._rows_shape).index_select(0, gather).view(self._batch_shape)
        return gathered[:, :, :self.layout.kv_length]
