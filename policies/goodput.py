"""Speculation depth per request class from cluster-wide load: the goodput model.

In the spirit of SmartSpec/TurboSpec: speculation is worth it only while the target's batched
forward is cheap in extra tokens. At the current load we choose, for each request class c
(greedy, sampled), the depth K_c that maximises committed tokens per second of the whole system:

    goodput(K) = sum_c n_c * E(alpha_c, K_c) / T(K)
    T(K)       = D(K) + V(K) + o                                      [serial rounds]
    V(K)       = t_target( sum_c n_c * (K_c + 1) / R_target )         one verify pass
    D(K)       = sum_{j=1..max K} t_draft( m_j / R_draft ),  m_j = sum_{c: K_c >= j} n_c
    E(a, K)    = (1 - a^(K+1)) / (1 - a)                              policies.depth

n_c is the number of active requests of class c, R_* the replicas of each pool (requests spread
evenly over them), t_* the pools' fitted cost curves (policies.cost_curve), o a per-round
orchestration overhead (RPC hops). K_c = 0 means target-only: E = 1, one token per request in
the verify batch and no draft step.

Overlap assumption: serial. Every request drafts, then verifies, in lock step, and the draft
steps of all requests in a round run as one batch per step. This ignores the pipelining of a
lone greedy request (drafting ahead), so at low load the model slightly under-rates
speculation; it never over-rates it. Under load the two pools do work concurrently for
different requests, which this model also ignores: it is the conservative bound.

What it does: when t_target is flat in tokens (an accelerator below its compute knee) extra
draft tokens are nearly free, so K goes deep; when t_target is linear in tokens (a saturated
CPU, or a full batch) each extra token costs as much as it is worth times alpha, and K falls to
0. A class with no active requests gets the depth a newly arriving request of that class
should use: it is evaluated as one request beside the current load.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from policies.cost_curve import CostCurve
from policies.depth import expected_tokens_per_round

KEEP_MARGIN = 0.02  # a new K must beat the incumbent by 2% of goodput: no flapping on noise


@dataclass(frozen=True)
class ClassLoad:
    """One request class right now: how many requests are active and how well drafts are accepted."""

    active_requests: int
    accept_rate: float


def round_seconds(loads: Mapping[str, ClassLoad], depths: Mapping[str, int], target_cost: CostCurve,
                  draft_cost: CostCurve | None, target_replicas: int, draft_replicas: int,
                  overhead_s: float = 0.0) -> float:
    """T(K): one lock-step round (all drafting, then one verify pass), in seconds.

    draft_cost None means drafting is free (n-gram lookup, or no draft pool measured)."""
    verify_tokens = sum(load.active_requests * (depths[c] + 1) for c, load in loads.items())
    seconds = target_cost.seconds(verify_tokens / max(1, target_replicas)) + overhead_s
    if draft_cost is not None:
        for step in range(1, max(depths.values(), default=0) + 1):
            drafting = sum(load.active_requests for c, load in loads.items() if depths[c] >= step)
            seconds += draft_cost.seconds(drafting / max(1, draft_replicas))
    return seconds


def goodput_tokens_per_s(loads: Mapping[str, ClassLoad], depths: Mapping[str, int], target_cost: CostCurve,
                         draft_cost: CostCurve | None, target_replicas: int, draft_replicas: int,
                         overhead_s: float = 0.0) -> float:
    """Committed tokens per second of the system at depths K (see the module docstring)."""
    tokens = sum(load.active_requests * expected_tokens_per_round(load.accept_rate, depths[c])
                 for c, load in loads.items())
    seconds = round_seconds(loads, depths, target_cost, draft_cost, target_replicas, draft_replicas, overhead_s)
    return tokens / seconds if seconds > 0 else 0.0


def choose_depths(loads: Mapping[str, ClassLoad], target_cost: CostCurve, draft_cost: CostCurve | None,
                  target_replicas: int, draft_replicas: int, min_k: int, max_k: int,
                  allow_target_only: bool = True, incumbent: Mapping[str, int] | None = None,
                  overhead_s: float = 0.0) -> tuple[dict[str, int], float]:
    """The depths (one per class) with the best goodput, and that goodput in tokens/s.

    Candidates per class: {0 if allowed} ∪ [min_k, max_k]; an exhaustive search (at most 33^2
    evaluations). Among near-equal depths the incumbent wins (KEEP_MARGIN), then the smaller K.
    """
    # A class with nobody active is planned as one newcomer beside the current load.
    planned = {c: load if load.active_requests > 0 else ClassLoad(1, load.accept_rate) for c, load in loads.items()}
    candidates = sorted(set(range(min_k, max_k + 1)) | ({0} if allow_target_only else set()))
    classes = list(planned)

    def score(depths: Mapping[str, int]) -> float:
        return goodput_tokens_per_s(planned, depths, target_cost, draft_cost, target_replicas,
                                    draft_replicas, overhead_s)

    best, best_goodput = None, -1.0
    for combo in itertools.product(candidates, repeat=len(classes)):
        depths = dict(zip(classes, combo))
        value = score(depths)
        if value > best_goodput * (1 + 1e-12):
            best, best_goodput = depths, value
    assert best is not None
    if incumbent is not None and set(incumbent) == set(classes) and all(k in candidates for k in incumbent.values()):
        kept = score(incumbent)
        if kept * (1 + KEEP_MARGIN) >= best_goodput:
            return dict(incumbent), kept
    return best, best_goodput
