"""A request's rounds send each engine only what was committed since its last call, and an engine
that lost the request is sent the whole history once: the router's round loop (RoundLoop,
RequestEngines) over real draft and target engines and real channels to them (common.channel),
all in this process (no Ray: Serve's get_engine is played by an awaitable giving the endpoint)."""

import asyncio
import itertools
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from specserve.common.channel import ChannelPool
from specserve.common.config import LimitsSpec, SpeculationSpec
from specserve.common.messages import EngineEndpoint, HistoryUpdate, UnknownHistory
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.sequence import RequestState
from specserve.deployments.draft_worker import DraftEngine
from specserve.common.metrics import RouterMetrics
from specserve.deployments.request_engines import RequestEngines
from specserve.deployments.round_loop import RoundLoop
from specserve.deployments.round_record import RoundObserver, RoundTimings
from specserve.deployments.target_worker import TargetEngine
from specserve.policies.depth_chooser import DepthChooser
from specserve.policies.fan_out import FanOut
from tests.test_engines import options, spec
from tests.tiny_pair import make_tiny_pair

NUM_DRAFT = 4
PROMPT = [5, 17, 42, 8, 3, 33, 60, 2, 2, 9, 14, 27]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("pair"))


class ListeningEngine:
    """An engine listening for channels on 127.0.0.1; keeps every HistoryUpdate it was sent over
    them and counts its UnknownHistory answers."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.updates: list[HistoryUpdate] = []
        self.unknown = 0
        self.continued = 0     # target-only rounds queued to continue the round before (verify without a history)
        self.held_at_end = 0   # the history length it held when the request ended (before its channels closed)

    async def listen(self) -> EngineEndpoint:
        address = await self.engine.open_channel("127.0.0.1")
        answer = self.engine.channel.answer

        async def recording(method: str, args: tuple):
            self.updates.extend(arg for arg in args if isinstance(arg, HistoryUpdate))
            self.continued += method == "verify" and args[1] is None
            reply = await answer(method, args)
            self.unknown += isinstance(reply, UnknownHistory)
            return reply

        self.engine.channel.answer = recording
        return EngineEndpoint(None, address)


class InProcessWorkers:
    def __init__(self, endpoint: EngineEndpoint) -> None:
        self.get_engine = SimpleNamespace(remote=lambda affinity_key=None: asyncio.sleep(0, endpoint))


async def request_on_engines(pair, params: SamplingParams):
    """(target, draft, a request's state, its RequestEngines over channels to the two)."""
    target_path, draft_path = pair
    target = ListeningEngine(TargetEngine(spec(target_path), options()))
    draft = ListeningEngine(DraftEngine("draft", spec(draft_path), str(target_path), options()))
    state = RequestState("r", PROMPT, params, None, 256, detokenize=lambda ids: " ".join(map(str, ids)))
    engines = RequestEngines(InProcessWorkers(await target.listen()), InProcessWorkers(await draft.listen()),
                             LimitsSpec(), ChannelPool())
    return target, draft, state, engines


async def greedy_request(pair, max_tokens: int):
    return await request_on_engines(pair, SamplingParams(temperature=0, max_tokens=max_tokens))


def recording_observer(speculation: SpeculationSpec) -> tuple[RoundObserver, list]:
    """A round observer that also keeps every RoundRecord, in order, in the list returned beside it."""
    observer = RoundObserver(RoundTimings(), DepthChooser(speculation), RouterMetrics())
    records = []
    observe = observer.round
    observer.round = lambda record: (records.append(record), observe(record))
    return observer, records


def run_request(pair, forget_at: dict[str, int]) -> tuple[RequestState, ListeningEngine, ListeningEngine]:
    """One greedy request (drafting ahead, as a lone greedy request does) to the end; at round
    forget_at[pool] that engine forgets the request, as its idle-sequence expiry would."""

    async def scenario():
        target, draft, state, engines = await greedy_request(pair, 48)
        rounds = 0

        def choose_depth(state: RequestState) -> int:
            nonlocal rounds
            rounds += 1
            for pool, handle in (("target", target), ("draft", draft)):
                if forget_at.get(pool) == rounds:
                    handle.engine.loop.release(state.request_id)
            return state.draft_budget(NUM_DRAFT)

        speculation = SpeculationSpec(num_draft_tokens=NUM_DRAFT, adaptive=False)
        observer = RoundObserver(RoundTimings(), DepthChooser(speculation), RouterMetrics())
        loop = RoundLoop(state, engines, observer, lambda chunk: None, choose_depth, lambda: 1, speculation)
        await loop.run(0.0, float("inf"))
        await asyncio.sleep(0.05)  # let calls drafted ahead and then left unused finish
        for handle in (target, draft):   # read now: a closing channel frees what its router held
            handle.held_at_end = handle.engine.histories.held_length(state.request_id)
        return state, target, draft

    return asyncio.run(scenario())


def test_rounds_carry_only_the_tokens_committed_since_the_last_call(pair):
    state, target, draft = run_request(pair, {})
    assert state.finish_reason == "length" and state.stats.rounds > 5
    for handle in (target, draft):
        assert handle.updates[0].start == 0 and list(handle.updates[0].new_tokens) == PROMPT
        assert all(0 < update.start and len(update.new_tokens) <= NUM_DRAFT + 1 for update in handle.updates[1:])
        assert handle.unknown == 0
    # the target holds what it was last told: the history before the last round's tokens
    assert target.held_at_end == target.updates[-1].length < len(state.history)


def test_an_engine_that_forgot_the_request_gets_the_whole_history_once_and_the_output_is_unchanged(pair):
    reference, _, _ = run_request(pair, {})
    state, target, draft = run_request(pair, {"draft": 3, "target": 5})
    assert state.output_ids == reference.output_ids
    for handle in (target, draft):
        assert handle.unknown == 1
        whole = [update for update in handle.updates[1:] if update.start == 0]
        assert len(whole) == 1 and len(whole[0].new_tokens) > len(PROMPT)


def test_each_round_says_whether_it_is_a_steady_round_of_the_fan_out_on_or_off(pair):
    """The fan-out's payoff is measured on steady rounds only (policies.fan_out.FanOutPayoff): a
    round that pre-drafts after one that did (on), or neither (off). A round where the fan-out
    changed is neither: its wall time holds one side's hit or miss and the other side's verify."""
    pattern = [True, True, True, False, False, False, True, False, True, True]   # pre-draft in round i?

    async def scenario():
        _, _, state, engines = await greedy_request(pair, 120)
        speculation = SpeculationSpec(num_draft_tokens=NUM_DRAFT, adaptive=False)
        observer, records = recording_observer(speculation)
        fanned = []

        def choose_fan_out(state: RequestState, num_draft: int) -> FanOut:
            fanned.append(pattern[len(fanned) % len(pattern)])
            return FanOut((2,) if fanned[-1] else (), num_draft)

        loop = RoundLoop(state, engines, observer, lambda chunk: None, lambda state: state.draft_budget(NUM_DRAFT),
                         lambda: 1, speculation, choose_fan_out=choose_fan_out)
        await loop.run(0.0, float("inf"))
        await asyncio.sleep(0.05)
        return records, fanned

    records, fanned = asyncio.run(scenario())
    assert len(records) == len(fanned) > 10
    expected = [None] + [now if now == before else None for before, now in zip(fanned, fanned[1:])]
    steady = [record.predrafting if record.num_drafted else None for record in records]
    assert steady == [e if record.num_drafted else None for e, record in zip(expected, records)]
    assert {True, False, None} <= set(steady)


def one_by_one() -> Callable[[RequestState], int]:
    """A depth chooser under which every round is target-only and none is queued behind another:
    a target-only round asks for a depth at its start (answered 0) and once more for the round
    after it (RoundLoop._next_is_target_only, answered NUM_DRAFT), so it never queues that one."""
    answers = itertools.cycle([0, NUM_DRAFT])
    return lambda state: next(answers)


def in_phases(tokens: int) -> Callable[[RequestState], int]:
    """A depth chooser that speculates (K = NUM_DRAFT) while the output's length is in an odd
    stretch of `tokens` tokens and not (K = 0, the policy's "not at all") in an even one."""
    return lambda state: state.draft_budget(NUM_DRAFT) if (len(state.output_ids) // tokens) % 2 else 0


def run_with_target_only_steps(pair, params: SamplingParams, target_only_steps: int,
                               choose_depth: Callable[[RequestState], int] = lambda state: 0):
    """One request to the end on a target and a draft engine, K as choose_depth says (default: 0,
    every round target-only) -> (state, its chunks, its round records, the target)."""

    async def scenario():
        target, _, state, engines = await request_on_engines(pair, params)
        speculation = SpeculationSpec(num_draft_tokens=NUM_DRAFT, adaptive=False, target_only_steps=target_only_steps)
        observer, records = recording_observer(speculation)
        chunks = []
        loop = RoundLoop(state, engines, observer, chunks.append, choose_depth, lambda: 1, speculation)
        await loop.run(0.0, float("inf"))
        await asyncio.sleep(0.05)
        return state, chunks, records, target

    return asyncio.run(scenario())


def test_target_only_rounds_of_several_steps_commit_what_one_step_rounds_commit(pair):
    """A round without a block decodes up to speculation.target_only_steps tokens in the target:
    the same tokens, logprobs and finish as one-token rounds (greedy, also between speculative
    rounds; seeded sampled, whose draws come from the request's own streams either way), in a
    quarter of the rounds, none past max_tokens."""
    greedy = SamplingParams(temperature=0, max_tokens=30)
    one_step, _, _, _ = run_with_target_only_steps(pair, greedy, 1, one_by_one())
    mixed, _, mixed_records, _ = run_with_target_only_steps(pair, greedy, 4, in_phases(8))
    assert mixed.output_ids == one_step.output_ids and mixed.finish_reason == "length"
    assert {record.num_drafted for record in mixed_records} == {0, NUM_DRAFT}

    sampled = SamplingParams(temperature=0.9, max_tokens=30, seed=11, logprobs=2, frequency_penalty=0.5)
    (alone, alone_chunks, alone_records, _), (stepped, stepped_chunks, stepped_records, _) = (
        run_with_target_only_steps(pair, sampled, steps, one_by_one()) for steps in (1, 4))
    assert stepped.output_ids == alone.output_ids and len(stepped.output_ids) == 30
    entries = [[entry for chunk in chunks for entry in chunk["logprobs"]] for chunks in (alone_chunks, stepped_chunks)]
    assert entries[0] == entries[1] and [entry["token_id"] for entry in entries[1]] == stepped.output_ids
    assert [record.target_passes for record in alone_records] == [1] * 29
    # 29 tokens after the prefill's first: seven rounds of four and one of the last token
    assert [record.target_passes for record in stepped_records] == [4] * 7 + [1]


def run_without_draft(pair, params: SamplingParams, target_only_steps: int):
    """One request to the end on a target engine alone (a request without a draft engine) ->
    (state, its chunks, its round records, the target, the sequences it held after the release)."""

    async def scenario():
        target = ListeningEngine(TargetEngine(spec(pair[0]), options()))
        state = RequestState("r", PROMPT, params, None, 256, detokenize=lambda ids: " ".join(map(str, ids)))
        engines = RequestEngines(InProcessWorkers(await target.listen()), None, LimitsSpec(), ChannelPool())
        speculation = SpeculationSpec(num_draft_tokens=NUM_DRAFT, adaptive=False, target_only_steps=target_only_steps)
        observer, records = recording_observer(speculation)
        chunks = []
        loop = RoundLoop(state, engines, observer, chunks.append, lambda state: 0, lambda: 1, speculation)
        await loop.run(0.0, float("inf"))
        await asyncio.sleep(0.05)   # a round dropped at the end may still be decoding: the release waits for it
        target.engine.loop.release(state.request_id)
        held = await target.engine.active_sequences()
        return state, chunks, records, target, held

    return asyncio.run(scenario())


@pytest.mark.parametrize("target_only_steps", [1, 4])
def test_queued_target_only_rounds_commit_what_rounds_sent_one_by_one_commit(pair, target_only_steps):
    """A request without a draft engine queues each target-only round behind the one in flight, so
    the target decodes on instead of waiting for the router between rounds: the same tokens,
    logprobs and finish as rounds sent one at a time (greedy; seeded sampled with a penalty, whose
    draws come from the request's own stream in the same order), every round after the first
    answered by the round queued for it, none past max_tokens, nothing held after the release."""
    for params in (SamplingParams(temperature=0, max_tokens=30, logprobs=2),
                   SamplingParams(temperature=0.9, max_tokens=30, seed=11, logprobs=2, frequency_penalty=0.5)):
        alone, alone_chunks, _, _ = run_with_target_only_steps(pair, params, 1, one_by_one())
        queued, queued_chunks, records, target, held = run_without_draft(pair, params, target_only_steps)
        assert queued.output_ids == alone.output_ids and queued.finish_reason == alone.finish_reason == "length"
        entries = [[entry for chunk in chunks for entry in chunk["logprobs"]] for chunks in (alone_chunks,
                                                                                          queued_chunks)]
        assert entries[0] == entries[1]
        assert target.continued == len(records) - 1 and target.unknown == 0 and held == []
        assert all(record.hops_s >= 0 and record.target_s >= 0 for record in records)


def test_a_queued_round_behind_a_round_that_ends_the_request_is_dropped(pair):
    """A request that a stop token ends mid-round finishes there; the round queued behind it is
    given up and the release frees what the target decoded for it."""
    sampled = SamplingParams(temperature=1.0, max_tokens=30, seed=5, frequency_penalty=1.0)
    reference, _, _, _ = run_with_target_only_steps(pair, sampled, 1, one_by_one())
    ends_at = next(i for i, token in enumerate(reference.output_ids) if i >= 6 and token not in reference.output_ids[:i])
    stopped = SamplingParams(temperature=1.0, max_tokens=30, seed=5, frequency_penalty=1.0, stop_token_ids=[reference.output_ids[ends_at]])
    state, _, _, target, held = run_without_draft(pair, stopped, 4)
    assert state.output_ids == reference.output_ids[:ends_at] and state.finish_reason == "stop"
    assert target.continued >= 1 and held == [] and target.engine.round_ends == {}


def test_a_request_whose_depth_is_0_queues_its_target_only_rounds_and_speculates_again_when_it_rises(pair):
    """A request with a draft engine whose depth is 0 (the policy speculating not at all under
    load) queues its target-only rounds as a request without one does: the same tokens, logprobs
    and finish as rounds sent one by one (seeded sampled with a penalty, its draws from its own
    stream in the same order), every round after the first answered by the round queued for it.
    When the depth rises, the round already queued runs first, then the request speculates again
    (greedy: the same tokens; a verify's log-probabilities come from a forward over the block,
    whose sums may round differently from a one-token step's)."""
    sampled = SamplingParams(temperature=0.9, max_tokens=30, seed=3, logprobs=2, frequency_penalty=0.5)
    alone, alone_chunks, _, _ = run_with_target_only_steps(pair, sampled, 1, one_by_one())
    queued, queued_chunks, records, target = run_with_target_only_steps(pair, sampled, 4)
    assert queued.output_ids == alone.output_ids and queued.finish_reason == alone.finish_reason == "length"
    assert [entry for chunk in queued_chunks for entry in chunk["logprobs"]] == \
        [entry for chunk in alone_chunks for entry in chunk["logprobs"]]
    assert target.continued == len(records) - 1 and target.unknown == 0

    greedy = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    alone, alone_chunks, _, _ = run_with_target_only_steps(pair, greedy, 1, one_by_one())
    mixed, mixed_chunks, records, target = run_with_target_only_steps(pair, greedy, 4, in_phases(10))
    assert mixed.output_ids == alone.output_ids and mixed.finish_reason == "length"
    alone_entries, mixed_entries = ([entry for chunk in chunks for entry in chunk["logprobs"]]
                                    for chunks in (alone_chunks, mixed_chunks))
    assert [e["logprob"] for e in mixed_entries] == pytest.approx([e["logprob"] for e in alone_entries], abs=1e-5)
    drafted = [record.num_drafted for record in records]
    assert 0 in drafted and NUM_DRAFT in drafted[drafted.index(0):]   # it speculates again after queuing
    assert target.continued >= 2 and target.unknown == 0


def test_a_profiled_request_splits_its_first_token_and_an_unprofiled_one_does_not(pair):
    """With the profiling switch (the router's round_stages list) the response's timings split the
    router's wait for the first token: Serve's engine lookup, the prefill's hops, its engine's
    loop wait and compute, which add up to no more than that wait (bench.round_profile reads them)."""
    speculation = SpeculationSpec(num_draft_tokens=NUM_DRAFT, adaptive=False)

    async def timings(profile: bool) -> dict:
        _, _, state, engines = await greedy_request(pair, 8)
        timed = RoundTimings(round_stages=[] if profile else None)
        observer = RoundObserver(timed, DepthChooser(speculation), RouterMetrics())
        loop = RoundLoop(state, engines, observer, lambda chunk: None, lambda state: state.draft_budget(NUM_DRAFT),
                         lambda: 1, speculation, profile)
        await loop.run(time.perf_counter(), float("inf"))
        return timed.to_dict()

    profiled = asyncio.run(timings(True))
    split = profiled["first_token_stages_ms"]
    assert set(split) == {"engine_lookup", "target_hop_out", "target_loop_wait", "target_compute", "target_hop_back"}
    assert all(value >= 0 for value in split.values()) and split["target_compute"] > 0
    assert sum(split.values()) <= profiled["time_to_first_token_ms"] + 1e-3
    assert "first_token_stages_ms" not in asyncio.run(timings(False))


class HeldWorkers:
    """A pool whose Serve lookup answers only once `answer` is set."""

    def __init__(self, endpoint: EngineEndpoint) -> None:
        self.answer = asyncio.Event()

        async def lookup(affinity_key=None) -> EngineEndpoint:
            await self.answer.wait()
            return endpoint
        self.get_engine = SimpleNamespace(remote=lookup)


@pytest.mark.parametrize("max_tokens", [1, 24])
def test_the_first_token_does_not_wait_for_the_draft_engines_lookup(pair, max_tokens):
    """The target prefills and the first token goes out while Serve has not yet named the draft
    engine; the rounds then draft as usual. A request that its first token ends stops the lookup,
    and the draft engine never hears of it."""
    speculation = SpeculationSpec(num_draft_tokens=NUM_DRAFT, adaptive=False)

    async def scenario():
        target, draft, state, engines = await greedy_request(pair, max_tokens)
        held = HeldWorkers(await draft.listen())
        engines.draft_workers = held
        chunks = []
        observer = RoundObserver(RoundTimings(), DepthChooser(speculation), RouterMetrics())
        loop = RoundLoop(state, engines, observer, chunks.append, lambda state: state.draft_budget(NUM_DRAFT),
                         lambda: 1, speculation)
        running = asyncio.ensure_future(loop.run(time.perf_counter(), float("inf")))
        for _ in range(1000):   # up to 10 s: the code before this waited for the lookup, forever here
            if chunks or running.done():
                break
            await asyncio.sleep(0.01)
        first_before_lookup = bool(chunks) and not held.answer.is_set()
        held.answer.set()
        await running
        await asyncio.sleep(0.05)
        return first_before_lookup, state, draft, engines

    first_before_lookup, state, draft, engines = asyncio.run(scenario())
    assert first_before_lookup
    if max_tokens == 1:
        assert state.finish_reason == "length" and engines.draft is None and draft.updates == []
    else:
        assert state.stats.num_drafted > 0 and draft.updates and engines.draft in engines.touched


def test_a_draft_engine_named_in_the_turn_its_request_ends_is_sent_nothing(pair):
    """Serve names the draft engine in the very event-loop turn the request ends (the client left
    during the target's prefill): asyncio.wait_for may then hand the lookup its answer despite the
    cancel, but the request is gone and the router releases only the engines touched by then, so
    the draft engine must not be told of it (it would hold the request's KV with no one to free it)."""

    async def scenario():
        target, draft, state, engines = await greedy_request(pair, 8)
        answer = asyncio.get_running_loop().create_future()
        engines.draft_workers = SimpleNamespace(get_engine=SimpleNamespace(remote=lambda: answer))
        await engines.acquire(state)
        await asyncio.sleep(0)   # the lookup waits on Serve's answer
        answer.set_result(await draft.listen())
        engines.abandon_draft()   # in the same turn
        await asyncio.sleep(0.2)
        return engines, draft, await draft.engine.active_sequences()

    engines, draft, held = asyncio.run(scenario())
    assert engines.touched == [engines.target] and engines.draft is None
    assert draft.updates == [] and held == []
