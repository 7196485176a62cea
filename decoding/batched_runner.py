"""The engines' model runner: many sequences in ONE forward, over a paged KV cache, for any decoder.

Full-history protocol (each call names the whole history; the runner reuses the longest cached
prefix, crops the rest and computes the remainder); `forward_batch` runs every call's remainder
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
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decoding.model_runner import (
    ForwardCall,
    NoFreeSlotError,
    RunnerBase,
    SequenceStateError,
    _common_prefix_length,
    load_causal_lm,
    model_path_of,
)
from decoding.lean_forward import LeanDecoder, lean_support
from decoding.paged_attention import ATTENTION_NAME, FLASH_BLOCK_SIZE, PagedAttentionError, flash_kernel_available
from decoding.paged_cache import (
    DEFAULT_BLOCK_SIZE,
    GIB,
    KVCapacity,
    NoFreeBlocksError,
    PagedKVCache,
    blocks_for,
    gpu_kv_budget_bytes,
    kv_capacity,
    paged_layout,
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


class UnsupportedModelError(ValueError):
    """The model is not a decoder whose every layer attends through transformers' attention
    interface, so the paged engine cannot serve it (raised at load, naming what is unsupported)."""


@dataclass
class _PagedSequence:
    blocks: list[int]     # its block table: token i lives in blocks[i // block_size]
    token_ids: list[int]  # exactly the tokens whose keys/values the blocks hold


class BatchedModelRunner(RunnerBase):
    """Owns one model and a paged KV cache; `forward_batch` serves many sequences per forward."""

    def _init_from_model(self, model, max_sequences: int, model_path: str, lean: bool = True,
                         max_model_len: int | None = None, kv_cache_memory_gb: float | None = None,
                         gpu_memory_utilization: float | None = None,
                         block_size: int = DEFAULT_BLOCK_SIZE, gpu_share: float = 1.0,
                         profile_batches: Sequence[tuple[int, int]] = DEFAULT_PROFILE_BATCHES) -> None:
        """lean: run decoding.lean_forward where the architecture has one (else transformers' forward).
        max_model_len: longest sequence served (default: the model's max_position_embeddings).
        kv_cache_memory_gb: the KV budget on CPU; on CUDA, gpu_memory_utilization of the engine's
        gpu_share of the device, less the weights and the peak activations of the largest forwards
        (profile_batches: (rows, new tokens) the scheduler can plan) decide it (gpu_kv_budget_bytes),
        as vLLM's two settings do."""
        supported, reason = decoder_support(model)
        if not supported:
            raise UnsupportedModelError(f"{model_path}: specserve's engine cannot serve this model: {reason}")
        super()._init_from_model(model, max_sequences, model_path, max_model_len)
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
        if self.device.type == "cuda":
            budget = gpu_kv_budget_bytes(torch.cuda.get_device_properties(self.device).total_memory,
                                         gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION, gpu_share,
                                         torch.cuda.memory_allocated(self.device),
                                         max(self._peak_activation_bytes(rows, tokens, block_size, flash)
                                             for rows, tokens in profile_batches))
        else:
            budget = (kv_cache_memory_gb or DEFAULT_KV_CACHE_MEMORY_GB) * GIB
        self.kv_capacity: KVCapacity = kv_capacity(self.config, self._dtype, budget, self.max_context, block_size)
        self.cache = PagedKVCache(num_layers=self.config.num_hidden_layers, num_blocks=self.kv_capacity.num_blocks,
                                  block_size=block_size, device=self.device, flash=flash)
        self._sequences: dict[str, _PagedSequence] = {}
        # Its forward also shapes every layer's pool: on CUDA the whole budget is allocated here,
        # so an out-of-memory shows at start, not on the first request.
        self._check_every_layer_attends_through_the_cache()

    def _peak_activation_bytes(self, rows: int, tokens: int, block_size: int, flash: bool) -> int:
        """CUDA only (never run here: no GPU): device memory a forward of rows x tokens new tokens
        takes beyond its keys and values, measured on a throw-away cache, as vLLM profiles a dummy
        batch before sizing its KV cache."""
        per_row = blocks_for(tokens, block_size)
        scratch = PagedKVCache(num_layers=self.config.num_hidden_layers, num_blocks=rows * per_row,
                               block_size=block_size, device=self.device, flash=flash)
        tables = [scratch.allocate(per_row) for _ in range(rows)]
        layout = paged_layout(tables, [0] * rows, [tokens] * rows, block_size, dtype=self._dtype, device=self.device)
        keep = torch.zeros((rows, tokens), dtype=torch.bool, device=self.device)
        keep[:, -1] = True
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._logits(torch.zeros((rows, tokens), dtype=torch.long, device=self.device), layout, keep,
                     scratch.view(layout))
        peak = torch.cuda.max_memory_allocated(self.device) - before - scratch.reserved_bytes()
        del scratch
        torch.cuda.empty_cache()
        return max(0, peak)

    def _check_every_layer_attends_through_the_cache(self) -> None:
        """One 1-token forward at load: every layer must have stored its keys through the paged
        attention, else the model keeps state of its own (recurrent or linear-attention layers)
        that rollback and batching would silently get wrong."""
        blocks = self.cache.allocate(1)
        try:
            layout = paged_layout([blocks], [0], [1], self.block_size, dtype=self._dtype, device=self.device)
            view = self.cache.view(layout)
            keep = torch.ones((1, 1), dtype=torch.bool, device=self.device)
            try:
                self._logits(torch.zeros((1, 1), dtype=torch.long, device=self.device), layout, keep, view)
            except PagedAttentionError as error:
                raise UnsupportedModelError(f"{self.model_path}: {error}") from error
        finally:
            self.cache.free(blocks)
        missing = sorted(set(range(self.config.num_hidden_layers)) - view.layers_attended)
        if missing:
            raise UnsupportedModelError(
                f"{self.model_path}: layers {missing} of {self.config.num_hidden_layers} do not attend through "
                "transformers' attention interface (recurrent or linear-attention layers?); specserve's engine "
                "cannot serve this model")

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
        starts, num_new = [], []
        for call, history, entry in zip(calls, histories, held):
            reused = 0 if entry is None else _common_prefix_length(entry.token_ids, history,
                                                                   len(history) - call.num_rows)
            if entry is not None:
                self._crop(entry, reused)   # a rollback: blocks past the reused prefix go back
            starts.append(reused)
            num_new.append(len(history) - reused)
        needed = [blocks_for(len(history), self.block_size) - (0 if entry is None else len(entry.blocks))
                  for history, entry in zip(histories, held)]
        if sum(needed) > self.cache.num_free:
            raise NoFreeBlocksError(f"this batch needs {sum(needed)} more KV blocks, {self.cache.num_free} of "
                                    f"{self.cache.num_blocks} are free; wait for sequences to finish")
        new_seq_ids = [call.seq_id for call, entry in zip(calls, held) if entry is None]
        entries = [entry if entry is not None else self._sequences.setdefault(call.seq_id, _PagedSequence([], []))
                   for call, entry in zip(calls, held)]
        for entry, count in zip(entries, needed):
            entry.blocks.extend(self.cache.allocate(count))

        layout = paged_layout([entry.blocks for entry in entries], starts, num_new, self.block_size,
                              dtype=self._dtype, device=self.device)
        num_columns = max(num_new)
        # Padding id 0 is never stored nor seen by a real token; its rows are not kept.
        input_ids = torch.tensor([history[start:] + [0] * (num_columns - n)
                                  for history, start, n in zip(histories, starts, num_new)], dtype=torch.long)
        keep = torch.tensor([[n - call.num_rows <= t < n for t in range(num_columns)]
                             for call, n in zip(calls, num_new)], dtype=torch.bool)
        try:
            logits = self._logits(input_ids.to(self.device), layout, keep.to(self.device))
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
        # The boolean keep mask flattens the kept rows in (row, column) order.
        logits = self._served_columns(logits.float())
        offsets = [0]
        for call in calls:
            offsets.append(offsets[-1] + call.num_rows)
        return [logits[offsets[i]:offsets[i + 1]] for i in range(len(calls))]

    @torch.inference_mode()
    def _logits(self, input_ids: torch.Tensor, layout, keep: torch.Tensor, view=None) -> torch.Tensor:
        """The model's logits for the kept (row, column) positions, in that order: [kept, V]."""
        view = self.cache.view(layout) if view is None else view
        if self.lean is not None:
            return self.lean.forward(input_ids, layout.position_ids, view, keep)
        # The model keeps no cache of its own (use_cache=False): its attention stores keys and
        # values in the paged view it receives as a keyword (decoding.paged_attention).
        return self.model(input_ids=input_ids, position_ids=layout.position_ids, use_cache=False,
                          logits_to_keep=keep, paged_batch=view).logits

    def _crop(self, entry: _PagedSequence, length: int) -> None:
        """Keep the first length tokens and the blocks they need; the rest go back to the pool."""
        if length < len(entry.token_ids):
            del entry.token_ids[length:]
        keep = blocks_for(length, self.block_size)
        if keep < len(entry.blocks):
            self.cache.free(entry.blocks[keep:])
            del entry.blocks[keep:]

    def release(self, seq_id: str) -> None:
        """Forget seq_id and free its blocks (idempotent)."""
        entry = self._sequences.pop(seq_id, None)
        if entry is not None:
            self.cache.free(entry.blocks)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.cache.num_free

    def blocks_held(self, seq_id: str) -> int:
        entry = self._sequences.get(seq_id)
        return 0 if entry is None else len(entry.blocks)

    def kv_usage(self) -> dict[str, int]:
        """KV blocks used and free, tokens held and bytes reserved: for engine stats and metrics."""
        return {"kv_blocks_used": self.cache.num_used, "kv_blocks_free": self.cache.num_free,
                "kv_block_size": self.block_size,
                "kv_tokens_held": sum(len(entry.token_ids) for entry in self._sequences.values()),
                "kv_bytes_reserved": self.cache.reserved_bytes()}


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
                     profile_batches: Sequence[tuple[int, int]] = DEFAULT_PROFILE_BATCHES) -> BatchedModelRunner:
    """BatchedModelRunner over `model` (running the lean forward where the architecture has one and
    lean_forward is set); logs one line saying which forward and the KV capacity (see
    BatchedModelRunner._init_from_model). UnsupportedModelError for a model it cannot serve."""
    path = model_path or model_path_of(model)
    lean, lean_reason = lean_support(model) if lean_forward else (False, "lean_forward is off")
    runner = BatchedModelRunner.__new__(BatchedModelRunner)
    runner._init_from_model(model, max_sequences=max_sequences, model_path=path, lean=lean,
                            max_model_len=max_model_len, kv_cache_memory_gb=kv_cache_memory_gb,
                            gpu_memory_utilization=gpu_memory_utilization, gpu_share=gpu_share,
                            profile_batches=profile_batches)
    logger.info("%s: batched paged-KV runner (%s; %s); %s", path, decoder_support(model)[1],
                lean_reason if lean else f"transformers forward: {lean_reason}", runner.kv_capacity.describe())
    return runner


def load_runner(spec: dict) -> BatchedModelRunner:
    """The runner for a model spec mapping (path, dtype, device, torch_threads, max_sequences,
    lean_forward, and optionally max_model_len, kv_cache_memory_gb, gpu_memory_utilization, and the
    builder's gpu_share and profile_batches: see BatchedModelRunner._init_from_model)."""
    model = load_causal_lm(spec["path"], dtype=spec["dtype"], device=spec["device"],
                           num_threads=spec["torch_threads"])
    runner = runner_for_model(model, max_sequences=spec["max_sequences"], model_path=spec["path"],
                              lean_forward=spec.get("lean_forward", True), max_model_len=spec.get("max_model_len"),
                              kv_cache_memory_gb=spec.get("kv_cache_memory_gb"),
                              gpu_memory_utilization=spec.get("gpu_memory_utilization"),
                              gpu_share=spec.get("gpu_share", 1.0),
                              profile_batches=[tuple(batch) for batch in spec.get("profile_batches", DEFAULT_PROFILE_BATCHES)])
    runner.serve_as(spec.get("vocab_size"), spec.get("eos_token_ids"))
    return runner
