"""Online draft training (docs/online-learning.md), in-process: hot-swapping the draft engine's weights mid-request
is lossless (greedy text identical; seeded sampled tokens follow the target, and verifying a block
against the other version's q rows is caught), a failed load keeps the serving draft, the router's
capture is off by default, and the trainer's pass writes a version only when the canary passes,
rolls a worse one back and adopts what engines serve after a restart."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from specserve.common.config import SpecServeConfig
from specserve.common.messages import PositionCounts
from specserve.decoding.capture import save_blocks, top_rows
from specserve.decoding.proposers import Proposal
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.sequence import RequestState
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.speculation import accept_round, target_rows
from specserve.deployments.committed_history import HistorySender, RunningDigest
from specserve.deployments.draft_worker import DraftEngine
from specserve.common.metrics import RouterMetrics
from specserve.deployments.round_capture import RoundCapture
from specserve.deployments.target_worker import TargetEngine
from tests.test_engines import options, spec, whole
from tests.test_rejection import assert_differs, assert_matches, total_variation
from tests.tiny_pair import make_tiny_pair
from specserve.training.online_trainer import OnlineTrainer, load_draft_model, rolls_back

# Some of these tests reach Ray's API (a version put in the object store), which starts a Ray
# cluster of its own where none runs: under `make test`'s two workers that start collided with the
# served group's cluster starts (tests/conftest.py), so the whole module runs in that group.
pytestmark = pytest.mark.ray

GREEDY = SamplingParams(temperature=0, max_tokens=40)
SAMPLED = SamplingParams(temperature=1.5, top_k=8, max_tokens=2)
PROMPT = [5, 17, 42, 8, 3, 33, 61, 12]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(target, draft v0, draft v1 of the same target, an unrelated model's draft)."""
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"))
    _, closer = make_tiny_pair(tmp_path_factory.mktemp("closer"), noise=0.1)
    _, unrelated = make_tiny_pair(tmp_path_factory.mktemp("unrelated"), seed=5)
    return target, draft, closer, unrelated


def engines(pairs, max_sequences: int = 8) -> tuple[DraftEngine, TargetEngine]:
    target, draft, _, _ = pairs
    batching = options(max_batch_rows=max_sequences, prefill_token_budget=16 * max_sequences)
    return (DraftEngine("draft", spec(draft, max_sequences), str(target), batching),
            TargetEngine(spec(target, max_sequences), batching))


def new_state(request_id: str, params: SamplingParams) -> RequestState:
    return RequestState(request_id=request_id, prompt_ids=list(PROMPT), params=params, eos_token_id=None,
                        max_context=256)


async def greedy_rounds(draft, target, state: RequestState, num_draft: int, swap=None) -> list[int]:
    """Speculative rounds to the end; swap(round) runs before each round's propose. -> versions per round."""
    versions, round_index = [], 0
    digest = RunningDigest()  # each call carries what was committed since, as the router's do
    to_draft, to_target = HistorySender(digest), HistorySender(digest)
    while not state.finished:
        if swap is not None:
            await swap(round_index)
        proposal = Proposal([], None)
        if num_draft:
            proposal, _ = await draft.propose(state.request_id, to_draft.update(state), num_draft, state.params,
                                              None)
        rows, _ = await target.verify(state.request_id, to_target.update(state), proposal, state.params,
                                      state.next_output_index)
        accept_round(state, proposal, rows)
        versions.append(proposal.draft_version)
        round_index += 1
    return versions


def test_a_swap_mid_request_keeps_greedy_text_and_a_failed_load_keeps_the_serving_draft(pairs):
    _, _, closer, _ = pairs

    async def scenario():
        draft, target = engines(pairs)
        reference = new_state("ref", GREEDY)
        await greedy_rounds(draft, target, reference, 0)

        async def swap(round_index):
            if round_index == 3:
                await draft.load_draft(1, str(closer))
            if round_index == 6:
                with pytest.raises(Exception):
                    await draft.load_draft(2, "/nonexistent/draft")

        state = new_state("swapped", GREEDY)
        versions = await greedy_rounds(draft, target, state, 4, swap)
        return reference, state, versions, await draft.version(), await draft.active_sequences()

    reference, state, versions, version, held = asyncio.run(scenario())
    assert state.output_ids == reference.output_ids
    assert versions[:3] == [0, 0, 0] and set(versions[3:]) == {1}
    assert version == {"draft_version": 1, "draft_path": str(closer), "draft_source": str(closer)}
    assert held == ["swapped"]  # re-prefilled on the new weights after the old KV was dropped
    assert state.stats.draft_version == 1


@pytest.mark.ray
def test_an_engine_loads_a_version_from_the_object_store_into_its_serving_runner(pairs, tmp_path):
    """The trainer's versions folder is on its node only: the engine loads the version from Ray's
    object store after the folder is gone, into the runner that serves (same KV pool, no more
    KV memory reserved for the same work), drops the old version's KV, and drafts exactly what (tokens
    and q rows) an engine started on the new version drafts."""
    import shutil

    import ray

    from specserve.cluster.local import init_local_ray
    from specserve.deployments.draft_trainer import DraftTrainer
    from specserve.training.online_trainer import DraftVersion

    target, draft_path, _, unrelated = pairs
    version_dir = tmp_path / "v1"
    shutil.copytree(unrelated, version_dir)

    def trainer(**training) -> DraftTrainer:
        made = DraftTrainer(SpecServeConfig.model_validate({"draft": {"path": str(draft_path)}, "draft_training": {
            "enabled": True, **training}}).model_dump(mode="json"))
        made.core.versions.append(DraftVersion(1, str(version_dir)))
        return made

    async def offered():
        offering, shared = trainer(), trainer(versions_dir=str(tmp_path))
        weights = await offering._weights_of(offering.core.version(1))
        assert await offering._weights_of(offering.core.version(1)) is weights      # put once
        assert await shared._weights_of(shared.core.version(1)) is None            # a shared path is read
        assert await offering._weights_of(offering.core.version(0)) is None        # so is the start-up draft
        return weights

    init_local_ray(num_cpus=1, include_dashboard=False)
    try:
        weights = asyncio.run(offered())
        shutil.rmtree(version_dir)  # as on another node: nothing on this disk to read

        async def scenario():
            draft, _ = engines(pairs)
            fresh = DraftEngine("draft", spec(unrelated, 8), str(target), options(max_batch_rows=8))
            old, _ = await draft.propose("warm", whole(PROMPT), 4, SAMPLED, 0)
            runner, pool = draft.runner, draft.runner.cache
            reserved = draft.scheduler.kv_usage()["kv_bytes_reserved"]
            await draft.load_draft(1, str(version_dir), ray.get(weights))  # fetched, as Ray does for an actor call
            swapped, _ = await draft.propose("new", whole(PROMPT), 4, SAMPLED, 0)
            expected, _ = await fresh.propose("new", whole(PROMPT), 4, SAMPLED, 0)
            assert (await draft.version())["draft_source"] == "object store"
            return (draft.runner is runner and draft.runner.cache is pool, reserved,
                    draft.scheduler.kv_usage()["kv_bytes_reserved"], await draft.active_sequences(), old, swapped,
                    expected)

        same_pool, reserved_before, reserved_after, held, old, swapped, expected = asyncio.run(scenario())
    finally:
        ray.shutdown()
    assert same_pool and reserved_after == reserved_before > 0
    assert held == ["new"]  # the old version's KV was let go
    assert swapped.draft_version == 1 and swapped.token_ids == expected.token_ids
    probs = [torch.as_tensor(p.support.probs) for p in (old, swapped, expected)]
    assert torch.equal(probs[1], probs[2]) and not torch.allclose(probs[0], probs[1], atol=1e-3)


def _first_tokens_across_a_swap(pairs, samples: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded sampled requests whose draft KV was filled by version 0; the draft then swaps to an
    unrelated model's weights and each request verifies one block (K=2). -> (first emitted
    tokens, the same with each block verified against version 0's q rows for its request, as a
    router that mixed versions would, the target's processed row)."""
    _, _, _, unrelated = pairs

    async def scenario():
        draft, target = engines(pairs, max_sequences=samples + 1)
        states = [new_state(f"s{n}", SAMPLED.model_copy(update={"seed": n})) for n in range(samples)]
        old = await asyncio.gather(*[draft.propose(s.request_id, whole(s.history), 2, s.params, n)
                                     for n, s in enumerate(states)])
        await draft.load_draft(1, str(unrelated))
        new = await asyncio.gather(*[draft.propose(s.request_id, whole(s.history), 2, s.params, n + samples)
                                     for n, s in enumerate(states)])
        rows = await asyncio.gather(*[target.verify(s.request_id, whole(s.history), p, s.params, 0)
                                      for s, (p, _) in zip(states, new)])
        mixed = [Proposal(p.token_ids, q.support, 1) for (p, _), (q, _) in zip(new, old)]  # verified against v0's q
        mixed_rows = await asyncio.gather(*[target.verify(s.request_id, whole(s.history), p, s.params, 0)
                                            for s, p in zip(states, mixed)])
        logits = target.scheduler.forward_batch([ForwardCall("exact", PROMPT, 1)])[0]
        return old, new, (rows, mixed_rows), mixed, target_rows(logits, SAMPLED)[0]

    old, new, rows, mixed, exact = asyncio.run(scenario())
    firsts = {False: [], True: []}
    for n, ((proposal, _), (stale, _)) in enumerate(zip(new, old)):
        assert proposal.draft_version == 1 and stale.draft_version == 0
        for broken, verified in ((False, proposal), (True, mixed[n])):
            state = new_state(f"s{n}", SAMPLED.model_copy(update={"seed": n}))
            accept_round(state, verified, rows[broken][n][0])
            firsts[broken].append(state.output_ids[0])
    return torch.tensor(firsts[False]), torch.tensor(firsts[True]), exact


SAMPLES = 400
TV_BOUND = 0.09  # about three times the expected TV of 400 exact samples over this row's 8 cells


def test_sampled_tokens_follow_the_target_across_a_swap_and_mixing_versions_is_caught(pairs):
    """Chi-square (p > 1e-3) and TV (< TV_BOUND) against the target's processed row over SAMPLES
    seeded requests; the broken variant must be rejected by the chi-square at 1e-3."""
    samples, broken, exact = _first_tokens_across_a_swap(pairs, SAMPLES)
    assert_matches(samples, exact, check_tv=False)
    assert total_variation(samples, exact) < TV_BOUND
    assert_differs(broken, exact)


def test_capture_is_off_by_default_and_samples_its_rounds_when_on(monkeypatch):
    off = RoundCapture(SpecServeConfig(), RouterMetrics())
    assert SpecServeConfig().draft_training.enabled is False
    assert SpecServeConfig().engine_options()["draft_trainer"] is None
    assert [off.top_k_for_round() for _ in range(10)] == [None] * 10
    off.observe(0, 2, 1, None)
    assert off._trainer is None and not off._blocks  # nothing kept, nothing looked up
    monkeypatch.setenv("SPECSERVE__DRAFT_TRAINING__ENABLED", "true")
    monkeypatch.setenv("SPECSERVE__DRAFT_TRAINING__SAMPLE_EVERY", "3")
    from specserve.common.config import load_config

    on = RoundCapture(load_config(), RouterMetrics())
    assert [on.top_k_for_round() for _ in range(6)] == [None, None, 32, None, None, 32]


def _captures(target_path, draft_path, requests: int) -> list:
    """Blocks as routers capture them: the draft's greedy 4 tokens, the target's top-k rows."""
    target, draft = load_draft_model(target_path), load_draft_model(draft_path)
    generator = torch.Generator().manual_seed(0)
    from specserve.decoding.capture import captured_block

    blocks = []
    with torch.no_grad():
        for n in range(requests):
            context = torch.randint(10, 60, (8,), generator=generator).tolist()  # a small "domain": positions share tokens
            drafted = []
            for _ in range(4):
                drafted.append(int(draft(torch.tensor([context + drafted])).logits[0, -1].argmax()))
            logits = target(torch.tensor([context + drafted])).logits[0, len(context) - 1:]
            accepted = 0
            while accepted < 4 and int(logits[accepted].argmax()) == drafted[accepted]:
                accepted += 1
            blocks.append(captured_block(f"req-{n}", context, drafted, accepted, *top_rows(logits, 32)))
    return blocks


@pytest.fixture(scope="module")
def captures(pairs) -> list:
    target, draft, _, _ = pairs
    return _captures(target, draft, requests=120)


def settings(**overrides) -> dict:
    return {**SpecServeConfig().draft_training.model_dump(), "min_new_positions": 100, "lr": 1e-3,
            "epochs": 3, **overrides}


def test_a_pass_writes_a_version_only_when_the_canary_passes(pairs, captures, tmp_path):
    target, draft, _, _ = pairs
    blocks = captures
    trainer = OnlineTrainer(str(draft), settings(), tmp_path / "versions")
    trainer.add(blocks)
    assert trainer.ready()
    result = trainer.train_pass()
    assert result["outcome"] == "accepted", result
    assert result["expected_after"] > result["expected_before"] + 0.01
    written = tmp_path / "versions" / "v1"
    assert (written / "config.json").exists() and (written / "tokenizer.json").exists()
    assert not trainer.ready()  # nothing new captured since
    # The target itself as the serving draft: it is already matched, so the candidate is refused
    # and nothing is written.
    matched = OnlineTrainer(str(target), settings(), tmp_path / "matched")
    matched.add(blocks)
    assert matched.train_pass()["outcome"] == "refused"
    assert not (tmp_path / "matched").exists() and matched.serving.version == 0


def test_distill_draft_from_capture_writes_a_draft_folder_serve_takes(pairs, captures, tmp_path):
    from specserve.cluster.cli import main as specserve
    from specserve.decoding.model_runner import check_compatible_paths

    target, draft, _, _ = pairs
    save_blocks(captures, tmp_path / "captures", "shard-0")
    specserve(["distill-draft", "--from-capture", str(tmp_path / "captures"), "--out", str(tmp_path / "new"),
               "--draft", str(draft), "--lr", "1e-3", "--epochs", "3"])
    assert check_compatible_paths(str(tmp_path / "new"), str(target), str(target)) > 0
    with pytest.raises(SystemExit, match="nothing written"):  # the target itself cannot be beaten
        specserve(["distill-draft", "--from-capture", str(tmp_path / "captures"), "--out", str(tmp_path / "none"),
                   "--draft", str(target)])
    assert not (tmp_path / "none").exists()


def test_training_yields_when_load_returns(pairs, captures, tmp_path):
    _, draft, _, _ = pairs
    trainer = OnlineTrainer(str(draft), settings(), tmp_path)
    trainer.add(captures)
    calls = iter(range(10_000))
    result = trainer.train_pass(should_stop=lambda: next(calls) >= 3)
    assert result["outcome"] == "stopped" and result["steps"] == 3
    assert trainer.ready()  # the captures are still there for the next slack


def test_a_trickle_of_traffic_still_gets_a_version_by_resuming_the_stopped_pass(pairs, captures, tmp_path):
    """Load returns every 2 optimizer steps (a request now and then): each pass stops, but the next
    resumes it (candidate, optimizer state, step) instead of starting again, so a bounded number
    of passes writes the version a whole pass writes; the same candidate, step for step."""
    _, draft, _, _ = pairs
    whole = OnlineTrainer(str(draft), settings(), tmp_path / "whole")
    whole.add(captures)
    expected = whole.train_pass()
    trickle = OnlineTrainer(str(draft), settings(), tmp_path / "trickle")
    trickle.add(captures)
    results = []
    for _ in range(expected["steps"] // 2 + 2):
        budget = iter(range(10_000))
        results.append(trickle.train_pass(should_stop=lambda: next(budget) >= 2))
        if results[-1]["outcome"] != "stopped":
            break
    assert [r["outcome"] for r in results[:-1]] == ["stopped"] * (len(results) - 1) and len(results) > 3
    assert results[-1]["outcome"] == expected["outcome"] == "accepted"
    assert results[-1]["steps"] == expected["steps"] and results[-1]["resumed"] == len(results) - 1
    assert results[-1]["expected_after"] == pytest.approx(expected["expected_after"], abs=1e-6)


def test_a_steady_trickle_of_requests_still_gets_a_new_version_within_a_bounded_number_of_passes(
        pairs, captures, tmp_path):
    """A trickle: one short request always in flight, the target pool busy 5% of the time. Slack
    is spare capacity (the pool's busy share), so with the default settings passes run beside the
    trickle and a version is written within 3 passes; training only when idle
    (slack_max_active_requests 0) would never start one."""
    from specserve.policies.slack import has_slack

    _, draft, _, _ = pairs
    spec = SpecServeConfig().draft_training
    trickle = {"active_requests": 1, "target_busy_share": 0.05}
    assert not has_slack(**trickle, max_active_requests=0, max_busy_share=spec.slack_max_busy_share)

    def slack() -> bool:
        return has_slack(**trickle, max_active_requests=spec.slack_max_active_requests,
                         max_busy_share=spec.slack_max_busy_share)

    trainer = OnlineTrainer(str(draft), settings(), tmp_path)
    trainer.add(captures)
    outcomes = []
    while len(outcomes) < 3 and "accepted" not in outcomes and slack():
        outcomes.append(trainer.train_pass(should_stop=lambda: not slack())["outcome"])
    assert outcomes and outcomes[-1] == "accepted", outcomes
    assert [v.version for v in trainer.versions] == [0, 1]


def test_a_push_stops_a_pass_only_when_training_is_idle_only_and_a_trainer_with_its_own_gpu_always_has_slack():
    from specserve.deployments.draft_trainer import DraftTrainer

    def trainer(**training) -> DraftTrainer:
        return DraftTrainer(SpecServeConfig.model_validate(
            {"draft_training": {"enabled": True, **training}}).model_dump(mode="json"))

    async def pushed_stops(**training) -> bool:
        actor = trainer(**training)
        await actor.push([], {})
        return actor._stop.is_set()

    assert not asyncio.run(pushed_stops())                                  # default: slack by busy share
    assert asyncio.run(pushed_stops(slack_max_active_requests=0))          # idle-only
    assert not asyncio.run(pushed_stops(slack_max_active_requests=0, num_gpus=1))
    assert asyncio.run(trainer(num_gpus=1)._slack())      # no policy actor asked: it trains beside serving
    assert not asyncio.run(trainer()._slack())            # no policy actor: no view of the load, no training


def test_only_the_newest_versions_and_the_serving_one_stay_on_disk(tmp_path):
    from specserve.training.online_trainer import DraftVersion

    trainer = OnlineTrainer("/draft/v0", settings(keep_versions=3), tmp_path)
    for number in range(1, 6):
        (tmp_path / f"v{number}").mkdir()
        trainer.versions.append(DraftVersion(number, str(tmp_path / f"v{number}")))
    trainer.serving = trainer.version(1)          # rolled back to an old one: it stays
    assert trainer.prune() == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1", "v3", "v4", "v5"]
    assert [v.version for v in trainer.versions] == [0, 1, 3, 4, 5]


def test_an_engine_that_cannot_load_a_version_is_offered_it_again_only_after_a_growing_wait():
    from specserve.deployments.draft_trainer import FIRST_RETRY_S, MAX_RETRY_S, LoadBackoff

    backoff = LoadBackoff()
    assert backoff.may_offer("engine:draft:a", 1, now=0.0)
    waits = [backoff.failure("engine:draft:a", 1, "OutOfMemoryError: CUDA", now=100.0).retry_at - 100.0
             for _ in range(10)]
    assert waits[:3] == [FIRST_RETRY_S, 2 * FIRST_RETRY_S, 4 * FIRST_RETRY_S] and waits[-1] == MAX_RETRY_S
    assert not backoff.may_offer("engine:draft:a", 1, now=100.0 + MAX_RETRY_S - 1)
    assert backoff.may_offer("engine:draft:a", 1, now=100.0 + MAX_RETRY_S)
    assert backoff.may_offer("engine:draft:a", 2, now=101.0)            # a new version is offered at once
    assert backoff.status()["engine:draft:a"]["error"].startswith("OutOfMemoryError")
    backoff.success("engine:draft:a")
    assert backoff.status() == {}


def live_rounds(alpha: float, depth: int, rounds: int, seed: int) -> tuple[list[int], list[int]]:
    """Per-position (drafted, accepted) of `rounds` rounds drafting `depth` tokens, each kept with
    probability alpha until the first rejection: what a router reports for one version."""
    generator = torch.Generator().manual_seed(seed)
    counts = PositionCounts([], [])
    for _ in range(rounds):
        keeps = (torch.rand(depth, generator=generator) < alpha).tolist()
        accepted = keeps.index(False) if False in keeps else depth
        counts.add(PositionCounts.of_round(depth, accepted))
    return counts.drafted, counts.accepted


def test_rollback_compares_like_with_like_so_a_better_draft_at_a_larger_k_is_kept():
    """alpha 0.8 at K 8 has a lower accepted/drafted (about 0.44) than alpha 0.75 at K 4 (0.51),
    yet is better at every position: it is kept. alpha 0.5 at K 4 is worse everywhere: rolled back.
    Too few drafted tokens are not judged."""
    before = PositionCounts(*live_rounds(0.75, 4, 2000, seed=1))
    better_deeper = PositionCounts(*live_rounds(0.8, 8, 1000, seed=2))
    worse = PositionCounts(*live_rounds(0.5, 4, 1000, seed=3))
    assert better_deeper.acceptance() < before.acceptance() - 0.05     # a rule on overall acceptance alone would roll it back
    assert not rolls_back(before, better_deeper, min_drafted=500, margin=0.05)
    assert rolls_back(before, worse, min_drafted=500, margin=0.05)
    assert not rolls_back(before, PositionCounts(*live_rounds(0.5, 4, 50, seed=4)), min_drafted=500, margin=0.05)


def test_a_worse_version_live_is_rolled_back_and_a_restarted_trainer_adopts_what_engines_serve(tmp_path):
    trainer = OnlineTrainer("/draft/v0", settings(rollback_min_drafted=100), tmp_path)
    trainer.record_live({0: live_rounds(0.7, 4, 500, seed=5)})
    trainer.versions.append(type(trainer.serving)(1, "/draft/v1"))
    trainer.swap_to(1)
    assert trainer.serving.live_before == pytest.approx(trainer.live_acceptance(0))
    trainer.record_live({1: live_rounds(0.4, 4, 200, seed=6)})
    assert trainer.rollback_to().version == 0
    assert trainer.rollback_to() is None  # judged once
    restarted = OnlineTrainer("/draft/v0", settings(), tmp_path)
    restarted.adopt(3, "/draft/v3")
    assert restarted.serving.version == 3 and restarted.status()["draft_version"] == 3
    assert np.isfinite(restarted.status()["captured_positions"])
