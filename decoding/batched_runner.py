"""A model runner that serves many sequences in ONE forward, over a slot KV cache.

Same full-history protocol as `ModelRunner` (each call names the whole history; the runner reuses
the longest cached prefix, crops the rest and computes the remainder), but `forward_batch` runs
every call's remainder together: right-padded input ids, per-row position ids, a 4D additive mask
(decoding.slot_cache) and a boolean `logits_to_keep`, so only the rows asked for reach the LM head.
For Llama-shaped models the forward is decoding.lean_forward's (same arithmetic, bit-identical
logits on the default pair, less Python per step); other architectures run transformers' own
forward and attention over the slot cache.

`load_runner` / `runner_for_model` pick this path when the architecture allows it and fall back to
the per-sequence ModelRunner otherwise, saying which in one log line.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decoding.model_runner import (
    ForwardCall,
    ModelRunner,
    NoFreeSlotError,
    RunnerBase,
    SequenceStateError,
    _common_prefix_length,
    load_causal_lm,
    model_path_of,
)
from decoding.lean_forward import LeanDecoder, lean_support
from decoding.slot_cache import SlotKVCache, batch_layout

__all__ = ["BatchedModelRunner", "ForwardCall", "NoFreeSlotError", "SequenceStateError", "load_runner",
           "runner_for_model", "slot_path_support"]

logger = logging.getLogger(__name__)

# Architectures whose attention, in transformers 5.23, takes a user 4D additive mask unchanged,
# gets positions only from position_ids, and touches the cache only through update().
SLOT_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral", "gpt2"})
# Attention kernels that add a float mask to the scores (flash/flex take no 4D float mask).
SLOT_ATTENTION = frozenset({"sdpa", "eager"})
DEFAULT_CHUNK_SLOTS = 8


@dataclass
class _SlotSequence:
    slot: int
    token_ids: list[int]  # exactly the tokens whose keys/values the slot holds


class BatchedModelRunner(RunnerBase):
    """Owns one model and a slot KV cache; `forward_batch` serves many sequences per forward."""

    chunk_slots = DEFAULT_CHUNK_SLOTS

    def _init_from_model(self, model, max_sequences: int, model_path: str, lean: bool = True) -> None:
        """lean: run decoding.lean_forward where the architecture has one (else transformers' forward)."""
        super()._init_from_model(model, max_sequences, model_path)
        supported, reason = slot_path_support(model)
        if not supported:
            raise ValueError(f"{model_path}: the slot KV cache cannot serve this model ({reason}); "
                             "use load_runner / runner_for_model to fall back to ModelRunner")
        self.cache = SlotKVCache(num_layers=self.config.num_hidden_layers, max_len=self.max_context,
                                 max_slots=max_sequences, chunk_slots=self.chunk_slots, device=self.device)
        self._dtype = next(model.parameters()).dtype
        self._sequences: dict[str, _SlotSequence] = {}
        self.lean = LeanDecoder(model) if lean and lean_support(model)[0] else None

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
        new_seq_ids = [call.seq_id for call in calls if call.seq_id not in self._sequences]
        entries = [self._entry(call.seq_id) for call in calls]
        starts, num_new = [], []
        for call, history, entry in zip(calls, histories, entries):
            reused = _common_prefix_length(entry.token_ids, history, len(history) - call.num_rows)
            self._crop(entry, reused)
            starts.append(reused)
            num_new.append(len(history) - reused)

        # Rows in slot order: a batch of neighbouring slots reads the cache as a view.
        order = sorted(range(len(calls)), key=lambda i: entries[i].slot)
        layout = batch_layout([entries[i].slot for i in order], [starts[i] for i in order],
                              [num_new[i] for i in order], dtype=self._dtype, device=self.device)
        num_columns = max(num_new)
        # Padding id 0 is never stored nor seen by a real token; its rows are not kept.
        input_ids = torch.tensor([histories[i][starts[i]:] + [0] * (num_columns - num_new[i]) for i in order],
                                 dtype=torch.long)
        keep = torch.tensor([[num_new[i] - calls[i].num_rows <= t < num_new[i] for t in range(num_columns)]
                             for i in order], dtype=torch.bool)
        try:
            logits = self._logits(input_ids.to(self.device), layout, keep.to(self.device))
        except BaseException:
            # Writes past a slot's length are invisible, so the held slots stay valid (cropped to
            # their reused prefix); only the slots this batch admitted are given back.
            for seq_id in new_seq_ids:
                self.release(seq_id)
            raise
        for call, history, entry in zip(calls, histories, entries):
            entry.token_ids = history
            self.cache.lengths[entry.slot] = len(history)
        # The boolean keep mask flattens the kept rows in (row, column) order.
        logits = logits.float()
        rows_by_call: list[torch.Tensor] = [None] * len(calls)  # type: ignore[list-item]
        offset = 0
        for i in order:
            rows_by_call[i] = logits[offset:offset + calls[i].num_rows]
            offset += calls[i].num_rows
        return rows_by_call

    @torch.inference_mode()
    def _logits(self, input_ids: torch.Tensor, layout, keep: torch.Tensor) -> torch.Tensor:
        """The model's logits for the kept (row, column) positions, in that order: [kept, V]."""
        if self.lean is not None:
            return self.lean.forward(input_ids, layout.position_ids, layout.attention_mask, self.cache.view(layout), keep)
        return self.model(input_ids=input_ids, position_ids=layout.position_ids, attention_mask=layout.attention_mask,
                          past_key_values=self.cache.view(layout), use_cache=True, logits_to_keep=keep).logits

    def _entry(self, seq_id: str) -> _SlotSequence:
        entry = self._sequences.get(seq_id)
        if entry is None:
            entry = _SlotSequence(self.cache.allocate(), [])
            self._sequences[seq_id] = entry
        return entry

    def _crop(self, entry: _SlotSequence, length: int) -> None:
        if length < len(entry.token_ids):
            del entry.token_ids[length:]
            self.cache.lengths[entry.slot] = length

    def release(self, seq_id: str) -> None:
        """Forget seq_id and free its slot (idempotent)."""
        entry = self._sequences.pop(seq_id, None)
        if entry is not None:
            self.cache.free(entry.slot)


def slot_path_support(model) -> tuple[bool, str]:
    """(True, why) when BatchedModelRunner computes exactly what the model computes alone, else
    (False, why not). Decided from the config: model type, attention kernel, sliding windows."""
    config = model.config.get_text_config(decoder=True)
    model_type = getattr(config, "model_type", None)
    attention = getattr(config, "_attn_implementation", None)
    context = int(config.max_position_embeddings)
    if model_type not in SLOT_MODEL_TYPES:
        return False, (f"model type {model_type!r} is not one the slot cache is proven on "
                       f"({', '.join(sorted(SLOT_MODEL_TYPES))})")
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        return False, "cross-attention needs an encoder-decoder cache"
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return False, "its forward takes no logits_to_keep"
    if attention not in SLOT_ATTENTION:
        return False, f"attention kernel {attention!r} takes no 4D additive mask (need sdpa or eager)"
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    windowed_layers = layer_types is None or any(kind != "full_attention" for kind in layer_types)
    if window is not None and window < context and windowed_layers:
        return False, f"sliding window {window} is shorter than the context {context}"
    return True, f"{model_type} with {attention} attention and full-context attention on every layer"


def runner_for_model(model, max_sequences: int = 256, model_path: str | None = None,
                     lean_forward: bool = True) -> BatchedModelRunner | ModelRunner:
    """BatchedModelRunner over `model` when the slot path supports it (running the lean forward
    where the architecture has one and lean_forward is set), else ModelRunner; logs one line
    saying which and why."""
    path = model_path or model_path_of(model)
    supported, reason = slot_path_support(model)
    if not supported:
        logger.info("%s: per-sequence runner (no batching) (%s)", path, reason)
        runner = ModelRunner.__new__(ModelRunner)
        runner._init_from_model(model, max_sequences=max_sequences, model_path=path)
        return runner
    lean, lean_reason = lean_support(model) if lean_forward else (False, "lean_forward is off")
    logger.info("%s: batched slot-cache runner (%s; %s)", path, reason,
                lean_reason if lean else f"transformers forward: {lean_reason}")
    runner = BatchedModelRunner.__new__(BatchedModelRunner)
    runner._init_from_model(model, max_sequences=max_sequences, model_path=path, lean=lean)
    return runner


def load_runner(spec: dict) -> BatchedModelRunner | ModelRunner:
    """The runner for a model spec mapping (path, dtype, device, torch_threads, max_sequences,
    lean_forward), batched when the architecture allows it (see runner_for_model)."""
    model = load_causal_lm(spec["path"], dtype=spec["dtype"], device=spec["device"],
                           num_threads=spec["torch_threads"])
    return runner_for_model(model, max_sequences=spec["max_sequences"], model_path=spec["path"],
                            lean_forward=spec.get("lean_forward", True))
