"""A slot KV cache: one preallocated key/value row per sequence, so ragged sequences share a forward.

Per layer, keys and values live in [slots, kv_heads, max_len, head_dim] tensors, with a length per
slot. A forward over rows (slots s_1..s_B) with right-padded new tokens writes each row's real new
tokens at lengths[s_b] + arange(n_b) and attends over [0, kv_length) through an additive mask that
is causal within the new tokens and hides everything past a row's own tokens. Rollback is setting
a length: stale keys beyond it are never visible (gpt-fast's position-addressed cache, per slot).

Only real tokens are written (padding is never stored), so max_len = the model's context suffices.
Slots are allocated in chunks up to max_slots, so memory tracks the sequences held, each at the full
context: the runner now uses decoding.paged_cache, whose memory tracks the tokens held; this cache
lives in bench/ as the baseline bench.kv_memory measures it against (docs/kv-memory.md).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.decoding.model_runner import NoFreeSlotError
from specserve.decoding.paged_attention import sdpa_over_gathered
from specserve.decoding.paged_cache import LayerPools, positions_and_mask


@dataclass(frozen=True)
class BatchLayout:
    """Index tensors of one batched forward, built once and shared by every layer."""

    slot_ids: torch.Tensor | None  # LongTensor [B] to gather by; None when first_slot is set
    first_slot: int | None         # slots are first_slot + arange(B): read a view, no gather
    single_write: tuple[int, int] | None  # (slot, start) when B == 1: write a slice, no scatter
    # For B > 1 (else None), one entry per real new token (N = sum of n_b):
    write_slots: torch.Tensor | None      # LongTensor [N]: its slot
    write_positions: torch.Tensor | None  # LongTensor [N]: its position in that slot
    source_rows: torch.Tensor | None      # LongTensor [N]: its row b in the batch ...
    source_columns: torch.Tensor | None   # LongTensor [N]: ... and its column t among the new tokens
    kv_length: int                 # attend over cache positions [0, kv_length)
    position_ids: torch.Tensor     # LongTensor [B, T]; padding repeats the row's last position
    attention_mask: torch.Tensor   # float [B, 1, T, kv_length]: 0 visible, finfo.min hidden


def batch_layout(slot_ids: Sequence[int], starts: Sequence[int], num_new: Sequence[int],
                 dtype: torch.dtype, device: torch.device) -> BatchLayout:
    """Where each row's new tokens go and what each of them may see (see positions_and_mask)."""
    # Built from Python lists in a handful of tensor ops: this runs once per forward, on the
    # critical path of every decode step (a lone row skips the scatter and gather indices).
    batch_size = len(slot_ids)
    position_ids, attention_mask, kv_length = positions_and_mask(starts, num_new, dtype)
    first = slot_ids[0]
    contiguous = list(slot_ids) == list(range(first, first + batch_size))
    if batch_size == 1:
        write_slots = write_positions = source_rows = source_columns = None
    else:
        writes = [(slot, start + t, b, t) for b, (slot, start, n) in enumerate(zip(slot_ids, starts, num_new))
                  for t in range(n)]
        write_slots, write_positions, source_rows, source_columns = (
            torch.tensor(writes, dtype=torch.long).T.contiguous().to(device))
    return BatchLayout(
        slot_ids=None if contiguous else torch.tensor(slot_ids, dtype=torch.long).to(device),
        first_slot=first if contiguous else None,
        single_write=(first, starts[0]) if batch_size == 1 else None,
        write_slots=write_slots, write_positions=write_positions,
        source_rows=source_rows, source_columns=source_columns,
        kv_length=kv_length,
        position_ids=position_ids.to(device),
        attention_mask=attention_mask.to(device),
    )


class SlotKVCache:
    """Key/value storage for up to max_slots sequences, grown chunk_slots slots at a time.

    Its storage is decoding.paged_cache.LayerPools with a whole sequence's slot as the unit.
    """

    def __init__(self, num_layers: int, max_len: int, max_slots: int, chunk_slots: int = 8,
                 device: torch.device | str = "cpu") -> None:
        if max_slots < 1 or chunk_slots < 1:
            raise ValueError(f"need max_slots >= 1 and chunk_slots >= 1, got {max_slots}, {chunk_slots}")
        self.max_len = max_len
        self.max_slots = max_slots
        self.chunk_slots = chunk_slots
        self.device = torch.device(device)
        self.pools = LayerPools(num_layers, max_len)
        self.lengths: list[int] = []           # tokens held, per slot (capacity entries)
        self._free: list[int] = []             # min-heap: the lowest free slot is reused first
        self._num_held = 0

    @property
    def capacity(self) -> int:
        """Slots allocated so far (memory is held for these)."""
        return len(self.lengths)

    @property
    def num_free(self) -> int:
        """Slots that can still be handed out, counting those not yet allocated."""
        return self.max_slots - self._num_held

    def allocate(self) -> int:
        """A free slot with length 0. Lowest ids first, so a batch of every held sequence tends
        to be a contiguous range (read as a view, without a gather)."""
        if not self._free:
            if self.capacity >= self.max_slots:
                raise NoFreeSlotError(f"all {self.max_slots} KV slots are held; release a sequence first")
            self._grow(min(self.chunk_slots, self.max_slots - self.capacity))
        slot = heapq.heappop(self._free)
        self.lengths[slot] = 0
        self._num_held += 1
        return slot

    def free(self, slot: int) -> None:
        """Return slot to the pool (its stale keys stay, hidden behind length 0)."""
        self.lengths[slot] = 0
        heapq.heappush(self._free, slot)
        self._num_held -= 1

    def _grow(self, num_slots: int) -> None:
        for slot in self.pools.grow(num_slots):
            self.lengths.append(0)
            heapq.heappush(self._free, slot)

    def view(self, layout: BatchLayout, keep_index: torch.Tensor | None = None) -> SlotBatchView:
        """The object to pass as `past_key_values` for one forward laid out by `layout`
        (keep_index: the flat b * T + t positions that reach the LM head)."""
        return SlotBatchView(self, layout, keep_index)


class SlotBatchView:
    """The slot cache's side of one batched forward, as decoding.paged_cache.PagedBatchView's:
    `update(key_states, value_states, layer_idx)` stores the real new tokens and returns each
    row's keys/values over [0, kv_length); `attend` runs the lean forward's attention over them
    (full attention only: the baseline serves the default pair)."""

    def __init__(self, cache: SlotKVCache, layout: BatchLayout, keep_index: torch.Tensor | None = None) -> None:
        self.cache = cache
        self.layout = layout
        self.keep_index = keep_index

    def attend(self, layer_idx: int, query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
               scaling: float | None = None) -> torch.Tensor:
        keys, values = self.update(key_states, value_states, layer_idx)
        return sdpa_over_gathered(query, keys, values, self.layout.attention_mask, scaling, softcap=None)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.layout
        keys, values = self.cache.pools.layer(layer_idx, key_states, value_states)
        if layout.single_write is not None:
            slot, start = layout.single_write   # one row, no padding: a slice copy
            keys[slot, :, start:start + key_states.shape[2]] = key_states[0]
            values[slot, :, start:start + value_states.shape[2]] = value_states[0]
        else:
            # [B, H, T, D] -> [N, H, D] for the real tokens, scattered to (slot, position).
            rows, columns = layout.source_rows, layout.source_columns
            keys[layout.write_slots, :, layout.write_positions] = key_states.transpose(1, 2)[rows, columns]
            values[layout.write_slots, :, layout.write_positions] = value_states.transpose(1, 2)[rows, columns]
        if layout.first_slot is not None:
            batch = slice(layout.first_slot, layout.first_slot + key_states.shape[0])
            return keys[batch, :, :layout.kv_length], values[batch, :, :layout.kv_length]
        return keys[layout.slot_ids, :, :layout.kv_length], values[layout.slot_ids, :, :layout.kv_length]
