"""How a router picks a request's draft depth (policies.depth_chooser.DepthChooser), in-process.

The chooser reads only its own counters, its wall-clock fit and the policy decision, with the
clock passed in, so the tests drive it directly; one test checks the router's `status` asks it."""

from __future__ import annotations

import random

import pytest

from specserve.common.config import SpecServeConfig
from specserve.common.messages import PolicyDecision
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.sequence import RequestState
from specserve.deployments.router import Router
from specserve.policies import depth_chooser
from specserve.policies.depth_chooser import POLICY_STALE_S, PROBE_EVERY, DepthChooser

NOW = 1000.0


@pytest.fixture()
def chooser():
    return DepthChooser(SpecServeConfig().speculation)


def request(request_id: str, seed: int | None = None) -> RequestState:
    params = SamplingParams(temperature=0.0 if seed is None else 0.8, seed=seed, max_tokens=64)
    return RequestState(request_id=request_id, prompt_ids=[1, 2, 3], params=params, eos_token_id=None,
                        max_context=512)


def depths(num_draft_tokens: dict[str, int]) -> PolicyDecision:
    """A policy decision allowing these depths, with no opinion on replicas."""
    return PolicyDecision(num_draft_tokens, None, None, version=1)


def teach_line(chooser, request_class: str, intercept_s: float, per_token_s: float, rounds: int = 60) -> None:
    for i in range(rounds):
        k = 2 + i % 7
        chooser.lone_round_walls[request_class].observe(k, intercept_s + per_token_s * k)


def test_a_lone_request_drafts_shallower_once_its_rounds_show_a_steep_line(chooser):
    alone = request("a")
    by_engine_seconds = chooser.choose(alone, 1, NOW)
    teach_line(chooser, "greedy", 0.015, 0.006)
    assert chooser.choose(alone, 1, NOW) < by_engine_seconds
    teach_line(chooser, "greedy", 0.030, 0.0, rounds=400)   # the box changed: deeper costs nothing now
    assert chooser.choose(alone, 1, NOW) == chooser.spec.max_draft_tokens


def test_only_rounds_alone_from_start_to_end_teach_the_lone_line(chooser):
    for alone in (False, True):
        for i in range(60):
            k = 2 + i % 7
            chooser.observe_round("greedy", k, k // 2, 0.015 + 0.006 * k, 0.01, 0.0, alone=alone)
        assert (chooser.lone_round_walls["greedy"].line is None) == (not alone)
    assert chooser.class_counters["greedy"].rounds == 120
    assert chooser.class_counters["sampled"].rounds == 0


def test_with_company_the_policy_depth_holds_whatever_the_lone_line_says(chooser):
    teach_line(chooser, "greedy", 0.015, 0.006)
    chooser.set_policy_decision(depths({"greedy": 7, "sampled": 3}), NOW)
    first = request("a")
    assert chooser.choose(first, 2, NOW) == 7
    assert chooser.choose(first, 1, NOW) < 7     # alone, the policy's depth only caps


def test_a_stale_policy_decision_is_dropped(chooser):
    chooser.set_policy_decision(depths({"greedy": 1, "sampled": 1}), NOW)
    assert chooser.choose(request("a"), 2, NOW) == 1
    assert chooser.choose(request("a"), 2, NOW + POLICY_STALE_S + 1) > 1


def test_a_seeded_request_ignores_the_policy_and_the_measured_line(chooser):
    seeded = request("s", seed=5)
    before = chooser.choose(seeded, 1, NOW)
    teach_line(chooser, "sampled", 0.015, 0.006)
    chooser.set_policy_decision(depths({"greedy": 1, "sampled": 1}), NOW)
    assert chooser.choose(seeded, 2, NOW) == before


def lone_rounds(chooser, state: RequestState, rounds: int, wall_s, accept_rate: float = 0.7) -> list[int]:
    """Rounds of a lone greedy request as the router runs them: K from the chooser, each block's
    tokens accepted one by one with probability accept_rate (seeded), the round's wall wall_s(K)."""
    draws = random.Random(0)
    depths_drafted = []
    for _ in range(rounds):
        k = chooser.choose(state, 1, NOW)
        accepted = 0
        while accepted < k and draws.random() < accept_rate:
            accepted += 1
        chooser.observe_round("greedy", k, accepted, wall_s(k), 0.01, 0.0, alone=True)
        state.stats.rounds += 1
        depths_drafted.append(k)
    return depths_drafted


def test_a_lone_request_probes_the_far_depth_while_its_classs_line_cannot_be_refitted(chooser):
    """Once K has settled on one depth the wall line is kept untested (RoundWallFit.needs_spread):
    one round in PROBE_EVERY then drafts at the far end of the allowed depths, and the round
    before it pre-drafts that deep; where K varies there are no probes."""
    teach_line(chooser, "greedy", 0.015, 0.006)
    settled = chooser.choose(request("x"), 1, NOW)
    for _ in range(200):
        chooser.lone_round_walls["greedy"].observe(settled, 0.015 + 0.006 * settled)
    assert chooser.lone_round_walls["greedy"].needs_spread
    state, chosen, predrafts = request("a"), [], []
    for round_index in range(2 * PROBE_EVERY + 1):
        state.stats.rounds = round_index
        chosen.append(chooser.choose(state, 1, NOW))
        predrafts.append(chooser.predraft_depth(state, chosen[-1], 1, NOW))
    probes = [i for i, k in enumerate(chosen) if k != settled]
    assert len(probes) in (2, 3) and probes[1] - probes[0] == PROBE_EVERY
    assert {chosen[i] for i in probes} == {chooser.spec.max_draft_tokens}
    assert [i for i, depth in enumerate(predrafts) if depth != chosen[i]] == [i - 1 for i in probes if i]
    teach_line(chooser, "greedy", 0.015, 0.006)
    assert {chooser.choose(state, 1, NOW) for state.stats.rounds in range(2 * PROBE_EVERY)} == {settled}


def test_a_line_learnt_steep_is_unlearnt_once_deep_rounds_cost_little(chooser, monkeypatch):
    """A line fitted while deep rounds were dear (a busy box, the speculation cache's misses)
    sends K to the shallow end, where it would stay if nothing drafted deeper again; the probes
    find that deep rounds now cost little and K climbs back to the deepest (about 150 rounds
    here). Without probes it stays shallow."""
    def flat(k):
        return 0.030 + 0.0002 * k

    for probing in (False, True):
        chooser = DepthChooser(SpecServeConfig().speculation)
        if not probing:
            monkeypatch.setattr(depth_chooser, "DEPTH_PROBE_PHASE", PROBE_EVERY)   # a phase no round has
        else:
            monkeypatch.undo()
        teach_line(chooser, "greedy", 0.015, 0.006)
        assert chooser.choose(request("a"), 1, NOW) <= 2
        state = request("a")
        state.params = state.params.model_copy(update={"max_tokens": 10_000})
        chosen = lone_rounds(chooser, state, 400, flat)
        if probing:
            assert chosen[-PROBE_EVERY:].count(chooser.spec.max_draft_tokens) >= PROBE_EVERY - 1, chosen[-40:]
        else:
            assert max(chosen[-PROBE_EVERY:]) <= chooser.spec.max_draft_tokens // 2, chosen[-40:]


def test_status_reports_what_a_fresh_greedy_request_would_draft():
    router = Router.func_or_class(SpecServeConfig().model_dump(mode="json"), None)
    idle = router.status()["num_draft_tokens"]
    teach_line(router.depth, "greedy", 0.015, 0.006)
    assert router.status()["num_draft_tokens"] < idle          # alone: its lone choice
    router.depth.set_policy_decision(depths({"greedy": 6, "sampled": 3}), float("inf"))
    router.active_requests = {"a": request("a")}
    assert router.status()["num_draft_tokens"] == 6            # beside another: the policy's depth


def test_the_fan_out_is_the_configured_one_alone_and_the_policys_beside_others():
    """Alone, a request pre-drafts the configured number of blocks; beside others the policy's
    fan-out (0: the draft pool is full) holds, and none past fan_out_max_batch requests (the
    measured payoff's probes apart, tested below)."""
    chooser = DepthChooser(SpecServeConfig(speculation={"fan_out_max_batch": 4, "fan_out_measured": False}).speculation)
    configured = chooser.spec.fan_out
    alone = chooser.fan_out(request("a"), 4, 1, NOW)
    assert alone == (configured,)   # a budget: the draft engine shares it out over the outcomes
    chooser.set_policy_decision(PolicyDecision({"greedy": 4, "sampled": 4}, None, None, 1, fan_out=0), NOW)
    assert chooser.fan_out(request("a"), 4, 1, NOW) == alone
    assert chooser.fan_out(request("b"), 4, 3, NOW) == ()
    assert chooser.fan_out(request("c", seed=7), 4, 3, NOW) == ()
    assert sum(chooser.fan_out(request("b"), 4, 3, NOW + POLICY_STALE_S + 1)) == configured   # a stale decision
    assert chooser.fan_out(request("b"), 4, 5, NOW + POLICY_STALE_S + 1) == ()    # past fan_out_max_batch
    assert chooser.fan_out(request("a"), 0, 1, NOW) == ()


def test_a_class_whose_rounds_rarely_hit_stops_pre_drafting_but_probes():
    """The speculation cache pays only where its blocks are used: a class whose recent pre-drafted
    rounds hit under MIN_HIT_SHARE stops pre-drafting, but for a probe every PROBE_EVERY rounds;
    a class that hits keeps its fan-out, and a probe that hits again brings it back."""
    from specserve.policies.depth_chooser import PROBE_EVERY

    chooser = DepthChooser(SpecServeConfig(speculation={"fan_out_measured": False}).speculation)
    sampled = request("s", seed=1)
    for _ in range(40):
        chooser.observe_cache("sampled", hit=False)
        chooser.observe_cache("greedy", hit=True)
    assert sum(chooser.fan_out(request("g"), 4, 1, NOW)) == chooser.spec.fan_out
    chosen = [chooser.fan_out(sampled, 4, 1, NOW) for _ in range(2 * PROBE_EVERY)]
    assert sum(1 for fan_out in chosen if fan_out) == 2
    for _ in range(40):
        chooser.observe_cache("sampled", hit=True)
    assert sum(chooser.fan_out(sampled, 4, 1, NOW)) == chooser.spec.fan_out


def steady_rounds(chooser: DepthChooser, klass: str, on_s: float, off_s: float, num_rounds: int = 5) -> None:
    for _ in range(num_rounds):
        chooser.observe_fan_out_round(klass, 4, True, on_s)
        chooser.observe_fan_out_round(klass, 4, False, off_s)


def fan_outs(chooser: DepthChooser, state: RequestState, num_rounds: int, depth: int = 4) -> list[bool]:
    """Whether each of state's next num_rounds rounds of this depth pre-drafts (alone on the router)."""
    chosen = []
    for _ in range(num_rounds):
        chosen.append(bool(chooser.fan_out(state, depth, 1, NOW)))
        state.stats.rounds += 1
    return chosen


def flipped(chosen: list[bool], usual: bool) -> list[int]:
    """The rounds that ran the other way than `usual`, checked to be PAYOFF_PROBE_ROUNDS in a row
    (one steady round each) in every PROBE_EVERY."""
    from specserve.policies.depth_chooser import PAYOFF_PROBE_ROUNDS, PROBE_EVERY

    rounds = [index for index, fan_out in enumerate(chosen) if fan_out != usual]
    assert len(rounds) == len(chosen) // PROBE_EVERY * PAYOFF_PROBE_ROUNDS
    residues = {index % PROBE_EVERY for index in rounds}
    assert any(residues == {(start + step) % PROBE_EVERY for step in range(PAYOFF_PROBE_ROUNDS)}
               for start in range(PROBE_EVERY))
    return rounds


def test_the_fan_out_stays_only_where_rounds_measure_faster_with_it_and_both_sides_stay_measured():
    """Where pre-drafts slow the target more than their hits save, steady rounds with the fan-out
    measure slower than without it: the class stops pre-drafting, but for PAYOFF_PROBE_ROUNDS in
    a row of every PROBE_EVERY rounds (so its rounds with it stay measured); where they measure
    faster, it keeps the fan-out but for as many rounds without it. Until both sides are measured
    it keeps the configured fan-out and still probes without it. Each request probes at its own
    offset (a request shorter than PROBE_EVERY rounds probes too). The measure is per class, one
    verdict for every depth; speculation.fan_out_measured false turns it off."""
    from specserve.policies.depth_chooser import PROBE_EVERY

    chooser = DepthChooser(SpecServeConfig().speculation)
    rounds = 2 * PROBE_EVERY
    unmeasured = {name: flipped(fan_outs(chooser, request(name), rounds), usual=True) for name in "abcdef"}
    assert len({tuple(probes) for probes in unmeasured.values()}) > 1     # not every request at once
    steady_rounds(chooser, "greedy", on_s=0.012, off_s=0.010)   # pre-drafts slow greedy rounds
    steady_rounds(chooser, "sampled", on_s=0.008, off_s=0.010)
    assert flipped(fan_outs(chooser, request("a"), rounds), usual=False) == unmeasured["a"]
    assert flipped(fan_outs(chooser, request("b", seed=3), rounds), usual=True) == unmeasured["b"]
    assert flipped(fan_outs(chooser, request("c"), rounds, depth=2), usual=False) == unmeasured["c"]  # any depth
    steady_rounds(chooser, "greedy", on_s=0.007, off_s=0.010)      # the slowdown went away
    assert flipped(fan_outs(chooser, request("d"), rounds), usual=True) == unmeasured["d"]
    always = DepthChooser(SpecServeConfig(speculation={"fan_out_measured": False}).speculation)
    steady_rounds(always, "greedy", on_s=0.012, off_s=0.010)
    assert all(fan_outs(always, request("a"), rounds))


def test_fan_out_payoff_waits_for_both_sides_weighs_every_depth_alike_and_follows_a_change():
    from specserve.policies.fan_out import PAYOFF_MIN_ROUNDS, FanOutPayoff

    payoff = FanOutPayoff()
    for _ in range(PAYOFF_MIN_ROUNDS - 1):
        payoff.observe(4, True, 0.020)
        payoff.observe(4, False, 0.010)
    for _ in range(10):
        payoff.observe(2, True, 0.001)        # no steady rounds without the fan-out at K = 2
    assert payoff.pays() is None
    payoff.observe(4, True, 0.020)
    payoff.observe(4, False, 0.010)
    assert payoff.pays() is False
    for _ in range(PAYOFF_MIN_ROUNDS):        # K = 6: 0.6x with it, against 2x at K = 4
        payoff.observe(6, True, 0.006)
        payoff.observe(6, False, 0.010)
    assert payoff.pays() is False             # the geometric mean of 2 and 0.6 is above 1
    for _ in range(PAYOFF_MIN_ROUNDS):
        payoff.observe(8, True, 0.004)
        payoff.observe(8, False, 0.010)
    assert payoff.pays() is True              # of 2, 0.6 and 0.4: below
    changed = 0
    while payoff.pays() is True:
        payoff.observe(6, True, 0.030)
        changed += 1
    assert 1 < changed <= 10                  # an EMA, not the mean since the start
