"""Speculation depth per request class from cluster-wide load: the goodput model.

In the spirit of SmartSpec/TurboSpec: speculation is worth it only while the target's batched
forward is cheap in extra tokens. At the current load we choose, for each request class c
(greedy, sampled), the depth K_c that maximises committed tokens per second of the whole system:

    goodput(K) = sum_c n_c * E(alpha_c, K_c) / T(K)
    T(K)       = D(K) + V(K) + o                                      [serial rounds]
    V(K)       = t_target( sum_c n_c * (K_c + 1) / R_target )         one verify pass
    D(K)       = sum_{j=1..max K} t_draft( m_j / R_draft ),  m_j = sum_{c: K_c >= j} n_c
    E_c(K)     = 1 + sum_{k<=K} a_c,1 * ... * a_c,k                    policies.acceptance

n_c is the number of active requests of class c, R_* the replicas of each pool (requests spread
evenly over them), t_* the pools' fitted cost curves (policies.cost_curve), o a per-round
orchestration overhead (RPC hops), a_c,j the class's measured chance that draft position j is
accepted given the earlier ones were (geometric, a_c,j = alpha_c, when no positions were
counted; policies.acceptance says why by position). K_c = 0 means target-only: E = 1, one token per request in
the verify batch and no draft step. When every class is target-only, a round decodes S tokens
in the target before the router sees it (speculation.target_only_steps), so o is paid once per
S passes: o / S a pass. Mixed, the rounds are charged in lock step as above (target-only
requests are charged the whole o, which under-rates them a little).

Overlap. One request alone drafts, then verifies (serial; its pipelining, drafting ahead, is
ignored, so the model slightly under-rates speculation there). With two or more requests the
pools work at the same time for different requests: the engines batch whatever is waiting when
a forward ends, so requests fall into groups that alternate, one drafting while the other
verifies. We take the better of the two schedules the engines can fall into:

    lock step    T = D(n) + V(n) + o
    alternating  T = max(D(n/2) + V(n/2) + o, 2 * max(D(n/2), V(n/2)))

(two halves; in one cycle each half drafts once and verifies once, and a half's own round must
fit in the cycle). Why it matters: charging drafting serially under load made the model draft
shallower than the best pinned K at 2 streams (docs/depth-and-autoscaling.md).

What it does: when t_target is flat in tokens (an accelerator below its compute knee) extra
draft tokens are nearly free, so K goes deep; when t_target is linear in tokens (a saturated
CPU, or a full batch) each extra token costs as much as it is worth times alpha, and K falls to
0. A class with no active requests gets the depth a newly arriving request of that class
should use: it is evaluated as one request beside the current load.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, replace

from specserve.policies.cost_curve import CostCurve
from specserve.policies.acceptance import expected_tokens_by_position, expected_tokens_per_round

KEEP_MARGIN = 0.02  # a new K must beat the incumbent by 2% of goodput: no flapping on noise


@dataclass(frozen=True)
class ClassLoad:
    """One request class right now: how many requests are active and how well drafts are accepted."""

    active_requests: float  # a count; fractional when the model splits a load in halves
    accept_rate: float
    accept_by_position: tuple[float, ...] = ()  # alpha_j, j = 1..max K; empty: geometric in accept_rate

    def expected_tokens(self, num_draft_tokens: int) -> float:
        """Tokens one round of this class emits at depth K."""
        if num_draft_tokens <= len(self.accept_by_position):
            return expected_tokens_by_position(self.accept_by_position, num_draft_tokens)
        return expected_tokens_per_round(self.accept_rate, num_draft_tokens)


def round_seconds(loads: Mapping[str, ClassLoad], depths: Mapping[str, int], target_cost: CostCurve,
                  draft_cost: CostCurve | None, target_replicas: int, draft_replicas: int,
                  overhead_s: float = 0.0, target_only_steps: int = 1) -> float:
    """T(K): the time for every active request to advance one round, in seconds: lock step, or
    with two or more requests the alternating schedule when it is faster (module docstring).

    draft_cost None means drafting is free (n-gram lookup, or no draft pool measured).
    target_only_steps: target passes a target-only round runs per overhead (module docstring)."""
    if all(depth == 0 for depth in depths.values()):
        overhead_s /= max(1, target_only_steps)
    draft_s, verify_s = _pool_seconds(loads, depths, target_cost, draft_cost, target_replicas, draft_replicas)
    lock_step = draft_s + verify_s + overhead_s
    if draft_s == 0.0 or sum(load.active_requests for load in loads.values()) < 2:
        return lock_step
    halves = {c: replace(load, active_requests=load.active_requests / 2) for c, load in loads.items()}
    draft_half, verify_half = _pool_seconds(halves, depths, target_cost, draft_cost, target_replicas, draft_replicas)
    alternating = max(draft_half + verify_half + overhead_s, 2 * max(draft_half, verify_half))
    return min(lock_step, alternating)


def _pool_seconds(loads: Mapping[str, ClassLoad], depths: Mapping[str, int], target_cost: CostCurve,
                  draft_cost: CostCurve | None, target_replicas: int, draft_replicas: int) -> tuple[float, float]:
    """(D, V): the draft pool's K batched steps and the target pool's one verify pass for these loads."""
    verify_tokens = sum(load.active_requests * (depths[c] + 1) for c, load in loads.items())
    verify_s = target_cost.seconds(verify_tokens / max(1, target_replicas))
    draft_s = 0.0
    if draft_cost is not None:
        for step in range(1, max(depths.values(), default=0) + 1):
            drafting = sum(load.active_requests for c, load in loads.items() if depths[c] >= step)
            if drafting > 0:
                draft_s += draft_cost.seconds(drafting / max(1, draft_replicas))
    return draft_s, verify_s


def goodput_tokens_per_s(loads: Mapping[str, ClassLoad], depths: Mapping[str, int], target_cost: CostCurve,
                         draft_cost: CostCurve | None, target_replicas: int, draft_replicas: int,
                         overhead_s: float = 0.0, target_only_steps: int = 1) -> float:
    """Committed tokens per second of the system at depths K (see the module docstring)."""
    tokens = sum(load.active_requests * load.expected_tokens(depths[c]) for c, load in loads.items())
    seconds = round_seconds(loads, depths, target_cost, draft_cost, target_replicas, draft_replicas, overhead_s,
                            target_only_steps)
    return tokens / seconds if seconds > 0 else 0.0


def planned_loads(loads: Mapping[str, ClassLoad]) -> dict[str, ClassLoad]:
    """The loads depths are chosen for: a class with nobody active is planned as one newcomer
    beside the current load (the depth a request of that class arriving now should use)."""
    return {c: load if load.active_requests > 0 else replace(load, active_requests=1) for c, load in loads.items()}


def choose_depths(loads: Mapping[str, ClassLoad], target_cost: CostCurve, draft_cost: CostCurve | None,
                  target_replicas: int, draft_replicas: int, min_k: int, max_k: int,
                  allow_target_only: bool = True, incumbent: Mapping[str, int] | None = None,
                  overhead_s: float = 0.0, target_only_steps: int = 1) -> tuple[dict[str, int], float]:
    """The depths (one per class) with the best goodput, and that goodput in tokens/s.

    Candidates per class: {0 if allowed} ∪ [min_k, max_k]; an exhaustive search (at most 33^2
    evaluations). Among near-equal depths the incumbent wins (KEEP_MARGIN), then the smaller K.
    """
    planned = planned_loads(loads)
    candidates = sorted(set(range(min_k, max_k + 1)) | ({0} if allow_target_only else set()))
    classes = list(planned)

    def score(depths: Mapping[str, int]) -> float:
        return goodput_tokens_per_s(planned, depths, target_cost, draft_cost, target_replicas,
                                    draft_replicas, overhead_s, target_only_steps)

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
