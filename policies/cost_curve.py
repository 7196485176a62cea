"""A pool's forward cost as a function of batch tokens, fitted from measured forwards.

Why this shape: an accelerator's forward costs about the same for 1 or 100 tokens (weights are
read once; memory-bound) until the batch fills its compute, then grows linearly; a CPU is
compute-bound from the start. So we fit a hinge, t(x) = a + b * max(0, x - knee): flat, then
linear, with knee = 0 being plain least squares a + b*x (the CPU case). The knee is chosen among
the observed token counts by least squared relative error (a miss matters in proportion to the
forward's cost), a and b are clamped non-negative so the
curve never decreases. With fewer than two distinct token counts there is no slope to learn,
and `fit_cost_curve` says so (None) rather than guessing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

MIN_SAMPLES_FOR_KNEE = 4  # below this a hinge has too few points per segment: fit a line


@dataclass(frozen=True)
class CostCurve:
    """t(tokens) = fixed_s + per_token_s * max(0, tokens - knee_tokens), in seconds."""

    fixed_s: float
    per_token_s: float
    knee_tokens: float = 0.0
    num_samples: int = 0

    def seconds(self, batch_tokens: float) -> float:
        return self.fixed_s + self.per_token_s * max(0.0, batch_tokens - self.knee_tokens)


def _hinge_fits(hinged: np.ndarray, weight: np.ndarray, weighted_time: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least squares t = a + b*h with a, b >= 0 (a non-decreasing, non-negative cost), one
    fit per row of hinged [knees, groups] (each group's h under that row's knee), over groups of
    total weight `weight` and weighted time `weighted_time`. -> (a, b) per row."""
    total = weight.sum()
    mean_h, mean_t = (hinged * weight).sum(axis=1) / total, weighted_time.sum() / total
    centred = hinged - mean_h[:, None]
    sxx = (weight * centred ** 2).sum(axis=1)
    sxy = (centred * (weighted_time - weight * mean_t)).sum(axis=1)
    slope = np.divide(sxy, sxx, out=np.zeros_like(sxx), where=sxx > 0)
    intercept = mean_t - slope * mean_h
    shh = (weight * hinged ** 2).sum(axis=1)
    through_origin = np.divide((hinged * weighted_time).sum(axis=1), shh, out=np.zeros_like(shh), where=shh > 0)
    rising = slope > 0
    fixed = np.where(rising, np.maximum(intercept, 0.0), mean_t)
    per_token = np.where(rising, np.where(intercept < 0, through_origin, slope), 0.0)
    return fixed, per_token


def fit_cost_curve(samples: Iterable[tuple[float, float]]) -> CostCurve | None:
    """Fit t(tokens) to (batch_tokens, seconds) samples; None when the slope is unidentifiable.

    Samples that share a token count enter every fit only through three sums (weight, weighted
    time, weighted squared time), so the fits for every candidate knee are a few array operations
    over the distinct counts: the policy actor refits each pool every decision, from hundreds of
    samples with as many distinct counts under load."""
    points = np.asarray([(x, y) for x, y in samples], dtype=np.float64).reshape(-1, 2)
    points = points[(points[:, 0] > 0) & (points[:, 1] >= 0)]
    tokens, seconds = points[:, 0], points[:, 1]
    counts, group = np.unique(tokens, return_inverse=True)
    if len(counts) < 2:
        return None
    # Relative errors: a 1 ms miss matters at 5 ms (small batches, where K is decided), not at 500 ms.
    floor = max(float(seconds.max()) * 1e-3, 1e-9)
    weights = 1.0 / np.maximum(seconds, floor) ** 2
    weight = np.bincount(group, weights)
    weighted_time = np.bincount(group, weights * seconds)
    weighted_square = np.bincount(group, weights * seconds ** 2)
    # Keep at least two distinct counts on the sloped side; knee 0 is the plain line.
    knees = np.concatenate(([0.0], counts[1:-1] if len(points) >= MIN_SAMPLES_FOR_KNEE else []))
    hinged = np.maximum(0.0, counts[None, :] - knees[:, None])
    fixed, per_token = _hinge_fits(hinged, weight, weighted_time)
    # Squared error = the spread within each count (the same for every knee) + each count's weighted
    # mean time against the curve.
    mean_time = weighted_time / weight
    within = max(0.0, float((weighted_square - weighted_time * mean_time).sum()))
    errors = within + (weight * (fixed[:, None] + per_token[:, None] * hinged - mean_time) ** 2).sum(axis=1)
    best = 0
    for index in range(1, len(knees)):
        if errors[index] < errors[best] * (1 - 1e-9):  # ties keep the simpler (smaller knee) curve
            best = index
    return CostCurve(float(fixed[best]), float(per_token[best]), float(knees[best]), len(points))
