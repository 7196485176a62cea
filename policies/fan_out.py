"""How many blocks a request pre-drafts per round (the speculation cache's fan-out) under load,
and which verification outcomes they go to (`share_fan_out`).

Pre-drafts are optional work on the draft pool: on a hit they take the draft off the round's
critical path, but every block pre-drafted costs draft forwards whether it is used or not. While
the draft devices have room, the configured fan-out costs nothing the rounds wait on; as their busy
share (pre-drafts included: PoolLoad.busy_share_all) climbs towards saturation, pre-drafts would
delay the calls rounds wait on, so the fan-out shrinks linearly to 0 (plain rounds). Pre-drafts
count as idle in the share that scales the pool (busy_share): optional work gives way before
replicas are added. The thresholds are the autoscaler's (policies.replicas.ScalingThresholds).
Where draft and target share cores or a device, pre-drafts also slow the target's verify, which no
busy share shows: `FanOutPayoff` measures whether rounds with the fan-out are faster than without,
and the router keeps it only where they are. docs/speculation-cache.md has the measurements.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.decoding.draft_odds import DraftOdds
from specserve.policies.replicas import PoolLoad, ScalingThresholds


@dataclass(frozen=True)
class FanOut:
    """A round's pre-drafting as the router asks the draft engine for it: `blocks` to pre-draft
    (policies.depth_chooser.DepthChooser.fan_out; empty: none), shared out over the outcomes of
    verifying the round's block, each drafted `depth` tokens deep (DepthChooser.predraft_depth)."""

    blocks: tuple[int, ...] = ()
    depth: int = 0


def may_predraft(proposer: str, seeded_sampled: bool) -> bool:
    """Whether a request's rounds may pre-draft, by what drafts: a draft model's always (a hit's
    block is the very block drafting just in time would draw); an EAGLE-3 head's unless the
    request is seeded and sampled, since a head pre-drafts from its own features where drafting
    just in time reads the target's, so a seeded text would depend on which of the two load let a
    round use (docs/eagle3.md#serving); n-grams and target-only never."""
    return proposer == "draft" or (proposer == "eagle3" and not seeded_sampled)


def fan_out_under_load(configured: int, draft: PoolLoad | None,
                       thresholds: ScalingThresholds = ScalingThresholds()) -> int:
    """The fan-out for the draft pool's load: configured while its busy share (pre-drafts
    included) is at most thresholds.busy_low, 0 at or above thresholds.busy_high, linear between;
    configured when the pool has not reported."""
    if configured <= 0 or draft is None:
        return max(configured, 0)
    share = draft.busy_share if draft.busy_share_all is None else draft.busy_share_all
    low, high = thresholds.busy_low, thresholds.busy_high
    if share <= low:
        return configured
    if share >= high:
        return 0
    return int(configured * (high - share) / (high - low))


# A steady round's wall time counts in its side's mean this much at least (an EMA over about the
# last 1/PAYOFF_SMOOTHING rounds once there are that many); each side needs PAYOFF_MIN_ROUNDS first.
PAYOFF_SMOOTHING = 0.2
PAYOFF_MIN_ROUNDS = 3


class FanOutPayoff:
    """Whether pre-drafting makes a request class's rounds faster, measured: the mean wall time of
    steady rounds with the fan-out on (the round pre-drafts, and the one before it did, so its block
    may have been ready) against steady rounds with it off (neither did), at each depth K. Wall time
    takes everything in: the hits' saved drafting, the misses' wait behind pre-drafts in flight, and
    the target's verify slowed by pre-drafts computing beside it, where draft and target share cores
    or a device. Committed tokens per round do not depend on the fan-out (a hit's block is the one
    drafting just in time would draw), so the faster side makes more tokens a second.

    One verdict for every depth, from the depths measured both ways: a verdict per depth would
    make a round's cost depend on K in two ways at once, and the depth chooser, which fits one
    line of wall time against K, would then read the fan-out's switches as the cost of depth."""

    def __init__(self) -> None:
        self._walls: dict[tuple[int, bool], tuple[float, int]] = {}   # (K, on) -> (mean wall s, rounds)

    def observe(self, num_drafted: int, predrafting: bool, wall_s: float) -> None:
        """A steady round of depth num_drafted: predrafting, with the fan-out on, else off."""
        mean, count = self._walls.get((num_drafted, predrafting), (0.0, 0))
        count += 1
        self._walls[num_drafted, predrafting] = (mean + max(PAYOFF_SMOOTHING, 1 / count) * (wall_s - mean), count)

    def pays(self) -> bool | None:
        """True when rounds with the fan-out measure no longer than rounds without it (the geometric
        mean of their ratio over the depths with PAYOFF_MIN_ROUNDS steady rounds each way is at most
        1), False when longer, None until some depth has them."""
        ratios = []
        for (depth, on), (on_wall, on_count) in self._walls.items():
            off_wall, off_count = self._walls.get((depth, False), (0.0, 0))
            if on and min(on_count, off_count) >= PAYOFF_MIN_ROUNDS and off_wall > 0:
                ratios.append(on_wall / off_wall)
        return None if not ratios else statistics.geometric_mean(ratios) <= 1.0


# Past this many of the draft's ranks, a guess of the bonus token is not worth a block.
MAX_BONUS_GUESSES = 4
ACCEPT_BINS = 10         # the draft's acceptance estimate is calibrated in bins of this width 1/ACCEPT_BINS
PRIOR_ROUNDS = 2.0       # how many observations the priors below are worth
MAX_RANKS = 16           # ranks of candidates tracked (the fan-out's bound)


def accept_odds(odds: DraftOdds) -> float:
    """The draft's own estimate that the target keeps its drafted token, its row standing in for
    the target's: greedy, its probability of its argmax; sampled, min(1, q(d) / q_drawn(d))
    (rejection sampling's acceptance where p = q). Raw: OutcomeCalibration says what it means."""
    if odds.drafted_drawn is None:
        return min(max(odds.drafted_q, 0.0), 1.0)
    return 1.0 if odds.drafted_drawn <= 0 else min(odds.drafted_q / odds.drafted_drawn, 1.0)


def recovered_order(odds: DraftOdds, candidates: Sequence[int], drafted: int) -> list[int]:
    """The candidates other than the drafted token, likeliest first to be the token emitted where
    the drafted one is rejected, the draft's row standing in for the target's: sampled from a
    lowered q (Saguaro sampling), by the residual max(q - q_drawn, 0), then by q; greedy, by q
    (a greedy target's argmax differs from a rejected token)."""
    drawn = odds.candidate_drawn or (0.0,) * len(candidates)
    keyed = [(-max(q - d, 0.0) if odds.candidate_drawn is not None else 0.0, -q, rank, token)
             for rank, (token, q, d) in enumerate(zip(candidates, odds.candidate_q, drawn)) if token != drafted]
    return [token for *_, token in sorted(keyed)]


class OutcomeCalibration:
    """What the draft's numbers turn out to mean, learned from the rounds its engine sees: the
    share of drafted tokens kept by acceptance estimate (accept_odds, in bins), and how often the
    token emitted at a rejection is the draft's i-th alternative (recovered_order), and the bonus
    token its i-th likeliest. A small draft's raw probabilities are far from calibrated (its argmax
    is often kept at a probability of 0.1), so these, not the raw numbers, share the fan-out out.
    Priors worth PRIOR_ROUNDS observations: the estimate itself, and the draft's average ranking."""

    def __init__(self) -> None:
        self.kept = [PRIOR_ROUNDS * (index + 0.5) / ACCEPT_BINS for index in range(ACCEPT_BINS)]
        self.seen = [PRIOR_ROUNDS] * ACCEPT_BINS
        geometric = [PRIOR_ROUNDS * 0.5 ** (rank + 1) for rank in range(MAX_RANKS)]
        self.recovered = list(geometric)      # by rank among the alternatives; the rest: none of them
        self.recovered_total = PRIOR_ROUNDS
        self.bonus = list(geometric)
        self.bonus_total = PRIOR_ROUNDS

    def accept(self, estimate: float) -> float:
        index = min(int(min(max(estimate, 0.0), 1.0) * ACCEPT_BINS), ACCEPT_BINS - 1)
        return self.kept[index] / self.seen[index]

    def recovered_chance(self, rank: int) -> float:
        return self.recovered[rank] / self.recovered_total if rank < MAX_RANKS else 0.0

    def bonus_chance(self, rank: int) -> float:
        return self.bonus[rank] / self.bonus_total if rank < MAX_RANKS else 0.0

    def observe(self, block: Sequence[int], candidates: Sequence[Sequence[int]], odds: Sequence[DraftOdds],
                emitted: Sequence[int], bonus_guesses: Sequence[int | None] = ()) -> None:
        """One verified block: emitted, the tokens the round committed after it (the kept drafted
        tokens, then the recovered or bonus token); bonus_guesses[i], the bonus pre-draft's guess
        of rank i where it was drafted (None: not known)."""
        kept = 0
        while kept < min(len(block), len(emitted)) and emitted[kept] == block[kept]:
            kept += 1
        for position in range(min(kept + 1, len(block), len(odds))):
            if position == kept and len(emitted) <= kept:
                break    # the request ended there: no verdict
            index = min(int(min(max(accept_odds(odds[position]), 0.0), 1.0) * ACCEPT_BINS), ACCEPT_BINS - 1)
            self.seen[index] += 1
            self.kept[index] += position < kept
        if kept < len(block) and len(emitted) > kept and kept < len(candidates) and kept < len(odds):
            order = recovered_order(odds[kept], candidates[kept], block[kept])
            self.recovered_total += 1
            if emitted[kept] in order[:MAX_RANKS]:
                self.recovered[order.index(emitted[kept])] += 1
        elif kept == len(block) and len(emitted) > kept:
            known = list(bonus_guesses)
            if emitted[kept] in known:
                self.bonus_total += 1
                self.bonus[known.index(emitted[kept])] += 1
            elif known and None not in known:   # none of the guesses: beyond them
                self.bonus_total += 1


def share_fan_out(block: Sequence[int], candidates: Sequence[Sequence[int]], odds: Sequence[DraftOdds],
                  budget: int, calibration: OutcomeCalibration | None = None,
                  max_bonus_guesses: int = MAX_BONUS_GUESSES) -> list[tuple[int, int]]:
    """Which budget blocks to pre-draft for the outcomes of verifying block: the budget most
    likely (outcome, token) pairs, most likely first, as decoding.speculation_cache.predrafts
    takes them ((a, t): keep a drafted tokens and emit t; (K, i): all kept, the bonus token
    guessed as the draft's i-th most likely). P(a) = acc_1 ... acc_a (1 - acc_(a+1)), each
    position's acc its accept_odds as calibration reads it; the emitted token is the i-th of the
    position's recovered_order with calibration's chance for rank i, the bonus token the draft's
    i-th likeliest with its chance. From this round's own numbers, so a confident block puts its
    blocks on the bonus and a shaky one on its first positions."""
    if budget <= 0 or not block:
        return []
    if len(candidates) < len(block) or len(odds) < len(block):
        raise ValueError(f"need candidates and odds for each of the {len(block)} drafted tokens, "
                         f"got {len(candidates)} and {len(odds)}")
    calibration = calibration or OutcomeCalibration()
    options: list[tuple[float, int, int]] = []
    reached = 1.0
    for position, (drafted, ranked, numbers) in enumerate(zip(block, candidates, odds)):
        accept = calibration.accept(accept_odds(numbers))
        for rank, token in enumerate(recovered_order(numbers, ranked, drafted)[:MAX_RANKS]):
            options.append((reached * (1.0 - accept) * calibration.recovered_chance(rank), position, token))
        reached *= accept
    for rank in range(min(max_bonus_guesses, budget)):
        options.append((reached * calibration.bonus_chance(rank), len(block), rank))
    options.sort(key=lambda option: (-option[0], option[1], option[2]))
    return [(outcome, token) for _, outcome, token in options[:budget]]
