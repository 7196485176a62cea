"""The performance model (docs/depth-and-autoscaling.md) and the statistics the report is built from.

Pure functions on plain numbers, so the numbers printed next to a measurement can be checked by
hand and by tests: E = (1 - a^(K+1)) / (1 - a) tokens per target pass; the overlapped
(pipelined) bound E * t(1) / t(K+1); the serial estimate E * t(1) / (K * t_draft + t(K+1)).
Alpha is estimated by policies.acceptance, the estimator the depth policy uses too (here without
its prior: a benchmark row has thousands of rounds and reports the plain fit).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from specserve.policies.acceptance import estimate_acceptance_rate, expected_tokens_per_round


def expected_tokens_per_pass(acceptance_rate: float, num_draft_tokens: float) -> float:
    """E = 1 + a + ... + a^K: expected tokens a target pass emits when each draft token is
    accepted independently with probability a. K may be fractional (a mean depth)."""
    if not 0.0 <= acceptance_rate <= 1.0:
        raise ValueError(f"acceptance rate must lie in [0, 1], got {acceptance_rate}")
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    return expected_tokens_per_round(acceptance_rate, num_draft_tokens)


def measured_acceptance_rate(num_accepted: int, num_drafted: int, num_rounds: int) -> float:
    """A benchmark row's alpha: the truncated-geometric fit to its totals, no prior."""
    return estimate_acceptance_rate(num_accepted, num_drafted, num_rounds, prior_accepted=0.0, prior_rejected=0.0)


def overlapped_speedup_bound(acceptance_rate: float, num_draft_tokens: float,
                             target_step_1_s: float, target_step_k1_s: float) -> float:
    """E * t(1) / t(K+1): the speed-up when drafting is fully hidden behind verification."""
    return expected_tokens_per_pass(acceptance_rate, num_draft_tokens) * target_step_1_s / target_step_k1_s


def serial_speedup_estimate(acceptance_rate: float, num_draft_tokens: float, target_step_1_s: float,
                            target_step_k1_s: float, draft_step_s: float) -> float:
    """E * t(1) / (K * t_draft + t(K+1)): drafting and verifying one after the other, no overheads.
    With t(K+1) = t(1) and c = t_draft / t(1) this is E / (K c + 1) (docs/depth-and-autoscaling.md)."""
    round_s = num_draft_tokens * draft_step_s + target_step_k1_s
    return expected_tokens_per_pass(acceptance_rate, num_draft_tokens) * target_step_1_s / round_s


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def median_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """q-th percentile (0..100) with linear interpolation between closest ranks; None if empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
