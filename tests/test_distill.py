"""Teacher data for on-policy draft distillation: real target continuations, reproducible."""

from __future__ import annotations

import torch

from tests.tiny_pair import tiny_llama
from specserve.training.distill import DistillConfig, agreement_on, teacher_continuations

CFG = DistillConfig(prompt_tokens=8, new_tokens=6, generate_batch=3)


def _stream() -> torch.Tensor:
    return torch.randint(2, 96, (200,), generator=torch.Generator().manual_seed(1))


def test_greedy_rows_are_the_targets_own_continuations():
    target, other = tiny_llama(seed=0), tiny_llama(seed=1)
    rows = teacher_continuations(target, _stream(), 5, CFG, 0.0, torch.Generator().manual_seed(0), "t")
    assert rows.shape == (5, CFG.prompt_tokens + CFG.new_tokens)
    stream = _stream().tolist()
    for row in rows.tolist():  # every prompt is a real window of the stream
        prompt = row[: CFG.prompt_tokens]
        assert any(stream[i : i + CFG.prompt_tokens] == prompt for i in range(len(stream)))
    assert agreement_on(target, rows, CFG.prompt_tokens) == 1.0
    assert agreement_on(other, rows, CFG.prompt_tokens) < 1.0


def test_sampled_rows_are_reproducible_and_not_greedy():
    target = tiny_llama(seed=0)
    first, second = (teacher_continuations(target, _stream(), 4, CFG, 2.0, torch.Generator().manual_seed(3), "t")
                     for _ in range(2))
    assert torch.equal(first, second)
    assert agreement_on(target, first, CFG.prompt_tokens) < 1.0
