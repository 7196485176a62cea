"""The engines' model runner: many sequences in ONE forward, over a paged KV cache, for any decoder.

Full-history protocol (each call names the whole history; the runner reuses the longest cached
prefix, crops the rest and computes the remainder; with prefix caching that prefix may come from
blocks other sequences computed, see `_reuse`); `forward_batch` runs every call's remainder
together: right-padded input ids, per-row position ids and a boolean `logits_to_keep`, keys and
values in blocks of a budgeted pool (decoding.paged_cache), so only the rows asked for reach the
LM head. The model runs its own forward, whatever its architecture (q/k norms, fused projections,
MoE, soft-capping, sliding windows per layer): its attention is decoding.paged_attention's,
registered in transformers' AttentionInterface, as vLLM's Transformers backend does. For
full-attention Llama-shaped models decoding.lean_forward runs the same attention with less Python
per step (docs/performance.md has the measurement that keeps it).

A model this path cannot serve (encoder-decoder, a layer that does not attend through the
interface, e.g. recurrent or linear attention) is refused at load with UnsupportedModelError
naming what is unsupported; there is no slower fallback.

Sliding-window layers are KV cache groups of their own (decoding.paged_cache.KVGroup, read from the
window each layer passes to the attention in a probe forward at load): a sequence has a block table
per group, and after each forward a windowed group lets go of the blocks wholly older than what a
query `rollback_tokens` behind the sequence's end still sees, so its memory is bounded by its window
while a full-attention group's grows with the context (`_let_go_outside_windows`).
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from specserve.decoding.model_runner import (
    ForwardCall,
    NoFreeSlotError,
    RunnerBase,
    SequenceStateError,
    _common_prefix_length,
    load_causal_lm,
    model_path_of,
)
from specserve.decoding.compiled_forward import CompiledForward, graph_batch_size, pad_rows
from specserve.decoding.lean_forward import LeanDecoder, lean_support
from specserve.decoding.checkpoint import resolve_device
from specserve.decoding.tensor_parallel import TensorParallelRank, agreed_minimum, in_group, join_group, weight_bytes
from specserve.decoding.paged_attention import ATTENTION_NAME, FLASH_BLOCK_SIZE, PagedAttentionError, flash_kernel_available
from specserve.decoding.paged_attention import register as register_paged_attention
from specserve.decoding.paged_cache import (
    DEFAULT_BLOCK_SIZE,
    GIB,
    KVCapacity,
    NO_BLOCK,
    KVGroup,
    NoFreeBlocksError,
    PagedKVCache,
    block_key,
    blocks_before_window,
    blocks_for,
    gpu_kv_budget_bytes,
    kv_capacity,
    kv_groups,
    paged_layout,
    salt_hash,
)

__all__ = ["BatchedModelRunner", "ForwardCall", "NoFreeBlocksError", "NoFreeSlotError", "SequenceStateError",
           "UnsupportedModelError", "decoder_support", "load_runner", "runner_for_model"]

logger = logging.getLogger(__name__)
# KV budget per engine on CPU when none is given: vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE). The
# pool grows with use, so an engine holding few tokens holds little of it.
DEFAULT_KV_CACHE_MEMORY_GB = 4.0
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
# The largest forwards an engine plans with the default batching settings: a step batch of
# max_batch_rows rows of up to max_step_tokens, and one prefill chunk of prefill_token_budget.
DEFAULT_PROFILE_BATCHES = ((64, 16), (1, 256))
# How far back from its end a later call may crop a sequence and still find its windowed layers'
# keys (the engine's max_step_tokens default: a verify step's speculative tail); deeper, it recomputes.
DEFAULT_ROLLBACK_TOKENS = 16
# The (rows, new tokens a row) the compiled forward is traced for at start: a single stream's
# decode step and longer step (verify, prefill), and a batch's; shapes of 1 specialize in
# flex_attention and the stores, so each traces apart (decoding.compiled_forward).
WARM_UP_SHAPES = ((1, 1), (1, 2), (2, 1), (2, 2))


class UnsupportedModelError(ValueError):
    """The model is not a decoder whose every layer attends through transformers' attention
    interface, so the paged engine cannot serve it (raised at load, naming what is unsupported)."""


@dataclass
class _PagedSequence:
    # Its block table per KV cache group: token i lives in tables[g][i // block_size]; in a
    # windowed group, a leading run of NO_BLOCK for the blocks it let go of (outside its window).
    tables: list[list[int]]
    token_ids: list[int]  # exactly the tokens whose keys/values the blocks hold
    # With prefix caching: the chained hash of each full block of token_ids (paged_cache.block_key).
    hashes: list[int] = field(default_factory=list)
    cached_tokens: int = 0   # tokens it has found in the prefix cache (at admission, or a later chunk's)


@dataclass
class _Reuse:
    """How one call of a batch starts: from `start` tokens already in its table, after sharing
    `hits` (cached blocks found for the tokens after what it held)."""

    start: int
    hits: list[tuple[tuple[int, ...], int]]   # (the block of every group, their chained hash), in table order
    new: bool                     # the runner admits the sequence with this call
    looked_up: int = 0            # tokens it looked for in the prefix cache (from its first not fully held block)


class BatchedModelRunner(RunnerBase):
    """Owns one model and a paged KV cache; `forward_batch` serves many sequences per forward."""

    def _init_from_model(self, model, max_sequences: int, model_path: str, lean: bool = True,
                         max_model_len: int | None = None, kv_cache_memory_gb: float | None = None,
                         gpu_memory_utilization: float | None = None,
                         block_size: int = DEFAULT_BLOCK_SIZE, gpu_share: float = 1.0,
                         profile_batches: Sequence[tuple[int, int]] = DEFAULT_PROFILE_BATCHES,
                         prefix_caching: bool = True, cache_salt: str | None = None,
                         rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS, enforce_eager: bool = False) -> None:
        """enforce_eager: run the forward uncompiled (so does every runner of a process where
        SPECSERVE_ENFORCE_EAGER=1; decoding.compiled_forward).
        lean: run decoding.lean_forward where the architecture has one (else transformers' forward).
        max_model_len: longest sequence served (default: the model's max_position_embeddings).
        kv_cache_memory_gb: the KV budget on CPU; on CUDA, gpu_memory_utilization of the engine's
        gpu_share of the device, less the weights and the peak activations of the largest forwards
        (profile_batches: (rows, new tokens) the scheduler can plan) decide it (gpu_kv_budget_bytes),
        as vLLM's two settings do.
        prefix_caching: full blocks stay findable by their tokens after their sequence lets go of
        them, and a sequence starts from the longest cached prefix (docs/kv-memory.md).
        cache_salt: what besides the tokens decides the keys and values (default: model_path; a
        draft engine adds the version it serves), the root of every block's hash chain.
        rollback_tokens: how far back from its end a later call may crop a sequence and still find
        its sliding-window layers' keys (the engine's max_step_tokens); a deeper crop recomputes."""
        supported, reason = decoder_support(model)
        if not supported:
            raise UnsupportedModelError(f"{model_path}: specserve's engine cannot serve this model: {reason}")
        super()._init_from_model(model, max_sequences, model_path, max_model_len)
        register_paged_attention()
        try:
            model.set_attn_implementation(ATTENTION_NAME)
        except (ValueError, KeyError) as error:   # transformers refuses a custom attention for it
            raise UnsupportedModelError(f"{model_path}: its attention cannot be replaced: {error}") from error
        self._dtype = next(model.parameters()).dtype
        flash = flash_kernel_available(self.device)
        if flash:
            block_size = FLASH_BLOCK_SIZE
        elif self.device.type == "cuda":
            logger.warning("%s: flash-attn with a paged kernel is not installed: attention gathers each sequence's "
                           "blocks per layer (the CPU path); install flash-attn for the paged kernel", model_path)
        self.lean = LeanDecoder(model) if lean and lean_support(model)[0] else None
        decoder = model.get_decoder()
        if self.lean is None and not getattr(decoder, "_specserve_keeps_rows", False):
            # The model's own forward: its decoder's output narrowed to the kept rows (once per model).
            decoder.register_forward_hook(_keep_rows, with_kwargs=True)
            decoder._specserve_keeps_rows = True
        self.step_forward = CompiledForward(self._model_logits, self.device, enforce_eager)
        # One rank of a tensor-parallel group (decoding.tensor_parallel): its pool holds its heads.
        self.tensor_parallel_size = int(getattr(model, "tp_size", None) or 1)
        self.rollback_tokens = rollback_tokens
        groups = kv_groups(self._layer_windows(block_size, flash))
        if self.device.type == "cuda":
            budget = gpu_kv_budget_bytes(torch.cuda.get_device_properties(self.device).total_memory,
                                         gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION, gpu_share,
                                         torch.cuda.memory_allocated(self.device),
                                         max(self._peak_activation_bytes(rows, tokens, block_size, flash, groups)
                                             for rows, tokens in profile_batches))
        else:
            budget = (kv_cache_memory_gb or DEFAULT_KV_CACHE_MEMORY_GB) * GIB
        self.kv_capacity: KVCapacity = kv_capacity(
            self.config, self._dtype, budget, self.max_context, block_size, self.tensor_parallel_size, groups,
            rollback_tokens, new_tokens=max(tokens for _, tokens in profile_batches))
        if self.tensor_parallel_size > 1:   # every rank's pool must hold the same blocks
            self.kv_capacity = replace(self.kv_capacity, num_blocks=agreed_minimum(self.kv_capacity.num_blocks))
        self.cache = PagedKVCache(num_layers=self.config.num_hidden_layers, num_blocks=self.kv_capacity.num_blocks,
                                  block_size=block_size, device=self.device, flash=flash, groups=groups)
        self._sequences: dict[str, _PagedSequence] = {}
        # (index, window) of the windowed KV cache groups: none for a model without windows.
        self._windows = [(index, group.window) for index, group in enumerate(groups) if group.window is not None]
        self.prefix_caching = prefix_caching
        self._salt = salt_hash(cache_salt or model_path)
        # vLLM's counters: tokens calls looked for in the prefix cache (all a new sequence's but the
        # rows it asks for; a held one's past what it holds, when it recomputes any), and found there.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.last_num_new_tokens = 0   # tokens the last forward computed
        # A forward over the cache shapes every pool: on CUDA the whole budget is allocated here,
        # so an out-of-memory shows at start, not on the first request. Then the forward is
        # compiled (over shaped pools: a graph traced before them would not be reused).
        self._dummy_forward(self.cache, rows=1, tokens=1, eager=True)
        self.step_forward.warm_up(lambda: [self._dummy_forward(self.cache, rows, tokens)
                                           for rows, tokens in WARM_UP_SHAPES], model_path)

    def _peak_activation_bytes(self, rows: int, tokens: int, block_size: int, flash: bool,
                               groups: Sequence[KVGroup]) -> int:
        """CUDA only (never run here: no GPU): device memory a forward of rows x tokens new tokens
        takes beyond its keys and values, measured on a throw-away cache, as vLLM profiles a dummy
        batch before sizing its KV cache."""
        scratch = PagedKVCache(num_layers=self.config.num_hidden_layers,
                               num_blocks=len(groups) * rows * blocks_for(tokens, block_size), block_size=block_size,
                               device=self.device, flash=flash, groups=groups)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._dummy_forward(scratch, rows, tokens)
        peak = torch.cuda.max_memory_allocated(self.device) - before - scratch.reserved_bytes()
        del scratch
        torch.cuda.empty_cache()
        return max(0, peak)

    def _layer_windows(self, block_size: int, flash: bool) -> list[int | None]:
        """One 1-token forward at load over a one-block scratch cache: every layer must have stored
        its keys through the paged attention, else the model keeps state of its own (recurrent or
        linear-attention layers) that rollback and batching would silently get wrong; -> the
        sliding window each layer passed (None: full attention, as is a window the context never
        outgrows), which decides the KV cache groups. Read from the forward, not the config: every
        architecture names its windows its own way, and this is what attention will be asked."""
        num_layers = self.config.num_hidden_layers
        probe = PagedKVCache(num_layers=num_layers, num_blocks=1, block_size=block_size, device=self.device,
                             flash=flash)
        try:
            view = self._dummy_forward(probe, rows=1, tokens=1, eager=True)
        except PagedAttentionError as error:
            raise UnsupportedModelError(f"{self.model_path}: {error}") from error
        missing = sorted(set(range(num_layers)) - view.windows.keys())
        if missing:
            raise UnsupportedModelError(
                f"{self.model_path}: layers {missing} of {num_layers} do not attend through "
                "transformers' attention interface (recurrent or linear-attention layers?); specserve's engine "
                "cannot serve this model")
        return [None if window is None or window >= self.max_context else int(window)
                for window in (view.windows[layer] for layer in range(num_layers))]

    def _dummy_forward(self, cache: PagedKVCache, rows: int, tokens: int, eager: bool = False):
        """One forward of rows new sequences of `tokens` tokens over blocks of `cache`, given back
        after (eager: without compiling); -> its PagedBatchView (which layers attended through it)."""
        tables = [[cache.allocate(blocks_for(tokens, cache.block_size)) for _ in range(rows)] for _ in cache.groups]
        try:
            layout = paged_layout(tables, [0] * rows, [tokens] * rows, cache.block_size, dtype=self._dtype,
                                  device=self.device)
            keep_index = torch.arange(rows, device=self.device) * tokens + tokens - 1
            kernel = "gather" if eager else self.step_forward.attention_kernel
            view = cache.view(layout, keep_index, kernel)
            input_ids = torch.zeros((rows, tokens), dtype=torch.long, device=self.device)
            if eager:
                with torch.inference_mode():
                    self._model_logits(input_ids, view)
            else:
                self._logits(input_ids, layout, keep_index, view)
        finally:
            cache.free([block for group in tables for table in group for block in table])
        return view

    def forward(self, seq_id: str, token_ids: Sequence[int], num_rows: int = 1) -> torch.Tensor:
        """Make seq_id's cache hold exactly token_ids; return float32 logits [num_rows, V] for the
        last num_rows positions (see ModelRunner.forward)."""
        return self.forward_batch([ForwardCall(seq_id, token_ids, num_rows)])[0]

    def forward_batch(self, calls: Sequence[ForwardCall]) -> list[torch.Tensor]:
        """One model forward for every call (distinct seq_ids); result i is float32
        [calls[i].num_rows, V], as `forward` would give it alone (up to float rounding).

        The whole batch is checked before anything changes: ValueError on a repeated seq_id,
        SequenceStateError on a bad call, NoFreeSlotError when the new seq_ids do not fit."""
        if not calls:
            return []
        histories = self._checked_batch(calls)
        held = [self._sequences.get(call.seq_id) for call in calls]
        reuses = [self._reuse(history, call.num_rows, entry) for call, history, entry in zip(calls, histories, held)]
        entries = self._take_blocks(calls, histories, held, reuses)
        starts = [reuse.start for reuse in reuses]
        num_new = [len(history) - start for history, start in zip(histories, starts)]
        self.last_num_new_tokens = sum(num_new)   # what this forward computes (engines' cost samples)
        new_seq_ids = [call.seq_id for call, reuse in zip(calls, reuses) if reuse.new]

        layout = paged_layout([[entry.tables[g] for entry in entries] for g in range(len(self.cache.groups))],
                              starts, num_new, self.block_size, dtype=self._dtype, device=self.device)
        num_columns = max(num_new)
        # Padding id 0 is never stored nor seen by a real token; its rows are not kept.
        input_ids = torch.tensor([history[start:] + [0] * (num_columns - n)
                                  for history, start, n in zip(histories, starts, num_new)], dtype=torch.long)
        keep_index = torch.tensor([b * num_columns + t for b, (call, n) in enumerate(zip(calls, num_new))
                                   for t in range(n - call.num_rows, n)], dtype=torch.long)
        try:
            logits = self._logits(input_ids.to(self.device), layout, keep_index.to(self.device))
        except BaseException:
            # Tokens past a sequence's reused prefix are never read, so the held sequences stay
            # valid once cropped back to it; the sequences this batch admitted are given back.
            for entry, start in zip(entries, starts):
                self._crop(entry, start)
            for seq_id in new_seq_ids:
                self.release(seq_id)
            raise
        for entry, history in zip(entries, histories):
            entry.token_ids = history
            if self.prefix_caching:
                self._publish_full_blocks(entry)
            self._let_go_outside_windows(entry)
        # keep_index lists the kept rows in (row, column) order.
        logits = self._served_columns(logits.float())
        offsets = [0]
        for call in calls:
            offsets.append(offsets[-1] + call.num_rows)
        return [logits[offsets[i]:offsets[i + 1]] for i in range(len(calls))]

    @torch.inference_mode()
    def _logits(self, input_ids: torch.Tensor, layout, keep_index: torch.Tensor, view=None) -> torch.Tensor:
        """The model's logits for the kept positions (keep_index: flat b * T + t), in that
        order: [kept, V]; compiled unless enforce_eager (decoding.compiled_forward)."""
        if view is None:
            rows = None if self.step_forward.eager or self.device.type != "cuda" else graph_batch_size(input_ids.shape[0])
            if rows is not None:   # a rung of the CUDA-graph ladder
                input_ids, layout = pad_rows(input_ids, layout, rows)
            view = self.cache.view(layout, keep_index, self.step_forward.attention_kernel)
        return self.step_forward(input_ids, view)

    def _model_logits(self, input_ids: torch.Tensor, view) -> torch.Tensor:
        """The forward that is compiled: the lean forward, or the model's own. The model keeps no
        cache of its own (use_cache=False): its attention stores keys and values in the paged view
        it receives as a keyword (decoding.paged_attention), and its decoder's output is narrowed
        to the kept positions before the LM head (`_keep_rows`)."""
        if self.lean is not None:
            return self.lean.forward(input_ids, view.layout.position_ids, view)
        return self.model(input_ids=input_ids, position_ids=view.layout.position_ids, use_cache=False,
                          logits_to_keep=0, paged_batch=view).logits[0]

    def _reuse(self, history: list[int], num_rows: int, entry: _PagedSequence | None) -> _Reuse:
        """Where a call starts: the longest prefix of history its own table holds (cropping the
        rest: a rollback), extended by cached blocks that hold the next full blocks of history.
        Only the crop changes state (as a rollback, it is valid whatever follows); num_rows
        positions are always recomputed."""
        limit = len(history) - num_rows
        held, hits = self._reusable(history, limit, entry)
        if entry is not None:
            self._crop(entry, held)
        aligned = held // self.block_size * self.block_size
        looked_up = limit - aligned if self.prefix_caching and held < limit else 0
        if not hits:
            return _Reuse(held, [], entry is None, looked_up)
        if entry is not None:
            self._crop(entry, aligned)   # its partly valid last block gives way to a cached full one
        return _Reuse(aligned + len(hits) * self.block_size, hits, entry is None, looked_up)

    def _reusable(self, history: list[int], limit: int, entry: _PagedSequence | None
                  ) -> tuple[int, list[tuple[tuple[int, ...], int]]]:
        """(tokens of history's first limit that entry holds and a call can start from, the cached
        blocks extending them from the last full block they fill: none when there are none, or when
        a windowed group could not start there). Changes nothing: `_reuse` takes it, and the
        scheduler plans from it (`cached_prefix_length`)."""
        held = 0 if entry is None else self._servable(entry, _common_prefix_length(entry.token_ids, history, limit))
        hits = self._cached_blocks(history, held, limit, [] if entry is None else entry.hashes)
        aligned = held // self.block_size * self.block_size
        if hits and entry is not None and self._servable(entry, aligned) < aligned:
            return held, []
        return held, hits

    def _cached_blocks(self, history: list[int], held: int, limit: int, hashes: list[int]
                       ) -> list[tuple[tuple[int, ...], int]]:
        """(every group's block, chained hash) of the cached blocks holding history's full blocks
        after the first held tokens, up to the first one some group has not cached, within the first
        limit tokens (hashes: those of the held full blocks). A windowed group must still have the
        block too, even one outside the window of the hit's end (it is let go again after the
        forward): the simplest rule that is right, at the cost of hits vLLM's would find."""
        if not self.prefix_caching:
            return []
        size = self.block_size
        first = held // size
        parent = hashes[first - 1] if first else self._salt
        hits = []
        for index in range(first, limit // size):
            key = block_key(parent, history[index * size:(index + 1) * size])
            blocks = tuple(self.cache.find((group, key)) for group in range(len(self.cache.groups)))
            if None in blocks:
                break
            parent = hash(key)
            hits.append((blocks, parent))
        return hits

    def _take_blocks(self, calls: Sequence[ForwardCall], histories: list[list[int]],
                     held: list[_PagedSequence | None], reuses: list[_Reuse]) -> list[_PagedSequence]:
        """Every call's table made to cover its history: cached blocks shared, a shared or
        published last block the call writes into copied or unpublished, new blocks allocated.
        NoFreeBlocksError, admitting nothing and taking no block, when the pool cannot cover them."""
        size, num_groups = self.block_size, len(self.cache.groups)
        writes_into_last = [reuse.start % size != 0 for reuse in reuses]   # then it is held and hit nothing
        shares = Counter(block for reuse in reuses for blocks, _ in reuse.hits for block in blocks)
        copies = sum(self.cache.refs(table[-1]) + shares[table[-1]] > 1
                     for entry, partial in zip(held, writes_into_last) if partial for table in entry.tables)
        needed = copies + sum(num_groups * (blocks_for(len(history), size) - len(reuse.hits))
                              - (0 if entry is None else sum(len(table) for table in entry.tables))
                              for history, entry, reuse in zip(histories, held, reuses))
        revived = len({block for reuse in reuses for blocks, _ in reuse.hits for block in blocks
                       if self.cache.refs(block) == 0})
        if needed + revived > self.cache.num_free:
            raise NoFreeBlocksError(f"this batch needs {needed + revived} more KV blocks, {self.cache.num_free} of "
                                    f"{self.cache.num_blocks} are free; wait for sequences to finish")
        entries = []
        for call, history, entry, reuse in zip(calls, histories, held, reuses):
            if entry is None:
                entry = self._sequences[call.seq_id] = _PagedSequence([[] for _ in range(num_groups)], [])
            entry.cached_tokens += len(reuse.hits) * size
            self.prefix_cache_queries += reuse.looked_up
            self.prefix_cache_hits += len(reuse.hits) * size
            for blocks, block_hash in reuse.hits:
                for table, block in zip(entry.tables, blocks):
                    self.cache.share(block)
                    table.append(block)
                entry.hashes.append(block_hash)
            if reuse.hits:
                entry.token_ids = history[:reuse.start]
            entries.append(entry)
        # After every share: a block another call of this batch just shared must be copied too.
        for entry, partial in zip(entries, writes_into_last):
            if partial:
                self._make_last_block_writable(entry)
        for entry, history in zip(entries, histories):
            for table in entry.tables:
                table.extend(self.cache.allocate(blocks_for(len(history), size) - len(table)))
        return entries

    def _make_last_block_writable(self, entry: _PagedSequence) -> None:
        """The call writes into its tables' last blocks after their first tokens: a block other
        tables hold is copied first (copy-on-write), a block only it holds stops being findable
        (its key no longer says what it holds)."""
        for table in entry.tables:
            block = table[-1]
            if self.cache.refs(block) > 1:
                copy = self.cache.allocate(1)[0]
                self.cache.copy_block(block, copy)
                self.cache.free([block])
                table[-1] = copy
            else:
                self.cache.unpublish(block)

    def _publish_full_blocks(self, entry: _PagedSequence) -> None:
        """Make the blocks entry has just filled findable by their chained keys."""
        size, tokens = self.block_size, entry.token_ids
        parent = entry.hashes[-1] if entry.hashes else self._salt
        for index in range(len(entry.hashes), len(tokens) // size):
            key = block_key(parent, tokens[index * size:(index + 1) * size])
            for group, table in enumerate(entry.tables):
                self.cache.publish(table[index], (group, key))
            parent = hash(key)
            entry.hashes.append(parent)

    def _crop(self, entry: _PagedSequence, length: int) -> int:
        """Keep the first length tokens and the blocks they need; the rest are let go (tail first).
        Nothing is kept when a windowed group no longer holds what a query at position length sees
        (`_servable`). -> the tokens kept."""
        length = self._servable(entry, length)
        if length < len(entry.token_ids):
            del entry.token_ids[length:]
        del entry.hashes[length // self.block_size:]
        keep = blocks_for(length, self.block_size)
        for table in entry.tables:
            if keep < len(table):
                self.cache.free([block for block in table[keep:][::-1] if block != NO_BLOCK])
                del table[keep:]
        return length

    def _servable(self, entry: _PagedSequence, length: int) -> int:
        """length, if a call starting there finds every key its queries see: in each windowed
        group, those from length - window + 1 on; else 0 (a crop deeper than rollback_tokens
        behind the end it last held: the call recomputes, from the prefix cache where it can)."""
        for index, window in self._windows:
            table = entry.tables[index]
            if table and table[0] == NO_BLOCK and length - window + 1 < _first_held(table) * self.block_size:
                return 0
        return length

    def _let_go_outside_windows(self, entry: _PagedSequence) -> None:
        """Free each windowed group's blocks wholly older than the keys a query rollback_tokens
        behind the sequence's end sees (paged_cache.blocks_before_window), leaving NO_BLOCK in
        their place: what bounds a windowed group's memory by its window (window_blocks). A later
        call starting at most rollback_tokens back (a rejected speculative tail) still finds every
        key its queries see; a deeper crop recomputes (`_servable`)."""
        for index, window in self._windows:
            table = entry.tables[index]
            outside = blocks_before_window(len(entry.token_ids), window, self.rollback_tokens, self.block_size)
            held_from = _first_held(table)
            if outside > held_from:
                self.cache.free(table[held_from:outside][::-1])
                table[held_from:outside] = [NO_BLOCK] * (outside - held_from)

    def release(self, seq_id: str) -> None:
        """Forget seq_id and let go of its blocks (idempotent); its full blocks stay cached."""
        entry = self._sequences.pop(seq_id, None)
        if entry is not None:
            for table in entry.tables:
                self.cache.free([block for block in table[::-1] if block != NO_BLOCK])

    def weights_mismatch(self, state: Mapping[str, torch.Tensor]) -> str | None:
        """Why `state` cannot replace this runner's weights in place (None: it can): it must name
        exactly this model's weights, each of the same shape."""
        own = self.model.state_dict()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            return (f"the new weights are not this draft's architecture: missing {missing[:3]}, "
                    f"unexpected {unexpected[:3]}")
        shapes = [name for name, tensor in own.items() if tuple(state[name].shape) != tuple(tensor.shape)]
        if shapes:
            return f"the new weights are not this draft's shapes: {shapes[:3]} differ"
        return None

    def load_weights(self, state: Mapping[str, torch.Tensor], cache_salt: str) -> None:
        """Serve `state` (weights of this same architecture, e.g. a trained draft version) from the
        next forward, copied into the model's own tensors: the KV pool and the weights' memory are
        the ones already serving, so on a GPU a swap needs no room for a second copy of either.
        Every sequence's keys and values belong to the old weights: all are let go, and cached
        blocks become unfindable (the hash chain's root is the new cache_salt). ValueError
        (nothing changed) when `weights_mismatch` says why it cannot."""
        problem = self.weights_mismatch(state)
        if problem is not None:
            raise ValueError(problem)
        for seq_id in list(self._sequences):
            self.release(seq_id)
        self._salt = salt_hash(cache_salt)
        with torch.no_grad():
            self.model.load_state_dict(state, strict=True)

    def fork(self, parent_id: str, child_id: str) -> None:
        """child_id starts holding what parent_id holds, sharing its blocks (the speculation
        cache's branches, decoding.speculation_cache): its first call crops to the history it
        shares, and a write into a shared block copies it first (`_make_last_block_writable`), so
        neither sequence ever sees the other's tokens. Nothing happens if parent_id holds nothing."""
        parent = self._sequences.get(parent_id)
        if parent is None or child_id == parent_id:
            return
        self.release(child_id)
        for table in parent.tables:
            for block in table:
                if block != NO_BLOCK:
                    self.cache.share(block)
        self._sequences[child_id] = _PagedSequence([list(table) for table in parent.tables], list(parent.token_ids),
                                                   list(parent.hashes))

    def adopt(self, seq_id: str, branch_id: str) -> None:
        """seq_id takes over branch_id's KV (the branch whose block was used), letting go of its
        own; branch_id is forgotten. If branch_id holds nothing, seq_id keeps what it holds."""
        branch = self._sequences.pop(branch_id, None)
        if branch is None:
            return
        self.release(seq_id)
        self._sequences[seq_id] = branch

    def cached_prefix_length(self, seq_id: str, token_ids: Sequence[int], num_rows: int = 1) -> int:
        """Tokens of token_ids a call would not compute now: what seq_id holds of them, extended
        by the prefix cache (what the scheduler plans a new sequence's prefill from)."""
        history = list(token_ids)
        held, hits = self._reusable(history, len(history) - num_rows, self._sequences.get(seq_id))
        return held // self.block_size * self.block_size + len(hits) * self.block_size if hits else held

    def prefix_cached_tokens(self, seq_id: str) -> int:
        """Tokens seq_id has found in the prefix cache (OpenAI's cached_tokens, read after its
        prefill): at admission, and when a later chunk of its prefill found blocks that another
        sequence finished meanwhile."""
        entry = self._sequences.get(seq_id)
        return 0 if entry is None else entry.cached_tokens

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.cache.num_free

    @property
    def num_kv_groups(self) -> int:
        """KV cache groups (paged_cache.KVGroup): a sequence takes a block in each per block of tokens."""
        return len(self.cache.groups)

    def blocks_held(self, seq_id: str, group: int | None = None) -> int:
        """Blocks seq_id's tables hold: in every KV cache group, or in group (cache.groups' index)."""
        entry = self._sequences.get(seq_id)
        if entry is None:
            return 0
        tables = entry.tables if group is None else [entry.tables[group]]
        return sum(len(table) - _first_held(table) for table in tables)

    def kv_usage(self) -> dict[str, int]:
        """KV blocks used, free (cached ones among them), tokens held, bytes reserved and the
        prefix cache's counters: for engine stats and metrics."""
        return {"kv_blocks_used": self.cache.num_used, "kv_blocks_free": self.cache.num_free,
                "kv_blocks_cached": self.cache.num_cached,
                "prefix_cache_queries": self.prefix_cache_queries, "prefix_cache_hits": self.prefix_cache_hits,
                "kv_block_size": self.block_size,
                "kv_tokens_held": sum(len(entry.token_ids) for entry in self._sequences.values()),
                "kv_bytes_reserved": self.cache.reserved_bytes()}


def _keep_rows(decoder, args, kwargs, output):
    """Forward hook on the model's decoder: its last hidden states [B, T, H] narrowed to the
    positions the paged view's keep_index names, [1, kept, H], so the model's own head (and
    whatever it applies to logits: soft-caps, scales) runs only over them, and no boolean mask
    (a host sync) selects them."""
    view = kwargs.get("paged_batch")
    if view is None or view.keep_index is None:
        return None
    hidden = output.last_hidden_state
    output.last_hidden_state = hidden.reshape(-1, hidden.shape[-1]).index_select(0, view.keep_index).unsqueeze(0)
    return output


def _first_held(table: list[int]) -> int:
    """Index of a table's first block that is not NO_BLOCK (a windowed group lets go of a
    leading run; binary search: a table may have thousands of entries)."""
    low, high = 0, len(table)
    while low < high:
        middle = (low + high) // 2
        if table[middle] == NO_BLOCK:
            low = middle + 1
        else:
            high = middle
    return low


def decoder_support(model) -> tuple[bool, str]:
    """(True, why) when the model is a decoder the paged engine can run, else (False, why not),
    from what can be read before a forward: a causal decoder whose forward takes logits_to_keep.
    Whether every layer attends through the interface is checked by a forward at load."""
    config = model.config.get_text_config(decoder=True)
    model_type = getattr(config, "model_type", None)
    if getattr(model.config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        return False, f"{model_type!r} is an encoder-decoder (cross-attention needs an encoder cache)"
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return False, f"{type(model).__name__}.forward takes no logits_to_keep"
    return True, f"{model_type} decoder"


def runner_for_model(model, max_sequences: int = 256, model_path: str | None = None,
                     lean_forward: bool = True, max_model_len: int | None = None,
                     kv_cache_memory_gb: float | None = None,
                     gpu_memory_utilization: float | None = None, gpu_share: float = 1.0,
                     profile_batches: Sequence[tuple[int, int]] = DEFAULT_PROFILE_BATCHES,
                     prefix_caching: bool = True, cache_salt: str | None = None,
                     rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS,
                     enforce_eager: bool = False) -> BatchedModelRunner:
    """BatchedModelRunner over `model` (running the lean forward where the architecture has one and
    lean_forward is set); logs one line saying which forward, the KV capacity and whether prefix
    caching is on (see BatchedModelRunner._init_from_model). UnsupportedModelError for a model it
    cannot serve."""
    path = model_path or model_path_of(model)
    lean, lean_reason = lean_support(model) if lean_forward else (False, "lean_forward is off")
    runner = BatchedModelRunner.__new__(BatchedModelRunner)
    runner._init_from_model(model, max_sequences=max_sequences, model_path=path, lean=lean,
                            max_model_len=max_model_len, kv_cache_memory_gb=kv_cache_memory_gb,
                            gpu_memory_utilization=gpu_memory_utilization, gpu_share=gpu_share,
                            profile_batches=profile_batches, prefix_caching=prefix_caching, cache_salt=cache_salt,
                            rollback_tokens=rollback_tokens, enforce_eager=enforce_eager)
    group = "" if runner.tensor_parallel_size == 1 else (
        f"tensor-parallel rank {torch.distributed.get_rank()} of {runner.tensor_parallel_size}: "
        f"{weight_bytes(model) / 2 ** 20:,.1f} MiB of weights; ")
    logger.info("%s: batched paged-KV runner (%s; %s; %s); %s%s; prefix caching %s", path, decoder_support(model)[1],
                lean_reason if lean else f"transformers forward: {lean_reason}", runner.step_forward.describe(), group,
                runner.kv_capacity.describe(), "on" if prefix_caching else "off")
    return runner


def load_runner(spec: dict):
    """The runner for a model spec mapping (path, dtype, device, torch_threads, max_sequences,
    lean_forward, and optionally max_model_len, kv_cache_memory_gb, gpu_memory_utilization,
    prefix_caching, cache_salt, and the builder's gpu_share, profile_batches and rollback_tokens: see
    BatchedModelRunner._init_from_model).

    With `tensor_parallel` ({rank, size, store_address}: this process is one rank of a group) it
    joins the group and loads this rank's shards; rank 0 gets the MirroredRunner the engine
    drives, a follower the Follower that replays its calls (decoding.tensor_parallel)."""
    member = spec.get("tensor_parallel")
    group = None if member is None else TensorParallelRank(**member)
    control = None if group is None else join_group(group, resolve_device(spec["device"]))
    model = load_causal_lm(spec["path"], dtype=spec["dtype"], device=spec["device"],
                           num_threads=spec["torch_threads"], tensor_parallel_size=group.size if group else 1)
    runner = runner_for_model(model, max_sequences=spec["max_sequences"], model_path=spec["path"],
                              lean_forward=spec.get("lean_forward", True), max_model_len=spec.get("max_model_len"),
                              kv_cache_memory_gb=spec.get("kv_cache_memory_gb"),
                              gpu_memory_utilization=spec.get("gpu_memory_utilization"),
                              gpu_share=spec.get("gpu_share", 1.0),
                              profile_batches=[tuple(batch) for batch in spec.get("profile_batches", DEFAULT_PROFILE_BATCHES)],
                              prefix_caching=spec.get("prefix_caching", True), cache_salt=spec.get("cache_salt"),
                              rollback_tokens=spec.get("rollback_tokens", DEFAULT_ROLLBACK_TOKENS),
                              enforce_eager=spec.get("enforce_eager", False))
    runner.serve_as(spec.get("vocab_size"), spec.get("eos_token_ids"))
    return runner if group is None else in_group(runner, group.rank, control)
