"""How a router picks a request's draft depth (Router._draft_depth, Router.status), in-process.

The router's depth logic reads only its own counters, its wall-clock fit and the policy decision,
so it runs here without a Ray cluster: the Serve class's plain body with no engines attached."""

from __future__ import annotations

import pytest

from cluster.config import SpecServeConfig
from decoding.sampling import SamplingParams
from decoding.sequence import RequestState
from deployments.router import Router


@pytest.fixture()
def router():
    return Router.func_or_class(SpecServeConfig().model_dump(mode="json"), None)


def request(router, request_id: str, seed: int | None = None) -> RequestState:
    params = SamplingParams(temperature=0.0 if seed is None else 0.8, seed=seed, max_tokens=64)
    return RequestState(request_id=request_id, prompt_ids=[1, 2, 3], params=params, eos_token_id=None,
                        max_context=router.max_context)


def teach_line(router, request_class: str, intercept_s: float, per_token_s: float, rounds: int = 60) -> None:
    for i in range(rounds):
        k = 2 + i % 7
        router.lone_round_walls[request_class].observe(k, intercept_s + per_token_s * k)


def test_a_lone_request_drafts_shallower_once_its_rounds_show_a_steep_line(router):
    alone = request(router, "a")
    router.active_requests = {"a": alone}
    by_engine_seconds = router._draft_depth(alone)
    teach_line(router, "greedy", 0.015, 0.006)
    assert router._draft_depth(alone) < by_engine_seconds
    teach_line(router, "greedy", 0.030, 0.0, rounds=400)   # the box changed: deeper costs nothing now
    assert router._draft_depth(alone) == router.config.speculation.max_draft_tokens


def test_with_company_the_policy_depth_holds_whatever_the_lone_line_says(router):
    teach_line(router, "greedy", 0.015, 0.006)
    router.policy_decision = {"num_draft_tokens": {"greedy": 7, "sampled": 3}}
    router.policy_decision_at = float("inf")
    first, second = request(router, "a"), request(router, "b")
    router.active_requests = {"a": first, "b": second}
    assert router._draft_depth(first) == 7
    router.active_requests = {"a": first}     # alone, the policy's depth only caps
    assert router._draft_depth(first) < 7


def test_a_seeded_request_ignores_the_policy_and_the_measured_line(router):
    seeded = request(router, "s", seed=5)
    router.active_requests = {"s": seeded}
    before = router._draft_depth(seeded)
    teach_line(router, "sampled", 0.015, 0.006)
    router.policy_decision = {"num_draft_tokens": {"greedy": 1, "sampled": 1}}
    router.policy_decision_at = float("inf")
    assert router._draft_depth(seeded) == before


def test_status_reports_what_a_fresh_greedy_request_would_draft(router):
    idle = router.status()["num_draft_tokens"]
    teach_line(router, "greedy", 0.015, 0.006)
    assert router.status()["num_draft_tokens"] < idle          # alone: its lone choice
    router.policy_decision = {"num_draft_tokens": {"greedy": 6, "sampled": 3}}
    router.policy_decision_at = float("inf")
    router.active_requests = {"a": request(router, "a")}
    assert router.status()["num_draft_tokens"] == 6            # beside another: the policy's depth
