"""The reference the engine's batched paged runner is checked against: transformers' own forward,
cache-free, one sequence at a time."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from specserve.decoding.block_manager import ForwardCall, checked_history
from specserve.decoding.errors import NoFreeSlotError
from specserve.decoding.model_runner import RunnerBase


@dataclass
class _Sequence:
    token_ids: list[int]


class ReferenceRunner(RunnerBase):
    """The tests' oracle, with the engine's protocol (decoding.scheduler.Scheduler.forward_batch): every call runs ONE cache-free forward of a
    private copy of the model (transformers' own attention and masks; no cache, no paging, no
    batching, nothing of the engine's in the forward) over the whole history. Slow, and right by
    construction (transformers' DynamicCache is not: its sliding-window layers drop keys a
    multi-token step still needs). `from_model` copies, so the engine's runner may own the
    original (it switches the model's attention to the paged one)."""

    @classmethod
    def from_model(cls, model, max_sequences: int = 256):
        return super().from_model(reference_model(model), max_sequences=max_sequences)

    def _init_from_model(self, model, max_sequences: int, model_path: str, max_model_len: int | None = None) -> None:
        super()._init_from_model(model, max_sequences, model_path, max_model_len)
        self._sequences: dict[str, _Sequence] = {}

    def forward(self, seq_id: str, token_ids: Sequence[int], num_rows: int = 1) -> torch.Tensor:
        """float32 logits [num_rows, V] of the last num_rows positions of token_ids."""
        wanted = checked_history(ForwardCall(seq_id, token_ids, num_rows), self.max_context)
        if seq_id not in self._sequences and len(self._sequences) >= self.max_sequences:
            raise NoFreeSlotError(f"cannot hold sequence {seq_id!r}: already holding max_sequences="
                                  f"{self.max_sequences}")
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([wanted], device=self.device)).logits[0, -num_rows:]
        self._sequences[seq_id] = _Sequence(wanted)
        return self._served_columns(logits.float())

    def forward_batch(self, calls: Sequence[ForwardCall]) -> list[torch.Tensor]:
        """The engine's checks first (the whole batch, before anything changes), then each call."""
        seq_ids = [call.seq_id for call in calls]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a batch must name each sequence once: {seq_ids}")
        for call in calls:
            checked_history(call, self.max_context)
        if sum(seq_id not in self._sequences for seq_id in seq_ids) > self.max_sequences - len(self._sequences):
            raise NoFreeSlotError(f"cannot hold the batch's new sequences: max_sequences={self.max_sequences}")
        return [self.forward(call.seq_id, call.token_ids, call.num_rows) for call in calls]

    def num_cached(self, seq_id: str) -> int:
        entry = self._sequences.get(seq_id)
        return 0 if entry is None else len(entry.token_ids)

    def active_sequences(self) -> list[str]:
        return list(self._sequences)

    def release(self, seq_id: str) -> None:
        self._sequences.pop(seq_id, None)


# Keyed by the model itself (weakly): an id() key outlives its model, and a later model given the
# same id would get the dead one's copy as its reference.
_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference_model(model) -> torch.nn.Module:
    """A private copy of model running transformers' own sdpa attention (made once per model):
    the engine's runner switches the original's attention to the paged one."""
    copy_ = _copies.get(model)
    if copy_ is None:
        copy_ = copy.deepcopy(model)
        copy_.set_attn_implementation("sdpa" if copy_.config.get_text_config(decoder=True).model_type != "gemma2"
                                      else "eager")
        _copies[model] = copy_
    return copy_


def full_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits of every position from one cache-free forward of the reference copy: [len, V]."""
    with torch.no_grad():
        return reference_model(model)(torch.tensor([list(token_ids)])).logits[0].float()
