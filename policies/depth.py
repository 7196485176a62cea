"""Per-request speculation depth from the request's own acceptance rate.

The performance model (shared/README.md): with per-token acceptance alpha, depth K and
draft/target step-cost ratio c, a round emits E = (1 - alpha^(K+1)) / (1 - alpha) tokens and
costs K*c + 1 target-step equivalents. We pick the K in bounds that maximises E / (K*c + 1).
Alpha is estimated with a Beta prior so a new request starts at a sensible depth and one
unlucky round does not collapse it.
"""

from __future__ import annotations

PRIOR_ACCEPTED = 3.0  # Beta(3, 1): a new request is assumed to accept ~75% of draft tokens
PRIOR_REJECTED = 1.0


def expected_tokens_per_round(accept_rate: float, num_draft_tokens: int) -> float:
    """E[tokens emitted by one round] = accepted draft tokens + the recovered/bonus token."""
    if accept_rate >= 1.0:
        return float(num_draft_tokens + 1)
    return (1.0 - accept_rate ** (num_draft_tokens + 1)) / (1.0 - accept_rate)


def expected_speedup(accept_rate: float, num_draft_tokens: int, draft_cost_ratio: float) -> float:
    """Tokens per unit of target-step time relative to target-only decoding (serial drafting)."""
    cost = num_draft_tokens * draft_cost_ratio + 1.0
    return expected_tokens_per_round(accept_rate, num_draft_tokens) / cost


def estimate_accept_rate(num_accepted: int, num_drafted: int) -> float:
    return (num_accepted + PRIOR_ACCEPTED) / (num_drafted + PRIOR_ACCEPTED + PRIOR_REJECTED)


def choose_draft_depth(num_accepted: int, num_drafted: int, draft_cost_ratio: float,
                       min_draft_tokens: int, max_draft_tokens: int) -> int:
    """The depth K in [min, max] with the best expected speedup for this request so far."""
    accept_rate = estimate_accept_rate(num_accepted, num_drafted)
    return max(range(min_draft_tokens, max_draft_tokens + 1),
               key=lambda k: expected_speedup(accept_rate, k, draft_cost_ratio))
