"""The performance model (shared/README.md) and the statistics the report is built from.

Pure functions on plain numbers, so the numbers printed next to a measurement can be checked by
hand and by tests: E = (1 - a^(K+1)) / (1 - a) tokens per target pass; the overlapped
(pipelined) bound E * t(1) / t(K+1); the serial estimate E * t(1) / (K * t_draft + t(K+1)).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from policies.depth import expected_tokens_per_round


def expected_tokens_per_pass(acceptance_rate: float, num_draft_tokens: float) -> float:
    """E = 1 + a + ... + a^K: expected tokens a target pass emits when each draft token is
    accepted independently with probability a. K may be fractional (a mean depth)."""
    if not 0.0 <= acceptance_rate <= 1.0:
        raise ValueError(f"acceptance rate must lie in [0, 1], got {acceptance_rate}")
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    return expected_tokens_per_round(acceptance_rate, num_draft_tokens)


def acceptance_from_tokens_per_round(tokens_per_round: float, num_draft_tokens: float) -> float:
    """The per-token acceptance a that makes E(a, K) equal a measured tokens-per-verifying-round.

    Why not accepted / drafted: after a rejection the rest of the block counts as drafted but
    can never be accepted, so that ratio is (E - 1) / K, not the a of the geometric model. The
    router reports only totals, so a is fitted from E (bisection; E is increasing in a)."""
    if num_draft_tokens <= 0:
        raise ValueError(f"num_draft_tokens must be > 0 to fit an acceptance rate, got {num_draft_tokens}")
    if tokens_per_round <= 1.0:
        return 0.0
    if tokens_per_round >= num_draft_tokens + 1.0:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if expected_tokens_per_pass(mid, num_draft_tokens) < tokens_per_round:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def overlapped_speedup_bound(acceptance_rate: float, num_draft_tokens: float,
                             target_step_1_s: float, target_step_k1_s: float) -> float:
    """E * t(1) / t(K+1): the speed-up when drafting is fully hidden behind verification."""
    return expected_tokens_per_pass(acceptance_rate, num_draft_tokens) * target_step_1_s / target_step_k1_s


def serial_speedup_estimate(acceptance_rate: float, num_draft_tokens: float, target_step_1_s: float,
                            target_step_k1_s: float, draft_step_s: float) -> float:
    """E * t(1) / (K * t_draft + t(K+1)): drafting and verifying one after the other, no overheads.
    With t(K+1) = t(1) and c = t_draft / t(1) this is the README's E / (K c + 1)."""
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
