"""Goodput model and cost curve: K goes deep when verify is flat in tokens, to 0 when it is linear."""

import numpy as np
import pytest

from specserve.policies.cost_curve import CostCurve, fit_cost_curve
from specserve.policies.acceptance import expected_tokens_per_round
from specserve.policies.goodput import ClassLoad, choose_depths, goodput_tokens_per_s, round_seconds

# An accelerator below its knee: a verify pass costs ~10 ms whatever the tokens; draft steps 1 ms.
FLAT_TARGET = CostCurve(fixed_s=0.010, per_token_s=0.00001)
CHEAP_DRAFT = CostCurve(fixed_s=0.001, per_token_s=0.00001)
# A saturated CPU: every token costs 1 ms, a forward 0.5 ms fixed; the draft is 20x cheaper per token.
LINEAR_TARGET = CostCurve(fixed_s=0.0005, per_token_s=0.001)
LINEAR_DRAFT = CostCurve(fixed_s=0.0001, per_token_s=0.00005)


def loads(greedy: int, sampled: int, alpha: float = 0.8) -> dict[str, ClassLoad]:
    return {"greedy": ClassLoad(greedy, alpha), "sampled": ClassLoad(sampled, alpha)}


# --- cost curve -------------------------------------------------------------------------------

def test_cost_curve_recovers_a_line_through_noise_free_samples():
    curve = fit_cost_curve([(tokens, 0.002 + 0.0005 * tokens) for tokens in (1, 4, 9, 16, 40)])
    assert curve.seconds(10) == pytest.approx(0.007, rel=1e-6)
    assert curve.seconds(100) == pytest.approx(0.052, rel=1e-6)


def test_cost_curve_finds_the_knee_of_flat_then_linear_cost():
    def truth(tokens: float) -> float:
        return 0.010 + 0.0002 * max(0.0, tokens - 64)
    curve = fit_cost_curve([(tokens, truth(tokens)) for tokens in (1, 8, 16, 32, 64, 128, 256, 512)])
    assert curve.knee_tokens == 64
    for tokens in (5, 50, 100, 400):
        assert curve.seconds(tokens) == pytest.approx(truth(tokens), rel=1e-6)


def test_cost_curve_stays_close_at_small_batches_despite_noisy_large_ones():
    # Relative errors count: two large forwards measured at 2x their cost (a busy box) must not
    # drag t(1) far off. (Plain least squares reads t(1) = 9.9 ms here, 65% over.)
    def truth(tokens: float) -> float:
        return 0.005 + 0.001 * tokens
    curve = fit_cost_curve([(tokens, truth(tokens)) for tokens in range(1, 17)] + [(200, 2 * truth(200)), (256, 2 * truth(256))])
    for tokens in (1, 2, 4, 8, 16):
        assert curve.seconds(tokens) == pytest.approx(truth(tokens), rel=0.15)


def test_cost_curve_needs_two_distinct_batch_sizes():
    assert fit_cost_curve([]) is None
    assert fit_cost_curve([(8, 0.01), (8, 0.012)]) is None
    assert fit_cost_curve([(8, 0.01), (16, 0.012)]) is not None


def test_cost_curve_never_decreases_with_tokens_even_on_noisy_samples():
    curve = fit_cost_curve([(1, 0.012), (2, 0.010), (4, 0.011), (8, 0.009)])
    assert curve.per_token_s >= 0 and curve.fixed_s >= 0
    assert curve.seconds(100) >= curve.seconds(1)



def reference_fit(samples: list[tuple[float, float]]) -> CostCurve | None:
    """The hinge fit point by point, knee by knee, as the module's docstring states it."""
    points = [(float(x), float(y)) for x, y in samples if x > 0 and y >= 0]
    if len({x for x, _ in points}) < 2:
        return None
    xs, ys = [x for x, _ in points], [y for _, y in points]
    floor = max(max(ys) * 1e-3, 1e-9)
    ws = [1.0 / max(y, floor) ** 2 for y in ys]

    def line(hs: list[float]) -> tuple[float, float]:
        total = sum(ws)
        mean_h, mean_y = sum(w * h for w, h in zip(ws, hs)) / total, sum(w * y for w, y in zip(ws, ys)) / total
        shh = sum(w * (h - mean_h) ** 2 for w, h in zip(ws, hs))
        slope = sum(w * (h - mean_h) * (y - mean_y) for w, h, y in zip(ws, hs, ys)) / shh if shh > 0 else 0.0
        if slope <= 0:
            return mean_y, 0.0
        if mean_y - slope * mean_h < 0:
            return 0.0, sum(w * h * y for w, h, y in zip(ws, hs, ys)) / sum(w * h * h for w, h in zip(ws, hs))
        return mean_y - slope * mean_h, slope

    def error(curve: CostCurve) -> float:
        return sum(w * (curve.seconds(x) - y) ** 2 for w, x, y in zip(ws, xs, ys))

    best = CostCurve(*line(xs), 0.0, len(points))
    if len(points) < 4:
        return best
    for knee in sorted(set(xs))[1:-1]:
        candidate = CostCurve(*line([max(0.0, x - knee) for x in xs]), knee, len(points))
        if error(candidate) < error(best) * (1 - 1e-9):
            best = candidate
    return best


@pytest.mark.parametrize("seed", range(12))
def test_cost_curve_equals_the_point_by_point_fit_on_noisy_samples(seed):
    """The fit works on sums per distinct token count; it must choose the same knee and
    coefficients as fitting every sample at every knee (repeated counts, noise, outliers, zero
    and negative samples the fit ignores)."""
    rng = np.random.default_rng(seed)
    knee, fixed, per_token = rng.choice([0, 16, 64]), rng.uniform(1e-3, 2e-2), rng.uniform(0, 1e-3)
    tokens = rng.choice(rng.integers(1, 300, size=rng.integers(2, 40)), size=rng.integers(2, 200))
    seconds = (fixed + per_token * np.maximum(0, tokens - knee)) * rng.lognormal(0, 0.3, size=len(tokens))
    samples = [(float(x), float(y)) for x, y in zip(tokens, seconds)] + [(0.0, 0.01), (8.0, -1.0)]
    ours, reference = fit_cost_curve(samples), reference_fit(samples)
    if reference is None:
        assert ours is None
        return
    assert (ours.knee_tokens, ours.num_samples) == (reference.knee_tokens, reference.num_samples)
    assert ours.fixed_s == pytest.approx(reference.fixed_s, rel=1e-9, abs=1e-15)
    assert ours.per_token_s == pytest.approx(reference.per_token_s, rel=1e-9, abs=1e-15)


# --- goodput model ----------------------------------------------------------------------------

def test_target_only_round_is_one_verify_pass_without_drafting():
    load = loads(4, 0)
    depths = {"greedy": 0, "sampled": 0}
    assert round_seconds(load, depths, FLAT_TARGET, CHEAP_DRAFT, 1, 1) == pytest.approx(FLAT_TARGET.seconds(4))
    assert goodput_tokens_per_s(load, depths, FLAT_TARGET, CHEAP_DRAFT, 1, 1) == pytest.approx(4 / FLAT_TARGET.seconds(4))


def test_serial_round_adds_one_batched_draft_step_per_draft_token():
    load = loads(2, 0)
    seconds = round_seconds(load, {"greedy": 3, "sampled": 0}, FLAT_TARGET, CHEAP_DRAFT, 1, 1)
    assert seconds == pytest.approx(3 * CHEAP_DRAFT.seconds(2) + FLAT_TARGET.seconds(8))


def test_one_request_drafts_then_verifies_in_series():
    load = loads(1, 0)
    seconds = round_seconds(load, {"greedy": 4, "sampled": 0}, LINEAR_TARGET, LINEAR_DRAFT, 1, 1, overhead_s=0.002)
    assert seconds == pytest.approx(4 * LINEAR_DRAFT.seconds(1) + LINEAR_TARGET.seconds(5) + 0.002)


def test_with_company_one_half_drafts_while_the_other_verifies():
    """Two requests on pools whose cost grows with the batch, drafting as costly as verifying:
    alternating, both advance a round in the time one request's round takes, where lock step
    pays both batches back to back."""
    draft = CostCurve(fixed_s=0.0, per_token_s=0.0025)    # per request and step
    verify = CostCurve(fixed_s=0.0, per_token_s=0.002)    # per verified token
    load, depths = loads(2, 0), {"greedy": 4, "sampled": 0}
    lock_step = 4 * draft.seconds(2) + verify.seconds(10)
    assert lock_step == pytest.approx(0.040)
    assert round_seconds(load, depths, verify, draft, 1, 1) == pytest.approx(0.020)
    # With hops, each half's own round (draft + verify + overhead) bounds the cycle.
    assert round_seconds(load, depths, verify, draft, 1, 1, overhead_s=0.005) == pytest.approx(0.025)


def test_overlap_makes_deeper_drafting_pay_under_load():
    """A CPU-like pair where drafting costs a third of a verify: charged in series, K stays shallow
    at 4 requests; with the pools overlapping, drafting deeper pays (measured on the 2-core box:
    K = 8 beat K = 4 by 7-11% from 2 streams on)."""
    target = CostCurve(fixed_s=0.009, per_token_s=0.0002)
    draft = CostCurve(fixed_s=0.0012, per_token_s=0.0001)
    load = loads(4, 0, alpha=0.88)
    overlapped, _ = choose_depths(load, target, draft, 1, 1, 1, 8)
    serial = max(range(1, 9), key=lambda k: 4 * expected_tokens_per_round(0.88, k) / (
        k * draft.seconds(4) + target.seconds(4 * (k + 1))))
    assert overlapped["greedy"] > serial


def test_replicas_split_the_batch():
    load = loads(8, 0)
    one = round_seconds(load, {"greedy": 2, "sampled": 0}, LINEAR_TARGET, LINEAR_DRAFT, 1, 1)
    two = round_seconds(load, {"greedy": 2, "sampled": 0}, LINEAR_TARGET, LINEAR_DRAFT, 2, 2)
    assert two < one


def test_flat_verify_cost_at_low_load_drafts_deep():
    depths, _ = choose_depths(loads(1, 0, alpha=0.9), FLAT_TARGET, CHEAP_DRAFT, 1, 1, min_k=1, max_k=8)
    assert depths["greedy"] >= 6


def test_linear_verify_cost_at_high_batch_stops_speculating():
    depths, goodput = choose_depths(loads(32, 32), LINEAR_TARGET, LINEAR_DRAFT, 1, 1, min_k=1, max_k=8)
    assert depths == {"greedy": 0, "sampled": 0}
    assert goodput == pytest.approx(64 / LINEAR_TARGET.seconds(64))


def test_depth_falls_as_load_grows_on_a_cost_curve_with_a_knee():
    knee = CostCurve(fixed_s=0.010, per_token_s=0.0004, knee_tokens=64)
    chosen = [choose_depths(loads(n, 0), knee, CHEAP_DRAFT, 1, 1, 1, 8)[0]["greedy"] for n in (1, 8, 32, 128)]
    assert chosen == sorted(chosen, reverse=True)
    assert chosen[0] >= 4 and chosen[-1] == 0


def test_poor_acceptance_drafts_less_than_good_acceptance():
    good, _ = choose_depths(loads(4, 0, alpha=0.9), FLAT_TARGET, CHEAP_DRAFT, 1, 1, 1, 8)
    poor, _ = choose_depths(loads(4, 0, alpha=0.3), FLAT_TARGET, CHEAP_DRAFT, 1, 1, 1, 8)
    assert poor["greedy"] < good["greedy"]


def test_target_only_is_not_chosen_when_disallowed():
    depths, _ = choose_depths(loads(32, 32), LINEAR_TARGET, LINEAR_DRAFT, 1, 1, 1, 8, allow_target_only=False)
    assert depths == {"greedy": 1, "sampled": 1}


def test_a_class_without_requests_gets_the_depth_for_a_newcomer():
    depths, _ = choose_depths(loads(0, 0, alpha=0.9), FLAT_TARGET, CHEAP_DRAFT, 1, 1, 1, 8)
    assert depths["greedy"] >= 6 and depths["sampled"] >= 6


def test_the_incumbent_depth_is_kept_when_nearly_as_good():
    # alpha 0.7, one request per class: K = 4 is best, K = 3 and 5 are within 1.5% of it.
    load = loads(1, 1, alpha=0.7)
    best, _ = choose_depths(load, FLAT_TARGET, CHEAP_DRAFT, 1, 1, 1, 8)
    assert best == {"greedy": 4, "sampled": 4}
    near = {"greedy": 3, "sampled": 3}
    assert choose_depths(load, FLAT_TARGET, CHEAP_DRAFT, 1, 1, 1, 8, incumbent=near)[0] == near


def test_a_clearly_worse_incumbent_is_replaced():
    load = loads(1, 1, alpha=0.7)
    far = {"greedy": 1, "sampled": 8}
    assert choose_depths(load, FLAT_TARGET, CHEAP_DRAFT, 1, 1, 1, 8, incumbent=far)[0] == {"greedy": 4, "sampled": 4}


def test_a_costly_round_trip_argues_for_deeper_rounds():
    """Per-round overhead is paid once per round whatever K is, so measured RPC cost (which routers
    report) must push K up: with none the model drafts shallower than the served path should."""
    cpu_like = CostCurve(fixed_s=0.009, per_token_s=0.0018)
    cheap_hops, _ = choose_depths(loads(1, 0, alpha=0.88), cpu_like, CHEAP_DRAFT, 1, 1, 1, 8, overhead_s=0.0)
    costly_hops, _ = choose_depths(loads(1, 0, alpha=0.88), cpu_like, CHEAP_DRAFT, 1, 1, 1, 8, overhead_s=0.007)
    assert costly_hops["greedy"] > cheap_hops["greedy"]


def test_the_load_view_carries_the_routers_measured_overhead():
    from specserve.common.messages import RouterReport
    from specserve.policies.load import LoadTracker

    tracker = LoadTracker()
    for name, overhead_s in (("r1", 0.006), ("r2", 0.008), ("r3", None)):
        tracker.add_router(RouterReport(name, 1, {"greedy": 1}, {}, overhead_s), now=0.0)
    assert tracker.snapshot(0.0).round_overhead_s == pytest.approx(0.007)


def test_target_only_rounds_of_several_steps_pay_the_overhead_once_for_them():
    """A target-only round decodes speculation.target_only_steps tokens per router round trip:
    where one-token rounds make a shallow K worth its drafting for the overhead it shares,
    four-token rounds make target-only the better choice; a mixed round is charged in lock step."""
    target = CostCurve(fixed_s=0.004, per_token_s=0.001)
    draft = CostCurve(fixed_s=0.002, per_token_s=0.0005)
    load = {"greedy": ClassLoad(1, 0.6), "sampled": ClassLoad(1, 0.6)}
    assert round_seconds(load, {"greedy": 0, "sampled": 0}, target, draft, 1, 1, overhead_s=0.008,
                         target_only_steps=4) == pytest.approx(target.seconds(2) + 0.002)
    assert round_seconds(load, {"greedy": 2, "sampled": 0}, target, draft, 1, 1, overhead_s=0.008, target_only_steps=4) \
        == round_seconds(load, {"greedy": 2, "sampled": 0}, target, draft, 1, 1, overhead_s=0.008)
    one_step, _ = choose_depths(load, target, draft, 1, 1, 1, 8, overhead_s=0.008)
    four_steps, _ = choose_depths(load, target, draft, 1, 1, 1, 8, overhead_s=0.008, target_only_steps=4)
    assert min(one_step.values()) >= 1 and four_steps == {"greedy": 0, "sampled": 0}
