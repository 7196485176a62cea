"""One router's choice of a request's draft depth K, and everything it learns that choice from.

A router learns from its own rounds (per-class acceptance counters by position, the engines'
measured costs, the wall-clock line of lone rounds) and from the policy actor's cluster-wide
decision. `DepthChooser` holds all of it, takes one observation per round, and answers `choose`
for a request and `typical_depth` for `specserve status`: the round loop and status ask the same
object, and tests drive it without Ray. The clock is passed in, so nothing here reads time.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from specserve.common.config import SpeculationSpec
from specserve.common.messages import REQUEST_CLASSES, ClassReport, PolicyDecision
from specserve.decoding.sequence import RequestState
from specserve.policies.acceptance import count_round_positions, position_accept_rates, request_position_rates
from specserve.policies.depth import RoundCosts, RoundWallFit, best_depth_by_position, choose_draft_depth
from specserve.policies.fan_out import FanOutPayoff
from specserve.policies.load import accept_rate_from_rounds

POLICY_STALE_S = 30.0  # a decision older than this (actor gone) is dropped: per-request depth only
# The speculation cache pays only where its blocks get used: a class whose recent rounds hit less
# than MIN_HIT_SHARE of the time stops pre-drafting, and looks again one round in PROBE_EVERY.
MIN_HIT_SHARE = 0.3
HIT_SMOOTHING = 0.05       # the hit share is an EMA over about the last 20 rounds that pre-drafted
PROBE_EVERY = 20
# A request's rounds that run the other way than the fan-out's measured payoff says, in every
# PROBE_EVERY, so both sides stay measured: two in a row, as only the second is a steady round.
PAYOFF_PROBE_ROUNDS = 2
# Where in its PROBE_EVERY rounds a lone request drafts at another depth while its class's wall
# line cannot be refitted (RoundWallFit.needs_spread): away from the payoff's probe rounds.
DEPTH_PROBE_PHASE = PROBE_EVERY // 2


def request_class(state: RequestState) -> str:
    return "greedy" if state.params.is_greedy else "sampled"


@dataclass
class ClassCounters:
    """Cumulative rounds of one request class on this router: what the policy actor's goodput
    model reads (policies.load), and the prior a request's own acceptance leans on."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    reached: list[int] = field(default_factory=list)       # by draft position (policies.acceptance)
    accepted_at: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.rounds += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        count_round_positions(self.reached, self.accepted_at, num_drafted, num_accepted)

    def position_rates(self, depth: int) -> tuple[float, ...]:
        """Acceptance by position for K up to depth, leaning on the class's geometric alpha."""
        alpha = accept_rate_from_rounds(self.rounds, self.drafted, self.accepted)
        return position_accept_rates(self.reached, self.accepted_at, depth, alpha)

    def as_report(self) -> ClassReport:
        return ClassReport(self.rounds, self.drafted, self.accepted, tuple(self.reached), tuple(self.accepted_at))


class DepthChooser:
    """K per round. With company (more than one active request) the policy actor's depth for the
    request's class is used as it is: its goodput model sees the batched cost curves and the load,
    which one request's view does not (per-request choices, and refining the class's depth by the
    request's own acceptance, both measured slower: docs/depth-and-autoscaling.md). Alone, `_lone`.
    0 from the policy: speculation does not pay now. A seeded request's K must not depend on
    timing or load (its random draws follow K), so it uses the configured cost ratio and no policy."""

    def __init__(self, speculation: SpeculationSpec) -> None:
        self.spec = speculation
        # Measured costs, shared by the router's requests: they reflect the engines' current load.
        self.round_costs = RoundCosts(draft_cost_ratio=speculation.draft_cost_ratio)
        # What a round of depth K costs end to end when its request is alone, per class (greedy
        # rounds draft ahead, sampled ones do not): how a lone request picks K.
        self.lone_round_walls = {c: RoundWallFit() for c in REQUEST_CLASSES}
        self.class_counters = {c: ClassCounters() for c in REQUEST_CLASSES}
        self.policy_decision: PolicyDecision | None = None
        self.policy_decision_at = float("-inf")
        # Per class: the recent share of rounds whose block was pre-drafted (starts hopeful), and
        # rounds since the class last pre-drafted while its share is low.
        self.hit_share = {c: 0.5 for c in REQUEST_CLASSES}
        self._rounds_since_probe = {c: 0 for c in REQUEST_CLASSES}
        # Per class: whether rounds with the fan-out measure faster than rounds without it.
        self.fan_out_payoff = {c: FanOutPayoff() for c in REQUEST_CLASSES}

    def set_policy_decision(self, decision: PolicyDecision | None, now: float) -> None:
        self.policy_decision, self.policy_decision_at = decision, now

    def fresh_decision(self, now: float) -> PolicyDecision | None:
        """The policy actor's decision, unless it is older than POLICY_STALE_S (or there is none)."""
        if self.policy_decision is None or now - self.policy_decision_at > POLICY_STALE_S:
            return None
        return self.policy_decision

    def policy_depth(self, klass: str, now: float) -> int | None:
        """The depth the policy actor allows this request class now, or None (no fresh decision)."""
        decision = self.fresh_decision(now)
        return None if decision is None else decision.num_draft_tokens.get(klass)

    def choose(self, state: RequestState, num_active: int, now: float) -> int:
        """K for this round of state's request, with num_active requests on the router."""
        spec = self.spec
        if not spec.adaptive:
            return state.draft_budget(spec.num_draft_tokens)
        if state.params.seed is not None:
            if spec.max_draft_tokens <= 0:
                return 0
            stats = state.stats
            return state.draft_budget(choose_draft_depth(
                stats.num_accepted, stats.num_drafted, spec.draft_cost_ratio, spec.min_draft_tokens,
                spec.max_draft_tokens, 0.0, num_rounds=stats.rounds))
        klass = request_class(state)
        policy_depth = self.policy_depth(klass, now)
        if policy_depth is not None and num_active > 1:
            return state.draft_budget(min(spec.max_draft_tokens, policy_depth))
        probe = self._depth_probe(state, klass, policy_depth, num_active, state.stats.rounds)
        if probe is not None:
            return state.draft_budget(probe)
        return state.draft_budget(self._lone(klass, state.draft_reached, state.draft_accepted_at, policy_depth,
                                             num_active))

    def predraft_depth(self, state: RequestState, num_draft: int, num_active: int, now: float) -> int:
        """How many tokens each pre-draft of this round's outcomes drafts: this round's depth, or
        the next round's where that round is a depth probe deeper than this one. A pre-drafted
        block shorter than its round's depth cannot be used, so a probe would otherwise always
        miss and measure drafting just in time rather than the depth."""
        if not self.spec.adaptive or state.params.seed is not None or num_draft <= 0:
            return num_draft
        klass = request_class(state)
        probe = self._depth_probe(state, klass, self.policy_depth(klass, now), num_active, state.stats.rounds + 1)
        return num_draft if probe is None else max(num_draft, probe)

    def _depth_probe(self, state: RequestState, klass: str, cap: int | None, num_active: int,
                     round_index: int) -> int | None:
        """The depth a lone request drafts at in its round round_index, or None to choose as usual.

        Why: the lone line (RoundWallFit) is refitted only from rounds whose K varies; once K
        settles on one depth the last line is kept, and a line learnt steep (the box was busy, or
        the speculation cache's misses made deep rounds look dear) keeps K shallow for good. While
        the line cannot be refitted, one round in PROBE_EVERY, at an offset of the request's own,
        drafts at the end of the allowed depths farther from where K has been."""
        fit = self.lone_round_walls[klass]
        if num_active > 1 or not fit.needs_spread or self._probe_phase(state, round_index) != DEPTH_PROBE_PHASE:
            return None
        low, high = self._depth_bounds(cap)
        if high <= 0:
            return None
        return high if high - fit.mean_k >= fit.mean_k - low else low

    @staticmethod
    def _probe_phase(state: RequestState, round_index: int) -> int:
        """Where round round_index falls in the request's PROBE_EVERY rounds: each request at an
        offset of its own, so requests shorter than PROBE_EVERY rounds probe too, at different rounds."""
        return (round_index + zlib.crc32(state.request_id.encode())) % PROBE_EVERY

    def fan_out(self, state: RequestState, num_draft: int, num_active: int, now: float) -> tuple[int, ...]:
        """(blocks to pre-draft for this round's outcomes,) or () for none: the draft engine shares
        them out over the outcomes from its own numbers once the block is drafted
        (policies.fan_out.share_fan_out). The fan-out is the configured one alone, the policy's (lowered as the draft pool fills)
        beside other requests, and none past speculation.fan_out_max_batch requests in flight, nor
        while the class's recent rounds hit less than MIN_HIT_SHARE (but for a probe one round in
        PROBE_EVERY, to see whether that changed), nor, with speculation.fan_out_measured, where
        the class's rounds measure slower with it than without (FanOutPayoff; each
        request runs PAYOFF_PROBE_ROUNDS of every PROBE_EVERY rounds the other way). Load may
        decide it even for a seeded request: a hit's block is the one drafting just in time would
        have drawn, so the fan-out changes speed, never the output."""
        budget = self.spec.fan_out if num_active <= self.spec.fan_out_max_batch else 0
        klass = request_class(state)
        if budget and self.hit_share[klass] < MIN_HIT_SHARE:
            self._rounds_since_probe[klass] += 1
            if self._rounds_since_probe[klass] < PROBE_EVERY:
                return ()
            self._rounds_since_probe[klass] = 0
        if budget and self.spec.fan_out_measured:
            probing = self._probe_phase(state, state.stats.rounds) < PAYOFF_PROBE_ROUNDS
            if probing == (self.fan_out_payoff[klass].pays() is not False):
                return ()
        decision = self.fresh_decision(now)
        if num_active > 1 and decision is not None and decision.fan_out is not None:
            budget = min(budget, decision.fan_out)
        if budget <= 0 or num_draft <= 0:
            return ()
        return (budget,)

    def observe_fan_out_round(self, klass: str, num_drafted: int, predrafting: bool, wall_s: float) -> None:
        """A steady round (deployments.round_record.RoundRecord.predrafting): with the fan-out on
        or off, for FanOutPayoff."""
        self.fan_out_payoff[klass].observe(num_drafted, predrafting, wall_s)

    def observe_cache(self, klass: str, hit: bool) -> None:
        """A round of this class whose previous round pre-drafted: was its block there?"""
        self.hit_share[klass] += HIT_SMOOTHING * (float(hit) - self.hit_share[klass])

    def typical_depth(self, num_active: int, now: float) -> int:
        """The depth a fresh greedy, unseeded request would get now (`specserve status`): the
        policy's beside other requests, the lone choice when there are none."""
        spec = self.spec
        if not spec.adaptive:
            return spec.num_draft_tokens
        cap = self.policy_depth("greedy", now)
        if cap is not None and num_active:
            return min(spec.max_draft_tokens, cap)
        return self._lone("greedy", [], [], cap, num_active)

    def _lone(self, klass: str, reached: list[int], accepted_at: list[int], cap: int | None,
              num_active: int) -> int:
        """K for a request of this class with these rounds by position, as if alone: the policy's
        depth (cap) bounds it, and within it the request's own acceptance by position (leaning on
        its class's, policies.acceptance) and what a round costs choose, so an easy prompt drafts
        deeper than a hard one. The cost is the wall-clock line a + b*K of this class's lone
        rounds (RoundWallFit) once K has varied enough to fit one, else the engines' seconds
        (also with company but no policy decision)."""
        low, high = self._depth_bounds(cap)
        if high <= 0:
            return 0
        lone_ratios = self.lone_round_walls[klass].cost_ratios()
        if lone_ratios is not None and num_active <= 1:
            cost_ratio, overhead_ratio = lone_ratios
        else:
            cost_ratio, overhead_ratio = self.round_costs.draft_cost_ratio, self.round_costs.overhead_ratio
        rates = request_position_rates(reached, accepted_at, self.class_counters[klass].position_rates(high))
        return best_depth_by_position(rates, cost_ratio, low, high, overhead_ratio)

    def _depth_bounds(self, cap: int | None) -> tuple[int, int]:
        """(lowest, highest) depth a request may draft at under the policy's depth cap."""
        low, high = self.spec.min_draft_tokens, self.spec.max_draft_tokens
        if cap is not None:
            high = min(high, cap)
            low = min(low, high)
        return low, high

    def observe_draft(self, engine_s: float, num_tokens: int) -> None:
        """One drafting call's own engine seconds (drafted ahead or not), for the cost ratio."""
        self.round_costs.observe_draft(engine_s, num_tokens)

    def observe_round(self, klass: str, num_drafted: int, num_accepted: int, wall_s: float, target_s: float,
                      overhead_s: float, alone: bool) -> None:
        """One finished round: its class counters, the engines' costs and, for a round that ran
        alone from start to end, the lone wall-clock line."""
        if num_drafted:
            self.class_counters[klass].observe(num_drafted, num_accepted)
        self.round_costs.observe_round(target_s, overhead_s)
        if num_drafted and alone:
            self.lone_round_walls[klass].observe(num_drafted, wall_s)

    def counters_report(self) -> dict[str, ClassReport]:
        return {klass: counters.as_report() for klass, counters in self.class_counters.items()}
