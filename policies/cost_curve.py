"""A pool's forward cost as a function of batch tokens, fitted from measured forwards.

Why this shape: an accelerator's forward costs about the same for 1 or 100 tokens (weights are
read once; memory-bound) until the batch fills its compute, then grows linearly; a CPU is
compute-bound from the start. So we fit a hinge, t(x) = a + b * max(0, x - knee): flat, then
linear, with knee = 0 being plain least squares a + b*x (the CPU case). The knee is chosen among
the observed token counts by least squared error, a and b are clamped non-negative so the
curve never decreases. With fewer than two distinct token counts there is no slope to learn,
and `fit_cost_curve` says so (None) rather than guessing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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


def _line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b*x with a, b >= 0 (non-decreasing, non-negative cost)."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    if slope <= 0:
        return mean_y, 0.0
    intercept = mean_y - slope * mean_x
    if intercept < 0:  # refit through the origin
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return intercept, slope


def _squared_error(curve: CostCurve, xs: list[float], ys: list[float]) -> float:
    return sum((curve.seconds(x) - y) ** 2 for x, y in zip(xs, ys))


def fit_cost_curve(samples: Iterable[tuple[float, float]]) -> CostCurve | None:
    """Fit t(tokens) to (batch_tokens, seconds) samples; None when the slope is unidentifiable."""
    points = [(float(x), float(y)) for x, y in samples if x > 0 and y >= 0]
    if len({x for x, _ in points}) < 2:
        return None
    xs, ys = [x for x, _ in points], [y for _, y in points]
    intercept, slope = _line_fit(xs, ys)
    best = CostCurve(intercept, slope, 0.0, len(points))
    if len(points) < MIN_SAMPLES_FOR_KNEE:
        return best
    best_error = _squared_error(best, xs, ys)
    distinct = sorted(set(xs))
    for knee in distinct[1:-1]:  # keep at least two distinct counts on the sloped side
        hinged = [max(0.0, x - knee) for x in xs]
        intercept, slope = _line_fit(hinged, ys)
        candidate = CostCurve(intercept, slope, knee, len(points))
        error = _squared_error(candidate, xs, ys)
        if error < best_error * (1 - 1e-9):  # ties keep the simpler (smaller knee) curve
            best, best_error = candidate, error
    return best
