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

Attention reads a sequence's keys through its table. `paged_layout` turns a forward's tables and
row lengths into device tensors once (positions, each new token's slot), and `PagedBatchView` (the
object every layer's attention receives) stores the new tokens in their blocks and attends: inside
the compiled forward with flex_attention reading the blocks in place through a block mask made
from the tables, eagerly by gathering each row's blocks into a padded tensor under a mask built on
the device (decoding.paged_attention; docs/performance.md has the measurements).

Sliding-window layers (Gemma 2/3, Mistral v0.1, Phi-3) need only their window's keys, so their
blocks are a KV cache group of their own (`KVGroup`, vLLM's hybrid allocator): every group keeps a
block table per sequence, a windowed group lets go of the blocks wholly older than its window
(decoding.block_manager), and all groups draw block ids from one allocator. A block id is
memory for one block of `layers_per_block` layers, the same tensors for every group (a group's
layers are laid over the pools' slots), so a block freed by a windowed group serves any group. A
model without windowed layers has one group of all its layers: the pools, tables and arithmetic
are the single-table ones. docs/kv-memory.md has the bound and the prefix-caching rule.

The pool grows by half again up to its budget on CPU, and is allocated whole up front on CUDA
(so an out-of-memory shows at start). On CPU each layer's tensors span the whole budget from
their first write, in anonymous memory the OS commits page by page as blocks are first written
(`zeros_on_demand`), and the pool is a view of its first `capacity` blocks: growing widens the
view, so an idle engine holds little memory and a busy one never stops mid-step to copy its pool
into a larger one.
"""

from __future__ import annotations

import math
import mmap
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.decoding.device_copy import host_to_device
from specserve.decoding.paged_attention import (
    ATTENTION_KERNELS,
    FLEX_KEY_TILE,
    flash_paged_attention,
    flex_block_tables,
    flex_paged_attention,
    sdpa_over_gathered,
)

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
    feature_bytes_per_token: int = 0   # an EAGLE-3 head's target features a block slot also holds

    @property
    def tokens(self) -> int:
        """Tokens of every layer's keys and values the budget holds."""
        return self.num_blocks * self.block_size * self.layers_per_block // self.num_layers

    @property
    def gib(self) -> float:
        return (self.tokens * self.bytes_per_token
                + self.num_blocks * self.block_size * self.feature_bytes_per_token) / GIB

    @property
    def full_length_sequences(self) -> int:
        """Sequences of max_model_len tokens the pool holds at once (short ones fit many more)."""
        return self.num_blocks // self.sequence_blocks

    def describe(self) -> str:
        groups = "" if self.layers_per_block == self.num_layers else (
            f"; KV cache groups of {self.layers_per_block} layers, sliding-window ones bounded by their window")
        features = (f" + {self.feature_bytes_per_token:,} of target features" if self.feature_bytes_per_token
                    else "")
        return (f"KV cache: {self.num_blocks:,} blocks of {self.block_size} tokens = {self.tokens:,} tokens, "
                f"{self.gib:.2f} GiB ({self.bytes_per_token:,} bytes a token{features}); up to "
                f"{self.full_length_sequences:,} sequences of max_model_len={self.max_model_len:,}{groups}")


def kv_capacity(config, dtype: torch.dtype, budget_bytes: float, max_model_len: int,
                block_size: int = DEFAULT_BLOCK_SIZE, tensor_parallel_size: int = 1,
                groups: Sequence[KVGroup] | None = None, rollback_tokens: int = 0,
                new_tokens: int = 0, feature_bytes_per_token: int = 0) -> KVCapacity:
    """The blocks a budget holds (a rank's budget for its heads, under tensor parallelism). With
    KV cache groups (kv_groups), a max_model_len sequence takes its full length in every full-
    attention group and at most window_blocks(rollback_tokens, new_tokens: the largest forward's
    new tokens a row) in every windowed one, so a windowed model fits more sequences.
    feature_bytes_per_token: what each block slot also holds besides keys and values (a target
    serving an EAGLE-3 head keeps its features there: PagedKVCache.store_features).
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
    per_block = per_block_layer * layers_per_block + feature_bytes_per_token * block_size
    capacity = KVCapacity(int(budget_bytes // per_block), block_size, bytes_per_token,
                          max_model_len, layers_per_block, num_layers, sequence_blocks, feature_bytes_per_token)
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
# never written nor visited by the in-place kernels; the gathering reference reads it as block 0,
# hidden by the window's mask.
NO_BLOCK = -1


@dataclass(frozen=True)
class GroupLayout:
    """Where one KV cache group's tables put a forward's tokens (device tensors)."""

    tables: torch.Tensor        # LongTensor [B, nb]: each row's first nb table entries; NO_BLOCK past its own
    write_slots: torch.Tensor   # LongTensor [B * T]: token slot (block * block_size + offset) of each
    #                             (row, column)'s position (a padding column: its row's last token's)


@dataclass(frozen=True)
class PagedLayout:
    """Index tensors of one batched forward, built on the device once and shared by every layer.
    Nothing in it is a host-built mask: what a query sees follows from position_ids and each
    key's position (causal; a layer's window is applied where it attends)."""

    groups: tuple[GroupLayout, ...]   # one per KV cache group, in the cache's group order
    position_ids: torch.Tensor     # LongTensor [B, T]; padding repeats the row's last position
    num_new: torch.Tensor          # LongTensor [B]: real new tokens a row brings
    write_source: torch.Tensor     # LongTensor [B * T]: flat b * T + t' of the token whose keys go to each
    #                                write slot: t' = t for a real token, its row's last real one for padding
    real_tokens: torch.Tensor      # LongTensor [N]: flat index b * T + t of each real new token
    kv_length: int                 # longest row after this forward (host-known: the gathering reference, flash-attn)
    block_size: int
    dtype: torch.dtype             # the model's: the gathering reference's additive mask


def paged_layout(group_tables: Sequence[Sequence[Sequence[int]]], starts: Sequence[int], num_new: Sequence[int],
                 block_size: int, dtype: torch.dtype, device: torch.device) -> PagedLayout:
    """The layout of a forward in which row b holds starts[b] cached tokens and brings num_new[b]
    >= 1 new ones, right-padded to T = max(num_new) (group_tables[g][b], row b's table in KV cache
    group g, must already cover starts[b] + num_new[b] tokens). Token t of row b sits at position
    starts[b] + t; a padding token is treated as a copy of the row's last real token (so no query
    row is ever fully masked, and positions stay within the context), and its slot is rewritten
    with that token's own keys (so every store has the batch's shape, known without a host sync,
    and writes nothing wrong). Every index is computed on the host (numpy: an op over a few hundred
    integers costs less than dispatching a torch op, let alone launching a kernel), packed into one
    buffer and copied to the device once, as vLLM builds its input batch; the layout's tensors are
    views of that copy."""
    num_rows, num_columns, num_groups = len(starts), max(num_new), len(group_tables)
    kv_length = max(start + n for start, n in zip(starts, num_new))
    num_read = blocks_for(kv_length, block_size)
    host_tables = np.array([[list(table[:num_read]) + [NO_BLOCK] * (num_read - min(len(table), num_read))
                             for table in tables] for tables in group_tables], dtype=np.int64).reshape(
        num_groups, num_rows, num_read)
    start, new = np.asarray(starts, dtype=np.int64), np.asarray(num_new, dtype=np.int64)
    last_real = np.minimum(np.arange(num_columns), (new - 1)[:, None])                                  # [B, T]
    write_source = np.arange(num_rows)[:, None] * num_columns + last_real
    position_ids = start[:, None] + last_real                                                           # [B, T]
    real_tokens = np.flatnonzero(np.arange(num_columns) < new[:, None])
    slots = host_tables[:, np.arange(num_rows)[:, None], position_ids // block_size] * block_size + position_ids % block_size
    parts = (host_tables, new, write_source, position_ids, real_tokens, slots)
    packed = host_to_device(torch.from_numpy(np.concatenate([part.reshape(-1) for part in parts])), device)
    tables_on, new_on, source_on, positions_on, real_on, slots_on = packed.split([part.size for part in parts])
    tables_on, slots_on = tables_on.view(num_groups, num_rows, num_read), slots_on.view(num_groups, -1)
    return PagedLayout(groups=tuple(GroupLayout(tables=tables_on[g], write_slots=slots_on[g]) for g in range(num_groups)),
                       position_ids=positions_on.view(num_rows, num_columns), num_new=new_on,
                       write_source=source_on, real_tokens=real_on,
                       kv_length=kv_length, block_size=block_size, dtype=dtype)


# Linux's MAP_NORESERVE (Python's mmap does not name it): no commit charge for the whole mapping up
# front, so a budget beyond the machine's memory maps, and fails only where it is used, as before.
MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0


def zeros_on_demand(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in private anonymous memory: the OS commits its pages when they are
    first written and reads untouched ones as zeros, so it costs address space, not memory, until used."""
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, count * dtype.itemsize),
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(*shape)


class LayerPools:
    """Keys and values per layer (per slot, when KV cache groups share them), each [units, kv
    heads, unit_len, head size]: the storage of a KV cache whose unit is a block (PagedKVCache).

    A layer's tensors are shaped lazily from the first keys it writes (kv heads and head size
    differ between architectures), so they need no model configuration; `grow` adds units to
    every layer at once. Each layer's storage spans max_units from its first write (on CPU as
    `zeros_on_demand`, committed as written; on CUDA the pool is preallocated, so it is all there
    is) and its tensors are views of the first `capacity` units, so growing copies nothing.

    Token-major pools ([units, unit_len, kv heads, D], the paged cache's) are one [tokens, kv
    heads, D] tensor seen flat, which the in-place kernels read and the stores scatter into by
    token slot.

    fixed: the pools hold every unit from the start and never grow (preallocated, as on CUDA).
    Their tensors are then marked as static addresses for torch.compile, as Hugging Face's static
    cache marks its own: the forward writes keys into them in place, and inductor's CUDA graphs
    skip a graph that mutates an input unless that input's address is static (and would otherwise
    copy every input into buffers of their own at each replay)."""

    def __init__(self, num_layers: int, unit_len: int, max_units: int, token_major: bool = False,
                 fixed: bool = False) -> None:
        self.unit_len = unit_len
        self.max_units = max_units
        self.token_major = token_major
        self.fixed = fixed
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self._storage: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # layer -> its keys, values of max_units
        self.capacity = 0  # units every layer has room for so far

    def grow(self, num_units: int) -> range:
        """Room for num_units more units in every layer; -> the new units' ids."""
        old = self.capacity
        self.capacity = old + num_units
        for layer, storage in self._storage.items():
            self.keys[layer], self.values[layer] = self._views(storage)
        return range(old, self.capacity)

    def _views(self, storage: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's keys and values: the first `capacity` units of its storage (static addresses
        for torch.compile where the pools are fixed)."""
        views = tuple(whole[:self.capacity] for whole in storage)
        if self.fixed:
            import torch._dynamo as dynamo   # here: processes that load no model import this module

            for view in views:
                dynamo.mark_static_address(view)
        return views

    def layer(self, layer_idx: int, like_keys: torch.Tensor, like_values: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer layer_idx's keys and values, made on first use in like_keys' shape, dtype and device."""
        if self.keys[layer_idx] is None:
            _, kv_heads, _, head_dim = like_keys.shape
            middle = (self.unit_len, kv_heads) if self.token_major else (kv_heads, self.unit_len)
            shapes = ((*middle, head_dim), (*middle, like_values.shape[-1]))
            self._storage[layer_idx] = tuple(
                zeros_on_demand((self.max_units, *shape), like.dtype) if like.device.type == "cpu"
                else like.new_zeros((self.max_units, *shape)) for shape, like in zip(shapes, (like_keys, like_values)))
            self.keys[layer_idx], self.values[layer_idx] = self._views(self._storage[layer_idx])
        keys = self.keys[layer_idx]
        heads, head_dim = (keys.shape[2], keys.shape[3]) if self.token_major else (keys.shape[1], keys.shape[3])
        if (heads, head_dim) != (like_keys.shape[1], like_keys.shape[3]):
            # KV cache groups lay several layers over one slot; they must be alike.
            raise ValueError(f"layers laid over pool slot {layer_idx} differ in kv heads x head size: "
                             f"{heads} x {head_dim} and {like_keys.shape[1]} x {like_keys.shape[3]}")
        return keys, self.values[layer_idx]

    def reserved_bytes(self) -> int:
        """Bytes of the units the layers have room for now (used or not; on CPU, committed as written)."""
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
                 groups: Sequence[KVGroup] | None = None, feature_size: int = 0) -> None:
        """flash: attention by flash-attn's paged kernel (CUDA only; the pools are token-major, the
        layout it and flex_attention read in place, whatever the kernel).
        groups: the KV cache groups (kv_groups; default: one full-attention group of num_layers).
        preallocate (default: on CUDA): room for every block now, else as `reserve` asks.
        feature_size: a target serving an EAGLE-3 head keeps each token's features (its aux
        layers' inputs, this wide) in its slot of a full-attention group (`store_features`)."""
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
        preallocated = self.device.type == "cuda" if preallocate is None else preallocate
        self.pools = LayerPools(len(self.groups[0].layers), block_size, num_blocks, token_major=True,
                                fixed=preallocated)
        self.feature_size = feature_size
        self.feature_group = next((g for g, group in enumerate(self.groups) if group.window is None), None)
        if feature_size and self.feature_group is None:
            raise ValueError("target features are kept in a full-attention layer group's blocks; "
                             "every layer of this model has a sliding window")
        self._features: torch.Tensor | None = None   # [num_blocks * block_size, feature_size], made on first write
        if preallocated:
            self.reserve(num_blocks)

    @property
    def capacity(self) -> int:
        """Blocks the pools have room for so far."""
        return self.pools.capacity

    @torch.inference_mode()   # the pools are inference tensors, wherever they grow
    def reserve(self, num_blocks: int) -> None:
        """Room for block ids below num_blocks (at most the budget's): a plan's pool_blocks. The
        block manager grows it by half again at a time, so the copies growth makes are amortized."""
        if num_blocks > self.num_blocks:
            raise ValueError(f"a plan asks for {num_blocks} KV blocks, the pool's budget is {self.num_blocks}")
        if num_blocks > self.capacity:
            self.pools.grow(num_blocks - self.capacity)

    @torch.inference_mode()   # the pools are inference tensors (made in the forward)
    def copy_block(self, source: int, destination: int) -> None:
        """Copy-on-write: destination gets source's keys and values in every layer (and features)."""
        for pool in self.pools.keys + self.pools.values:
            if pool is not None:
                pool[destination] = pool[source]
        if self._features is not None:
            size = self.block_size
            self._features[destination * size:(destination + 1) * size] = self._features[source * size:(source + 1) * size]

    def reserved_bytes(self) -> int:
        """Bytes the pools hold now (allocated tensors, used or not)."""
        features = 0 if self._features is None else \
            self.capacity * self.block_size * self.feature_size * self._features.element_size()
        return self.pools.reserved_bytes() + features

    @torch.inference_mode()
    def store_features(self, layout: PagedLayout, features: torch.Tensor) -> None:
        """A forward's features [B * T, feature_size] (flat over its rows and columns) written to
        their tokens' slots, as its keys are (`PagedBatchView._store`): a block holds its tokens'
        features as long as their keys, so a prefix-cache hit or a crop finds them there.
        Why in the pool: a target's prefix-cache hit computes no features for the positions it
        reuses, and the head needs every position's (docs/eagle3.md#the-targets-features)."""
        if self._features is None:
            shape = (self.num_blocks * self.block_size, self.feature_size)
            self._features = zeros_on_demand(shape, features.dtype) if features.device.type == "cpu" \
                else features.new_zeros(shape)
        slots = layout.groups[self.feature_group].write_slots
        self._features[slots] = features.index_select(0, layout.write_source)

    def read_features(self, table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """The features of positions start..end-1 of the sequence whose table (in the
        feature_group) is `table` [end - start, feature_size]: written by the forwards that
        computed them (this sequence's, or the one whose blocks its prefix shares)."""
        if self._features is None:
            raise ValueError("no features were stored in this cache (a runner without aux_layers?)")
        positions = np.arange(start, end)
        slots = np.asarray(table, dtype=np.int64)[positions // self.block_size] * self.block_size \
            + positions % self.block_size
        return self._features.index_select(0, host_to_device(torch.from_numpy(slots), self._features.device))

    def view(self, layout: PagedLayout, keep_index: torch.Tensor | None = None, kernel: str = "gather"
             ) -> PagedBatchView:
        """The paged cache's side of one forward laid out by `layout` (PagedBatchView: its kernel,
        and keep_index, the positions that reach the LM head)."""
        return PagedBatchView(self, layout, keep_index, kernel)


class PagedBatchView:
    """One batched forward's access to the paged cache, handed to every attention layer
    (decoding.paged_attention, decoding.lean_forward): `attend` stores the layer's new keys/values
    in their blocks and attends over each row's blocks under the layer's sliding window and
    soft-cap, with the view's kernel:

    - "flex": PyTorch's flex_attention reads the blocks in place through a block mask made from the
      block tables (decoding.paged_attention.flex_paged_attention); nothing is gathered. It runs
      inside the compiled forward (Triton on CUDA, C++ on CPU); uncompiled, flex_attention is a
      dense reference over the whole pool, so an eager forward does not use it.
    - "gather": each row's blocks are gathered into a padded tensor and SDPA runs under a mask
      built on the device: the eager forward's kernel and the tests' reference.
    - "flash": flash-attn's varlen kernel reads the blocks in place (CUDA, when it is installed).

    Whatever the kernel needs is built here, once per forward, on the device; attend itself reads
    no host value, so a compiled forward does not break or wait on the host. keep_index: the flat
    (b * T + t) positions whose hidden states reach the LM head, in order."""

    def __init__(self, cache: PagedKVCache, layout: PagedLayout, keep_index: torch.Tensor | None = None,
                 kernel: str = "gather") -> None:
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}: one of {', '.join(ATTENTION_KERNELS)}")
        self.cache = cache
        self.layout = layout
        self.keep_index = keep_index
        self.kernel = "flash" if cache.flash else kernel
        # The layers that came through attend, and each one's window (the start-up check and grouping).
        self.windows: dict[int, int | None] = {}
        self._masks: dict[int | None, torch.Tensor] = {}
        if self.kernel == "flex":
            if cache.device.type == "cuda" and cache.block_size % FLEX_KEY_TILE:
                raise ValueError(f"flex_attention on CUDA reads keys in tiles of {FLEX_KEY_TILE} tokens: "
                                 f"block_size {cache.block_size} must be a multiple of it")
            self._flex_tables = [flex_block_tables(group.tables, cache.pools.capacity, cache.block_size)
                                 for group in layout.groups]
        # Each group's blocks as `_read` gathers them, built at its first read in this forward
        # rather than for every layer's keys and values.
        self._read_blocks: dict[int, torch.Tensor] = {}

    def attend(self, layer_idx: int, query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
               scaling: float | None = None, sliding_window: int | None = None,
               softcap: float | None = None, query_per_kv: int | None = None) -> torch.Tensor:
        """query [B, H, T, D] and this forward's keys/values [B, kv heads, T, D] -> [B, H, T, D].
        query_per_kv: H over the kv heads, where the caller knows it as a number (a transformers
        attention module's num_key_value_groups)."""
        self.windows[layer_idx] = sliding_window
        group = self.cache.slot_of[layer_idx][0]
        keys, values = self._store(key_states, value_states, layer_idx)
        if self.kernel == "flex":
            if query_per_kv is not None:
                # transformers' attention infers its head count (`view(..., -1, head_dim)`), which a
                # compiled forward may hold as an expression of the step's sizes, and flex_attention's
                # CUDA lowering takes only numbers where it asks whether the query heads per kv head
                # are a power of two (docs/gpu.md): the pool's kv heads (a number where the pools are
                # fixed, as on CUDA) times the module's groups say it.
                query = query.reshape(query.shape[0], keys.shape[2] * query_per_kv, query.shape[2], query.shape[3])
            return flex_paged_attention(query, keys, values, self.layout.groups[group].tables, self._flex_tables[group],
                                        self.layout.position_ids,
                                        self.layout.block_size, scaling, sliding_window, softcap)
        if self.kernel == "flash":
            return flash_paged_attention(query, keys, values, self.layout, self.layout.groups[group].tables,
                                         scaling, sliding_window, softcap)
        return sdpa_over_gathered(query, self._read(keys, group), self._read(values, group), self.mask(sliding_window),
                                  scaling, softcap)

    def mask(self, sliding_window: int | None) -> torch.Tensor | None:
        """The gathering reference's additive mask [B, 1, T, kv_length] of a layer whose window is
        sliding_window tokens (None: full attention), built on the device from the positions:
        transformers' rule, a query at position q sees keys at positions (q - window, q]. Built
        once per window and forward. None where it would hide nothing: a lone row's one new token
        under full attention sees every key gathered for it (a draft's or a decode's step)."""
        if sliding_window is None and self.layout.position_ids.shape == (1, 1):
            return None
        mask = self._masks.get(sliding_window)
        if mask is None:
            layout = self.layout
            queries = layout.position_ids.unsqueeze(2)                                          # [B, T, 1]
            keys = torch.arange(layout.kv_length, device=queries.device).view(1, 1, -1)      # [1, 1, L]
            hidden = keys > queries
            if sliding_window is not None:
                hidden |= keys <= queries - sliding_window
            dtype = layout.dtype
            mask = torch.zeros(hidden.shape, dtype=dtype, device=queries.device).masked_fill_(
                hidden, torch.finfo(dtype).min).unsqueeze(1)
            self._masks[sliding_window] = mask
        return mask

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens, then return each row's keys/values gathered: [B, H, kv_length, D]."""
        keys, values = self._store(key_states, value_states, layer_idx)
        group = self.cache.slot_of[layer_idx][0]
        return self._read(keys, group), self._read(values, group)

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens of [B, H, T, D] to their token slots in one scatter per pool (a
        padding column's slot gets its row's last real token again: the same keys, so the
        repeated index writes one value); -> the layer's pools [units, block_size, H, D]."""
        group, slot = self.cache.slot_of[layer_idx]
        keys, values = self.cache.pools.layer(slot, key_states, value_states)
        slots, source = self.layout.groups[group].write_slots, self.layout.write_source
        for pool, states in ((keys, key_states), (values, value_states)):
            heads, width = states.shape[1], states.shape[3]
            pool.view(-1, heads, width)[slots] = states.transpose(1, 2).reshape(-1, heads, width).index_select(0, source)
        return keys, values

    def _read(self, pool: torch.Tensor, group: int) -> torch.Tensor:
        """Rows' blocks as [B, H, kv_length, D] in one copy (NO_BLOCK and padding read block 0,
        which the mask hides)."""
        batch, num_read = self.layout.groups[group].tables.shape
        _, block_size, heads, head_dim = pool.shape
        blocks = self._read_blocks.get(group)
        if blocks is None:
            blocks = self._read_blocks[group] = self.layout.groups[group].tables.clamp_min(0).reshape(-1)
        gathered = pool.index_select(0, blocks)
        return gathered.view(batch, num_read * block_size, heads, head_dim)[:, :self.layout.kv_length].transpose(1, 2)
