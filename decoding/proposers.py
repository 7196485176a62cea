"""Proposers: where draft tokens come from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from decoding.model_runner import ModelRunner
from decoding.sampling import SamplingParams, logits_to_probs, sample_from_probs


@dataclass
class Proposal:
    token_ids: list[int]              # K proposed tokens (may be fewer than asked, even 0)
    probs: torch.Tensor | np.ndarray | None  # [K, V] processed q rows (numpy on the wire); None: greedy or deterministic


def empty_proposal() -> Proposal:
    """No draft tokens: the round degenerates to one plain target step."""
    return Proposal(token_ids=[], probs=None)


class Proposer(Protocol):
    def propose(self, seq_id: str, history: Sequence[int], num_tokens: int, params: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        """Propose up to num_tokens continuing history (prompt + committed output)."""

    def prefill(self, seq_id: str, history: Sequence[int]) -> None:
        """Bring per-sequence state up to date with history ahead of the first round (optional work)."""

    def release(self, seq_id: str) -> None:
        """Drop any per-sequence state (idempotent)."""


class DraftModelProposer:
    """A small causal LM drafting autoregressively over a ModelRunner (KV cache reused across rounds)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def prefill(self, seq_id: str, history: Sequence[int]) -> None:
        """Fill the draft's KV cache with history (e.g. the prompt, while the target prefills)."""
        if 0 < len(history) <= self.runner.max_context:
            self.runner.forward(seq_id, history, num_rows=1)

    def propose(self, seq_id: str, history: Sequence[int], num_tokens: int, params: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        """Draft up to num_tokens tokens, one draft forward each. Greedy drafts are the argmax chain
        (probs None); sampled drafts are drawn from logits_to_probs rows with `generator`, and those
        processed q rows [K, V] are returned for rejection sampling.

        Fewer tokens are drafted when the draft model's context would overflow."""
        token_ids = list(history)
        # The last drafted token is never fed, so the draft sees at most len(history) + K - 1 tokens.
        num_tokens = min(num_tokens, self.runner.max_context - len(token_ids) + 1)
        if num_tokens <= 0:
            return empty_proposal()
        greedy = params.is_greedy
        drafted: list[int] = []
        q_rows: list[torch.Tensor] = []
        logits = self.runner.forward(seq_id, token_ids, num_rows=1)[0]
        for i in range(num_tokens):
            if greedy:
                token = int(torch.argmax(logits))
            else:
                # Sample where the generator lives; q rows then travel in the same (host) place.
                q = logits_to_probs(logits if generator is None else logits.to(generator.device), params)
                token = int(sample_from_probs(q, generator))
                q_rows.append(q)
            drafted.append(token)
            if i + 1 < num_tokens:
                token_ids.append(token)
                logits = self.runner.forward(seq_id, token_ids, num_rows=1)[0]
        return Proposal(token_ids=drafted, probs=None if greedy else torch.stack(q_rows))

    def release(self, seq_id: str) -> None:
        self.runner.release(seq_id)


class NgramProposer:
    """Prompt lookup: continue the longest suffix of history (n from max_ngram down to min_ngram)
    that occurred earlier in history with the tokens that followed it. No model, no state."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def prefill(self, seq_id: str, history: Sequence[int]) -> None:
        """Nothing to prepare: the lookup reads history afresh each round."""

    def propose(self, seq_id: str, history: Sequence[int], num_tokens: int, params: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        """The up-to-num_tokens tokens that followed the most recent earlier occurrence of the
        longest matching suffix; empty when no suffix of length >= min_ngram recurs."""
        length = len(history)
        if num_tokens <= 0 or length < 2:
            return empty_proposal()
        ids = torch.as_tensor(list(history), dtype=torch.long)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # Windows starting at 0 .. length-n-1: each is followed by at least one token.
            windows = ids[:-1].unfold(0, n, 1)
            matches = (windows == ids[-n:]).all(dim=1).nonzero()
            if matches.numel() > 0:
                start = int(matches[-1]) + n
                return Proposal(token_ids=ids[start:start + num_tokens].tolist(), probs=None)
        return empty_proposal()

    def release(self, seq_id: str) -> None:
        """Stateless: nothing to drop."""
