"""A target's auxiliary hidden states as they travel from its engine to an EAGLE-3 head's.

Why a module of its own: the router merges the features each verify answers into a request's
state and the draft engine's head reads them, so both import this; neither needs the runner
that computes them (decoding.batched_runner), whose imports are an engine's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TargetFeatures:
    """One row's auxiliary hidden states from a forward: the inputs of the runner's aux_layers at
    the positions start, start + 1, ... the forward computed, concatenated in layer order
    ([new tokens, len(aux_layers) x hidden], the model's dtype): what an EAGLE-3 head fuses."""

    start: int
    hidden: torch.Tensor

    @property
    def end(self) -> int:
        """One past the last position held."""
        return self.start + self.hidden.shape[0]

    def followed_by(self, newer: "TargetFeatures") -> "TargetFeatures":
        """These features with a later forward's laid over them: the newer replace these from
        newer.start on (a forward recomputing positions gives them afresh). A newer set that leaves
        a gap after these, or starts before them, is taken alone."""
        if not self.start <= newer.start <= self.end:
            return newer
        return TargetFeatures(self.start, torch.cat([self.hidden[:newer.start - self.start], newer.hidden]))

    def before(self, position: int) -> "TargetFeatures | None":
        """The positions before `position` (None when there are none)."""
        if position <= self.start:
            return None
        return TargetFeatures(self.start, self.hidden[:position - self.start])


def merged_features(older: TargetFeatures | None, newer: TargetFeatures | None) -> TargetFeatures | None:
    """older followed by newer (either may be None)."""
    if older is None or newer is None:
        return newer if older is None else older
    return older.followed_by(newer)


def features_start(history: Sequence[int], answered: bool) -> int:
    """Where the target's features a request's head lacks start, for a forward over history (its
    committed tokens): its last committed token's position once earlier features were answered;
    else 0, the prompt's every position (those a prefix-cache hit reused too)."""
    return len(history) - 1 if answered else 0
