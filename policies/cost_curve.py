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


def _line_fit(xs: list[float], ys: list[float], ws: list[float]) -> tuple[float, float]:
    """Weighted least squares y = a + b*x with a, b >= 0 (non-decreasing, non-negative cost)."""
    total = sum(ws)
    mean_x, mean_y = sum(w * x for w, x in zip(ws, xs)) / total, sum(w * y for w, y in zip(ws, ys)) / total
    sxx = sum(w * (x - mean_x) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(ws, xs, ys)) / sxx if sxx > 0 else 0.0
    if slope <= 0:
        return mean_y, 0.0
    intercept = mean_y - slope * mean_x
    if intercept < 0:  # refit through the origin
        return 0.0, sum(w * x * y for w, x, y in zip(ws, xs, ys)) / sum(w * x * x for w, x in zip(ws, xs))
    return intercept, slope


def _squared_error(curve: CostCurve, xs: list[float], ys: list[float], ws: list[float]) -> float:
    return sum(w * (curve.seconds(x) - y) ** 2 for w, x, y in zip(ws, xs, ys))


def fit_cost_curve(samples: Iterable[tuple[float, float]]) -> CostCurve | None:
    """Fit t(tokens) to (batch_tokens, seconds) samples; None when the slope is unidentifiable."""
    points = [(float(x), float(y)) for x, y in samples if x > 0 and y >= 0]
    if len({x for x, _ in points}) < 2:
        return None
    xs, ys = [x for x, _ in points], [y for _, y in points]
    # Relative errors: a 1 ms miss matters at 5 ms (small batches, where K is decided), not at 500 ms.
    floor = max(max(ys) * 1e-3, 1e-9)
    ws = [1.0 / max(y, floor) ** 2 for y in ys]
    intercept, slope = _line_fit(xs, ys, ws)
    best = CostCurve(intercept, slope, 0.0, len(points))
    if len(points) < MIN_SAMPLES_FOR_KNEE:
        return best
    best_error = _squared_error(best, xs, ys, ws)
    distinct = sorted(set(xs))
    for knee in distinct[1:-1]:  # keep at least two distinct counts on the sloped side
        hinged = [max(0.0, x - knee) for x in xs]
        intercept, slope = _line_fit(hinged, ys, ws)
        candidate = CostCurve(intercept, slope, knee, len(points))
        error = _squared_error(candidate, xs, ys, ws)
        if error < best_error * (1 - 1e-9):  # ties keep the simpler (smaller knee) curve
            best, best_error = candidate, error
    return best
