"""Per-request speculation depth from the request's own acceptance history.

The performance model (docs/depth-and-autoscaling.md): with per-token acceptance alpha, depth K and
draft/target step-cost ratio c, a round emits E = (1 - alpha^(K+1)) / (1 - alpha) tokens and
costs K*c + 1 target-step equivalents. We pick the K in bounds that maximises E / (K*c + 1).
Alpha comes from policies.acceptance (the truncated-geometric fit with a Beta prior, the same
estimator the benchmark reports), so a new request starts at a sensible depth and one unlucky
round does not collapse it. Costs are measured, not assumed: `RoundCosts` keeps moving
averages of draft step time, target pass time and per-round orchestration overhead (the RPC
hops), all in units of one target pass. Overhead is paid once per round whatever K is, so a
costly transport argues for deeper rounds; a loaded target (slow passes) makes drafting cheaper
relative to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specserve.policies.acceptance import estimate_acceptance_rate, expected_tokens_by_position, expected_tokens_per_round

__all__ = ["RoundCosts", "RoundWallFit", "choose_draft_depth", "expected_speedup", "expected_tokens_per_round"]


def expected_speedup(accept_rate: float, num_draft_tokens: int, draft_cost_ratio: float,
                     overhead_ratio: float = 0.0) -> float:
    """Tokens per unit of target-pass time (serial drafting); with overhead_ratio = 0 this is the
    speedup over target-only decoding, otherwise speedup times (1 + overhead_ratio)."""
    cost = num_draft_tokens * draft_cost_ratio + 1.0 + overhead_ratio
    return expected_tokens_per_round(accept_rate, num_draft_tokens) / cost


def best_depth(accept_rate: float, draft_cost_ratio: float, min_draft_tokens: int, max_draft_tokens: int,
               overhead_ratio: float = 0.0) -> int:
    """The depth K in [min, max] with the best expected throughput at this per-token acceptance."""
    return max(range(min_draft_tokens, max_draft_tokens + 1),
               key=lambda k: expected_speedup(accept_rate, k, draft_cost_ratio, overhead_ratio))


def best_depth_by_position(accept_by_position: tuple[float, ...], draft_cost_ratio: float, min_draft_tokens: int,
                           max_draft_tokens: int, overhead_ratio: float = 0.0) -> int:
    """`best_depth` with acceptance by position (policies.acceptance: where drafts are taken in
    streaks, one alpha under-rates deep blocks); rates must cover max_draft_tokens positions."""
    def speedup(k: int) -> float:
        return expected_tokens_by_position(accept_by_position, k) / (k * draft_cost_ratio + 1.0 + overhead_ratio)
    return max(range(min_draft_tokens, max_draft_tokens + 1), key=speedup)


def choose_draft_depth(num_accepted: int, num_drafted: int, draft_cost_ratio: float,
                       min_draft_tokens: int, max_draft_tokens: int, overhead_ratio: float = 0.0,
                       *, num_rounds: int) -> int:
    """The depth K in [min, max] with the best expected throughput for this request so far.

    num_rounds (rounds that drafted at least one token, `SpeculationStats.rounds`) is needed:
    alpha cannot be recovered from accepted and drafted alone."""
    accept_rate = estimate_acceptance_rate(num_accepted, num_drafted, num_rounds)
    return best_depth(accept_rate, draft_cost_ratio, min_draft_tokens, max_draft_tokens, overhead_ratio)


@dataclass
class RoundCosts:
    """Exponential moving averages of what a round costs, seeded with a configured ratio."""

    draft_cost_ratio: float            # one draft step / one target pass
    overhead_ratio: float = 0.0        # per-round orchestration overhead / one target pass
    smoothing: float = 0.1
    _draft_step_s: float | None = None
    _target_pass_s: float | None = None
    _overhead_s: float | None = None

    def observe_draft(self, draft_s: float, num_draft_tokens: int) -> None:
        """Fold in one drafting call: engine seconds for num_draft_tokens (drafted ahead or not)."""
        if num_draft_tokens > 0:
            self._draft_step_s = self._ema(self._draft_step_s, draft_s / num_draft_tokens)
            self._update_ratios()

    def observe_round(self, target_s: float, overhead_s: float) -> None:
        """Fold in one round: target engine seconds and orchestration overhead."""
        self._target_pass_s = self._ema(self._target_pass_s, target_s)
        self._overhead_s = self._ema(self._overhead_s, max(0.0, overhead_s))
        self._update_ratios()

    @property
    def overhead_s(self) -> float | None:
        """Measured per-round orchestration overhead (seconds), None before the first round."""
        return self._overhead_s

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def _update_ratios(self) -> None:
        if self._target_pass_s and self._target_pass_s > 0:
            if self._draft_step_s is not None:
                self.draft_cost_ratio = self._draft_step_s / self._target_pass_s
            if self._overhead_s is not None:
                self.overhead_ratio = self._overhead_s / self._target_pass_s


@dataclass
class RoundWallFit:
    """What a lone request's round of depth K costs on the wall clock: a line a + b*K, fitted.

    Why not the engines' own seconds (RoundCosts): the draft engine pre-drafts the next block
    while the target verifies (decoding.speculation_cache), so a round's draft time hides behind
    the verify on a hit and is paid on a miss; pre-drafts share the CPU with the verify; the
    verify itself grows with K. None of that is in "K draft steps + one target pass", and on a CPU box a wall-clock draft token costs several times its engine seconds
    (docs/depth-and-autoscaling.md has the measurements and the A/B against engine seconds).
    Least squares with exponential forgetting follows the box as it drifts; until
    K has varied enough to tell a slope from noise (`min_k_spread`, the weighted standard deviation
    of K) there is no line, and the last identified line is kept when K later settles. A kept line
    is never tested again by rounds at K settled on one depth, so `needs_spread` says when the
    chooser should draft a round at another depth (policies.depth_chooser)."""

    forgetting: float = 0.98          # a round's weight decays by this per later round (~50 rounds of memory)
    min_k_spread: float = 1.0
    min_weight: float = 10.0
    _w: float = 0.0
    _wk: float = 0.0
    _wkk: float = 0.0
    _wy: float = 0.0
    _wky: float = 0.0
    _line: tuple[float, float] | None = None

    def observe(self, num_draft_tokens: int, wall_s: float) -> None:
        """Fold in one lone round that verified num_draft_tokens (>= 1) and took wall_s."""
        f, k, y = self.forgetting, float(num_draft_tokens), wall_s
        self._w, self._wk, self._wkk = f * self._w + 1.0, f * self._wk + k, f * self._wkk + k * k
        self._wy, self._wky = f * self._wy + y, f * self._wky + k * y
        if self._w < self.min_weight:
            return
        mean_k = self._wk / self._w
        var_k = self._k_variance()
        if var_k < self.min_k_spread ** 2:
            return
        slope = (self._wky / self._w - mean_k * self._wy / self._w) / var_k
        intercept = self._wy / self._w - slope * mean_k
        if intercept > 0 and math.isfinite(slope):
            self._line = (intercept, max(0.0, slope))

    def _k_variance(self) -> float:
        mean_k = self._wk / self._w
        return self._wkk / self._w - mean_k * mean_k

    @property
    def mean_k(self) -> float | None:
        """The recent rounds' (forgetting-weighted) mean K; None before any round."""
        return self._wk / self._w if self._w else None

    @property
    def needs_spread(self) -> bool:
        """Enough recent rounds, but their K has varied too little to refit the line: rounds at
        other depths are what would tell whether the line still holds."""
        return self._w >= self.min_weight and self._k_variance() < self.min_k_spread ** 2

    @property
    def line(self) -> tuple[float, float] | None:
        """(a, b) in seconds: a round of depth K costs a + b*K; None until identifiable."""
        return self._line

    def cost_ratios(self) -> tuple[float, float] | None:
        """The line as best_depth's (draft_cost_ratio, overhead_ratio): in units of a, a round
        costs 1 + K * b/a, the same maximiser as a + b*K."""
        if self._line is None:
            return None
        intercept, slope = self._line
        return slope / intercept, 0.0
