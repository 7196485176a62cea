"""The engine actors' bodies, in-process (no Ray): calls waiting together share one forward, the
answers equal unbatched ones, releases and full slots behave.

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md)."""

import asyncio
import inspect
import time

import pytest
import torch

from specserve.common.channel import Channel
from specserve.common.config import SpecServeConfig
from specserve.common.messages import DecodedSteps, HistoryUpdate
from specserve.decoding.batched_runner import BatchedModelRunner
from specserve.decoding.scheduler import Scheduler
from specserve.decoding.grammar import GrammarSpec
from specserve.decoding.sampling import SamplingParams, make_generator
from specserve.decoding.speculation import target_token
from specserve.decoding.proposer_registry import PROPOSERS, ProposerKind
from specserve.decoding.proposers import SAGUARO_LOWERED, DraftModelProposer, Proposal, ProposeCall, SaguaroSampling
from specserve.deployments.committed_history import history_digest, whole_history as whole
from specserve.deployments.draft_worker import DraftEngine
from specserve.deployments.engine_group import RankFollower
from specserve.deployments.engine_process import EngineProcess
from specserve.deployments.engine_loop import EngineOverloadedError, SequenceReleasedError
from specserve.deployments.target_worker import TargetEngine
from tests.tiny_pair import make_tiny_pair

GREEDY = SamplingParams(temperature=0, max_tokens=16)
SAMPLED = SamplingParams(temperature=0.8, max_tokens=16)
HISTORIES = [[5, 17, 42, 8, 3, 33], [60, 2, 2, 9, 14, 27, 50, 11, 7], [12, 40, 21], list(range(40, 80))]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("pair"))


def spec(path, max_sequences: int = 8) -> dict:
    return {"path": str(path), "dtype": "float32", "device": "cpu", "torch_threads": 1,
            "max_sequences": max_sequences}


def options(**overrides) -> dict:
    return {**SpecServeConfig().engine_options(), **overrides}


async def verify(engine: TargetEngine, seq_id: str, token_ids, num_rows: int, params, *args, **kwargs):
    """engine.verify of token_ids' last num_rows - 1 tokens as the block, the rest sent whole."""
    committed = len(token_ids) - (num_rows - 1)
    return await engine.verify(seq_id, whole(token_ids[:committed]), Proposal(list(token_ids[committed:]), None),
                               params, *args, **kwargs)


# What an engine's own coroutines call in process rather than through Ray: the queue the channel
# methods put their calls on.
IN_PROCESS_ONLY = {"submit"}


def test_the_engines_actor_answers_every_coroutine_an_engine_offers_beside_its_channel():
    """An engine runs inside an EngineProcess actor, whose methods are all Ray reaches: every
    public coroutine of an engine that is not a channel method must be one of them, or a call
    to it through Ray fails at run time. A tensor-parallel follower's methods likewise."""
    offered = set(dir(EngineProcess))
    for engine in (DraftEngine, TargetEngine):
        coroutines = {name for name in dir(engine) if not name.startswith("_")
                      and inspect.iscoroutinefunction(getattr(engine, name))}
        assert coroutines - engine.channel_methods - IN_PROCESS_ONLY - offered == set(), engine.__name__
    follower = {name for name in vars(RankFollower) if not name.startswith("_")}
    assert follower - offered == set()


def test_concurrent_verifies_share_a_forward_and_match_unbatched_rows(pair):
    target_path, _ = pair
    reference = Scheduler(BatchedModelRunner(str(target_path)))

    async def scenario():
        engine = TargetEngine(spec(target_path), options())
        answers = await asyncio.gather(*[verify(engine, f"s{i}", history, 3, GREEDY)
                                         for i, history in enumerate(HISTORIES)])
        return engine, [rows for rows, _ in answers]

    engine, rows = asyncio.run(scenario())
    for i, history in enumerate(HISTORIES):
        expected = torch.argmax(reference.forward(f"s{i}", history, 3), dim=-1).tolist()
        assert rows[i] == expected
    assert engine.loop.stats.iterations == 1 and engine.loop.stats.rows_total == len(HISTORIES)
    assert sorted(asyncio.run(engine.active_sequences())) == [f"s{i}" for i in range(len(HISTORIES))]


def test_an_engine_answers_only_the_round_calls_over_a_channel(pair):
    """Routers reach an engine's verify and release over its channel (common.channel); nothing
    else an engine actor offers (stats, weight loads) is reachable that way."""
    target_path, _ = pair

    async def scenario():
        engine = TargetEngine(spec(target_path), options())
        channel = Channel(await engine.open_channel("127.0.0.1"))
        rows, _ = await channel.call("verify", "a", whole(HISTORIES[0]), None, GREEDY)
        with pytest.raises(ValueError, match="no 'stats'"):
            await channel.call("stats")
        await channel.call("release", "a")
        return rows, await engine.active_sequences()

    rows, held = asyncio.run(scenario())
    assert len(rows) == 1 and held == []


def test_a_routers_sequences_go_when_its_channel_closes_and_another_routers_stay(pair):
    """A router that dies cannot release what it held: its channel's closing frees the sequences
    it last called about at once (not after the idle timeout); another router's stay."""
    target_path, _ = pair

    async def scenario():
        engine = TargetEngine(spec(target_path), options())
        address = await engine.open_channel("127.0.0.1")
        gone, staying = Channel(address), Channel(address)
        await gone.call("verify", "a", whole(HISTORIES[0]), None, GREEDY)
        await staying.call("verify", "b", whole(HISTORIES[1]), None, GREEDY)
        held = [await engine.active_sequences()]
        gone.close()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if await engine.active_sequences() == ["b"]:
                break
        held.append(await engine.active_sequences())
        rows, _ = await staying.call("verify", "b", HistoryUpdate(len(HISTORIES[1]), (), history_digest(HISTORIES[1])),
                                     None, GREEDY)
        return held, rows

    held, rows = asyncio.run(scenario())
    assert held == [["a", "b"], ["b"]]
    assert len(rows) == 1   # b's history is still known: no UnknownHistory


def test_draft_calls_that_arrive_after_their_release_hold_nothing(pair):
    """An asyncio actor does not run a caller's calls in the order sent: a propose (or prefill)
    the router sent before a cancelled request's release can start after it. It is refused, so
    the draft engine creates no KV state nobody would release (found as one sequence left in the
    draft engine after tests/test_reliability.py's storm of dropped connections)."""
    target_path, draft_path = pair

    async def scenario():
        engine = DraftEngine("draft", spec(draft_path), str(target_path), options())
        await engine.release("gone")
        with pytest.raises(SequenceReleasedError):
            await engine.propose("gone", whole(HISTORIES[0]), 3, GREEDY, None)
        with pytest.raises(SequenceReleasedError):
            await engine.prefill("gone", whole(HISTORIES[0]))
        return await engine.active_sequences()

    assert asyncio.run(scenario()) == []


def test_a_sampled_answer_holds_the_processed_target_rows_numbers(pair):
    """A sampled verify answers O(K) numbers (decoding.compact_verify.TargetNumbers): p(x) of the
    block's token under the processed target row, and draws from the rows' support."""
    target_path, _ = pair
    reference = Scheduler(BatchedModelRunner(str(target_path)))

    async def scenario():
        engine = TargetEngine(spec(target_path), options())
        return await asyncio.gather(*[verify(engine, f"s{i}", h, 2, SAMPLED) for i, h in enumerate(HISTORIES)])

    from specserve.decoding.sampling import logits_to_probs
    for i, (numbers, _) in enumerate(asyncio.run(scenario())):
        expected = logits_to_probs(reference.forward(f"s{i}", HISTORIES[i], 2), SAMPLED)
        assert numbers.target_of_draft == pytest.approx([expected[0, HISTORIES[i][-1]].item()], abs=1e-5)
        assert expected[0, numbers.recovered[0]] > 0 and expected[1, numbers.bonus] > 0


def test_a_long_prompt_is_prefilled_in_chunks_beside_running_verifies(pair):
    target_path, _ = pair
    reference = Scheduler(BatchedModelRunner(str(target_path)))
    long_prompt = [(7 * i) % 90 + 3 for i in range(100)]

    async def scenario():
        engine = TargetEngine(spec(target_path), options(prefill_token_budget=32))
        await verify(engine, "running", HISTORIES[0], 1, GREEDY)
        prefill = asyncio.create_task(verify(engine, "prompt", long_prompt, 1, GREEDY))
        steps = [await verify(engine, "running", HISTORIES[0] + [9] * k, 2, GREEDY) for k in range(1, 4)]
        return engine, await prefill, steps

    engine, (rows, _), steps = asyncio.run(scenario())
    assert rows == torch.argmax(reference.forward("p", long_prompt, 1), dim=-1).tolist()
    assert engine.scheduler.blocks.num_cached("prompt") == len(long_prompt)
    # Every running step finished while the 100-token prompt went through in 32-token chunks.
    assert len(steps) == 3 and engine.loop.stats.iterations >= 4


TICKET_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
                 "required": ["name", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=16),
    SamplingParams(temperature=0.8, max_tokens=16, seed=7, frequency_penalty=1.5, logprobs=2),
    SamplingParams(temperature=0.8, max_tokens=16, seed=3, min_tokens=4,
                   structured=GrammarSpec.json_schema(TICKET_SCHEMA, "response_format", whitespace_flexible=False)),
], ids=["greedy", "seeded-penalties-logprobs", "seeded-json-schema"])
def test_a_target_only_round_of_several_steps_answers_what_as_many_plain_rounds_answer(pair, params):
    """A round without a block decodes up to `steps` tokens in the target (TargetEngine.step):
    each step's answer equals a plain round's on the history the steps before committed (rows,
    seeded draws, logprob entries); the output-position bookkeeping of penalties, min_tokens and the
    grammar moves on with each step (a step counting the prompt one token longer breaks the
    grammar's sync and ends the round early)."""
    target_path, _ = pair
    steps = 6

    async def scenario():
        plain, stepping = TargetEngine(spec(target_path), options()), TargetEngine(spec(target_path), options())
        history, expected = list(HISTORIES[0]), []
        for output_index in range(steps):
            answer, _ = await plain.verify("s", whole(history), None, params, output_index)
            expected.append(answer)
            history.append(target_token(answer[0] if params.logprobs is not None else answer))
        decoded, _ = await stepping.verify("s", whole(HISTORIES[0]), None, params, 0, None, None, "block", None, steps)
        tokens = history[len(HISTORIES[0]):]
        stopped = None
        if params.min_tokens == 0:   # (below min_tokens a stop id is masked, which changes the rows)
            # a stop id ends the steps at its first token that is one
            stopping = params.model_copy(update={"stop_token_ids": [tokens[2]]})
            stopped, _ = await stepping.verify("t", whole(HISTORIES[0]), None, stopping, 0, None, None, "block",
                                               None, steps)
            stopped = (stopped.answers, tuple(expected[:tokens.index(tokens[2]) + 1]))
        return expected, decoded, stopped

    expected, decoded, stopped = asyncio.run(scenario())
    assert isinstance(decoded, DecodedSteps) and decoded.answers == tuple(expected)
    if stopped is not None:
        assert stopped[0] == stopped[1]


def test_a_target_only_rounds_later_step_that_fails_ends_it_with_the_answers_so_far(pair):
    """The third step's forward fails: the round answers its first two steps (the next round meets
    the error again and reports it), and the engine keeps no state of the round."""
    target_path, _ = pair

    async def scenario():
        engine = TargetEngine(spec(target_path), options())
        forward_batch, forwards = engine.scheduler.forward_batch, []

        def failing_third(calls):
            forwards.append(len(calls))
            if len(forwards) == 3:
                raise RuntimeError("the device fell over")
            return forward_batch(calls)

        engine.scheduler.forward_batch = failing_third
        decoded, _ = await engine.verify("s", whole(HISTORIES[0]), None, GREEDY, 0, None, None, "block", None, 6)
        return engine, decoded

    engine, decoded = asyncio.run(scenario())
    assert isinstance(decoded, DecodedSteps) and len(decoded.answers) == 2
    assert engine.decoding == {}


def test_prompt_logprobs_are_computed_chunk_by_chunk_and_equal_the_whole_prompts(pair):
    """A prefill asked for the prompt's log-probabilities runs in chunks like any prefill: no
    forward returns more rows than a chunk's (32 here, the prompt is 100 tokens), and the entries
    equal HF's forward of the whole prompt at once; the first token has none, and the usual answer
    (the first output token) is unchanged."""
    from transformers import AutoModelForCausalLM

    target_path, _ = pair
    long_prompt = [(7 * i) % 90 + 3 for i in range(100)]
    most_rows = []   # the rows of each forward's largest logits tensor

    async def scenario():
        engine = TargetEngine(spec(target_path), options(prefill_token_budget=32))
        forward_batch = engine.scheduler.forward_batch

        def recording(calls):
            logits = forward_batch(calls)
            most_rows.append(max(rows.shape[0] for rows in logits))
            return logits

        engine.scheduler.forward_batch = recording
        plain, _ = await verify(engine, "plain", long_prompt, 1, GREEDY)
        with_prompt, _ = await asyncio.wait_for(verify(engine, "echo", long_prompt, 1, GREEDY, prompt_logprobs=2), 60)
        return engine, plain, with_prompt

    engine, plain, (rows, entries) = asyncio.run(scenario())
    assert rows == plain and engine.scheduler.blocks.num_cached("echo") == len(long_prompt)
    assert max(most_rows) <= 32 and len(most_rows) >= 8, most_rows   # 4 chunks each, plain and scored
    assert not engine.prompt_entries
    model = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([long_prompt])).logits[0].float(), dim=-1)
    assert entries[0] == {"token_id": long_prompt[0], "logprob": None, "top": None, "rank": None}
    assert [entry["token_id"] for entry in entries] == long_prompt
    for position, entry in enumerate(entries[1:]):
        row = expected[position]
        assert entry["logprob"] == pytest.approx(float(row[long_prompt[position + 1]]), abs=1e-4)
        assert [i for i, _ in entry["top"]] == torch.topk(row, 2).indices.tolist()
        assert entry["rank"] == int((row > row[long_prompt[position + 1]] + 1e-6).sum()) + 1


def test_release_frees_the_slot_and_drops_queued_calls(pair):
    target_path, _ = pair

    async def scenario():
        engine = TargetEngine(spec(target_path, max_sequences=1), options(admission_timeout_s=5))
        await verify(engine, "a", HISTORIES[0], 1, GREEDY)
        waiting = asyncio.create_task(verify(engine, "b", HISTORIES[1], 1, GREEDY))  # no slot: waits
        doomed = asyncio.create_task(verify(engine, "c", HISTORIES[2], 1, GREEDY))
        await asyncio.sleep(0.1)
        assert not waiting.done() and engine.loop.queue_depth == 2
        await engine.release("c")            # c's request went away while it waited
        with pytest.raises(SequenceReleasedError):
            await doomed
        await engine.release("a")            # a finished: b gets its slot
        await waiting
        return await engine.active_sequences()

    assert asyncio.run(scenario()) == ["b"]


def test_a_new_sequence_gets_overloaded_when_no_slot_frees_in_time(pair):
    target_path, _ = pair

    async def scenario():
        engine = TargetEngine(spec(target_path, max_sequences=1), options(admission_timeout_s=0.2))
        await verify(engine, "a", HISTORIES[0], 1, GREEDY)
        with pytest.raises(EngineOverloadedError):
            await verify(engine, "b", HISTORIES[1], 1, GREEDY)
        rows, _ = await verify(engine, "a", HISTORIES[0] + [4], 1, GREEDY)  # the admitted one is unaffected
        return rows

    assert len(asyncio.run(scenario())) == 1


def test_a_call_past_the_context_fails_alone(pair):
    target_path, _ = pair

    async def scenario():
        engine = TargetEngine(spec(target_path), options())
        too_long = [3] * (engine.runner.max_context + 1)
        return await asyncio.gather(verify(engine, "ok", HISTORIES[0], 1, GREEDY),
                                    verify(engine, "bad", too_long, 1, GREEDY), return_exceptions=True)

    ok, bad = asyncio.run(scenario())
    assert isinstance(bad, Exception) and "context" in str(bad)
    assert len(ok[0]) == 1


def drafting_alone(draft_path) -> DraftModelProposer:
    """The draft engine's proposer, made alone: the same q cut and Saguaro sampling."""
    engine_options = options()
    return DraftModelProposer(Scheduler(BatchedModelRunner(str(draft_path))), max_candidates=engine_options["draft_top_k"],
                              saguaro=SaguaroSampling(SAGUARO_LOWERED, engine_options["saguaro_downweight"]))


def seeded_alone(alone: DraftModelProposer, seq_id: str, history, num_tokens: int, seed: int):
    """A seeded sampled block drafted alone: a seeded request's rows are Saguaro-lowered."""
    return alone.propose_batch([ProposeCall(seq_id, history, num_tokens, SAMPLED, make_generator(seed),
                                            lowered=True)])[0]


def test_batched_drafts_equal_drafts_made_alone(pair):
    target_path, draft_path = pair
    alone = drafting_alone(draft_path)

    async def scenario():
        engine = DraftEngine("draft", spec(draft_path), str(target_path), options())
        await asyncio.gather(*[engine.prefill(f"s{i}", whole(h)) for i, h in enumerate(HISTORIES)])
        held = [HistoryUpdate(len(h), (), history_digest(h)) for h in HISTORIES]  # nothing new since the prefill
        greedy = await asyncio.gather(*[engine.propose(f"s{i}", held[i], 2 + i, GREEDY, None)
                                        for i, h in enumerate(HISTORIES)])
        sampled = await asyncio.gather(*[engine.propose(f"t{i}", whole(h), 3, SAMPLED, 100 + i)
                                         for i, h in enumerate(HISTORIES)])
        stats = await engine.stats()
        return greedy, sampled, stats

    greedy, sampled, stats = asyncio.run(scenario())
    for i, history in enumerate(HISTORIES):
        assert greedy[i][0].token_ids == alone.propose(f"g{i}", history, 2 + i, GREEDY).token_ids
        expected = seeded_alone(alone, f"x{i}", history, 3, 100 + i)
        assert sampled[i][0].token_ids == expected.token_ids
        torch.testing.assert_close(torch.as_tensor(sampled[i][0].support.probs), expected.support.probs, atol=1e-4,
                                   rtol=0)
    assert stats.pool == "draft" and stats.sequences == 2 * len(HISTORIES)
    assert stats.batch_rows_total > stats.forwards  # drafting was batched


def test_a_propose_arriving_mid_block_joins_the_next_step_and_drafts_what_it_would_alone(pair):
    """Continuous batching at step granularity: a propose that arrives while another request's
    8-token block is being drafted has its first forward before that block's last one (counted
    in forwards, not time); each block equals the one drafted alone (seeded sampled and greedy)."""
    target_path, draft_path = pair
    alone = drafting_alone(draft_path)
    forwards: list[list[str]] = []   # the sequences in each draft forward, in order

    async def scenario():
        engine = DraftEngine("draft", spec(draft_path), str(target_path), options())
        loop, late = asyncio.get_running_loop(), []
        forward_batch = engine.scheduler.forward_batch

        def recording(calls):   # in the engine's worker thread, while the event loop takes calls
            forwards.append([call.seq_id for call in calls])
            if not late:
                late.append(asyncio.run_coroutine_threadsafe(
                    engine.propose("late", whole(HISTORIES[1]), 2, GREEDY, None), loop))
            return forward_batch(calls)

        engine.scheduler.forward_batch = recording
        long = await engine.propose("long", whole(HISTORIES[0]), 8, SAMPLED, 5)
        return long[0], (await asyncio.wrap_future(late[0]))[0]

    long, late = asyncio.run(scenario())
    with_long = [i for i, seqs in enumerate(forwards) if "long" in seqs]
    with_late = [i for i, seqs in enumerate(forwards) if "late" in seqs]
    assert len(with_long) >= 8 and with_late[0] < with_long[-1], forwards
    expected = seeded_alone(alone, "a", HISTORIES[0], 8, 5)
    assert long.token_ids == expected.token_ids and len(long.token_ids) == 8
    torch.testing.assert_close(torch.as_tensor(long.support.probs), expected.support.probs, atol=1e-4, rtol=0)
    assert late.token_ids == alone.propose("b", HISTORIES[1], 2, GREEDY).token_ids


def test_an_idle_loop_reads_idle_now_not_as_busy_as_at_its_last_forward():
    """The policy scales a pool down from busy shares between reports: an engine with no calls
    must show its idle time as it passes, not only once the next call ends the wait."""
    from types import SimpleNamespace

    from specserve.deployments.engine_loop import EngineLoop

    def slow_iteration(calls):
        import time
        time.sleep(0.05)
        return {index: "done" for index in range(len(calls))}, len(calls)

    async def scenario():
        loop = EngineLoop(slow_iteration, lambda seq_id: None)
        assert await loop.submit(SimpleNamespace(seq_id="a")) == "done"
        before = loop.stats
        await asyncio.sleep(0.3)
        after = loop.stats
        assert before.busy_s >= 0.05 and after.busy_s == pytest.approx(before.busy_s)
        assert after.idle_s - before.idle_s >= 0.25

    asyncio.run(scenario())


def test_a_call_that_takes_several_iterations_runs_them_in_the_worker_unless_a_call_arrives():
    """A call run for four iterations before it is answered (a block mid-draft) runs them one
    after another in the worker thread: its span starts at the first. A call that arrives while
    they run joins the very next iteration instead of waiting for the first call's answer."""
    import threading
    from types import SimpleNamespace

    from specserve.deployments.engine_loop import EngineLoop

    batches, first_ran, go_on = [], threading.Event(), threading.Event()
    gate = [False]   # set: the first iteration waits for go_on (after first_ran)

    def iterate(calls):   # "a" is answered at its fourth iteration, "b" at its first
        batches.append(([call.seq_id for call in calls], threading.current_thread().name, time.perf_counter()))
        runs = sum("a" in seqs for seqs, _, _ in batches)
        if runs == 1 and len(batches) == 1 and gate[0]:
            first_ran.set()
            go_on.wait(5)
        answers = {index: call.seq_id for index, call in enumerate(calls) if call.seq_id == "b"}
        if runs == 4:
            answers[[call.seq_id for call in calls].index("a")] = "a"
        return answers, len(calls)

    async def scenario():
        loop = EngineLoop(iterate, lambda seq_id: None)
        answer, started_s = await loop.submit_timed(SimpleNamespace(seq_id="a"))
        return answer, started_s

    answer, started_s = asyncio.run(scenario())
    assert answer == "a" and [seqs for seqs, _, _ in batches] == [["a"]] * 4
    assert {thread for _, thread, _ in batches} == {batches[0][1]} != threading.current_thread().name
    assert started_s <= batches[0][2], "the span starts at the call's first iteration"

    async def arrival():
        loop = EngineLoop(iterate, lambda seq_id: None)
        first = asyncio.ensure_future(loop.submit(SimpleNamespace(seq_id="a")))
        await asyncio.get_running_loop().run_in_executor(None, first_ran.wait, 5)
        second = asyncio.ensure_future(loop.submit(SimpleNamespace(seq_id="b")))
        await asyncio.sleep(0.05)
        go_on.set()
        return await asyncio.gather(first, second)

    batches.clear()
    gate[0] = True
    assert asyncio.run(arrival()) == ["a", "b"]
    assert [seqs for seqs, _, _ in batches][:2] == [["a"], ["a", "b"]], batches

    async def reader():   # a stats reader gets its moment between two of the four iterations
        loop = EngineLoop(iterate, lambda seq_id: None)
        first = asyncio.ensure_future(loop.submit(SimpleNamespace(seq_id="a")))
        await asyncio.get_running_loop().run_in_executor(None, first_ran.wait, 5)
        between = asyncio.ensure_future(loop.between_iterations())
        await asyncio.sleep(0.05)
        go_on.set()
        await between
        seen = len(batches)
        return await first, seen

    batches.clear()
    first_ran.clear()
    go_on.clear()
    assert asyncio.run(reader()) == ("a", 1)


def test_a_call_waits_for_kv_blocks_then_runs_or_gets_overloaded(pair):
    """A budget of 20 blocks of 16 tokens (the tiny target's max_model_len of 256 needs 16): a
    sequence holding 13 leaves too few for a 120-token prompt, which queues until the first is
    released, as a full slot table made calls queue; past the deadline, "overloaded"."""
    target_path, _ = pair
    budget_gb = 20 * 16 * 512 / 2**30   # 512 bytes a token: 2 x 2 layers x 4 heads x 8 x 4 B

    async def scenario():
        engine = TargetEngine({**spec(target_path), "kv_cache_memory_gb": budget_gb}, options(admission_timeout_s=1))
        assert engine.runner.kv_capacity.num_blocks == 20
        await verify(engine, "a", [5 + i % 80 for i in range(200)], 1, GREEDY)
        waiting = asyncio.create_task(verify(engine, "b", [7 + i % 80 for i in range(120)], 1, GREEDY))
        await asyncio.sleep(0.1)
        assert not waiting.done() and engine.loop.queue_depth == 1
        stats = await engine.stats()
        assert (stats.kv.blocks_used, stats.kv.blocks_free, stats.kv.block_size) == (13, 7, 16)
        await engine.release("a")
        await waiting
        with pytest.raises(EngineOverloadedError):
            await verify(engine, "c", [9 + i % 80 for i in range(200)], 1, GREEDY)
        return await engine.stats()

    stats = asyncio.run(scenario())
    assert (stats.sequences, stats.kv.blocks_used, stats.kv.tokens_held) == (1, 8, 120)


def test_a_held_sequence_that_cannot_grow_preempts_the_youngest_which_is_prefilled_again(pair):
    """Two sequences fill a 20-block budget; the older one's verify needs one more block. Rather than
    both waiting out the deadline, the younger one's KV is freed (recompute preemption): the older
    verifies now, the younger's next call is prefilled again once blocks free up, from the committed
    history the engine kept (the router need not know), rows unchanged."""
    target_path, _ = pair
    reference = Scheduler(BatchedModelRunner(str(target_path)))
    older, younger = [5 + i % 80 for i in range(160)], [7 + i % 80 for i in range(160)]

    async def scenario():
        engine = TargetEngine({**spec(target_path), "kv_cache_memory_gb": 20 * 16 * 512 / 2**30},
                              options(admission_timeout_s=5))
        await verify(engine, "old", older, 1, GREEDY)
        await verify(engine, "young", younger, 1, GREEDY)
        grown, _ = await verify(engine, "old", older + [9, 9, 4], 4, GREEDY)
        assert engine.scheduler.preemptions == 1 and await engine.active_sequences() == ["old"]
        # the engine kept young's committed history: the call carries no token of it
        held = HistoryUpdate(len(younger), (), history_digest(younger))
        again = asyncio.create_task(engine.verify("young", held, Proposal([3, 3], None), GREEDY))
        await asyncio.sleep(0.1)
        assert not again.done()        # 10 blocks to prefill again, 9 free
        await engine.release("old")
        return grown, (await again)[0]

    grown, again = asyncio.run(scenario())
    assert grown == torch.argmax(reference.forward("o", older + [9, 9, 4], 4), dim=-1).tolist()
    assert again == torch.argmax(reference.forward("y", younger + [3, 3], 3), dim=-1).tolist()


def test_the_call_log_is_kept_only_with_the_profiling_switch(pair, monkeypatch):
    """bench.round_profile's outside check reads the engines' call logs; the served path keeps
    none unless SPECSERVE_PROFILE_ROUNDS is on."""
    from specserve.deployments.round_stages import PROFILE_ENV

    target_path, _ = pair

    async def logged_calls():
        engine = TargetEngine(spec(target_path), options())
        _, span = await verify(engine, "a", HISTORIES[0], 1, GREEDY)
        return span, await engine.call_times()

    monkeypatch.delenv(PROFILE_ENV, raising=False)
    assert asyncio.run(logged_calls())[1] == []
    monkeypatch.setenv(PROFILE_ENV, "1")
    span, calls = asyncio.run(logged_calls())
    assert calls == [("verify", "a", span.entered_s, span.left_s)]
    assert span.entered_s <= span.started_s <= span.left_s


def test_a_call_that_breaks_the_forward_fails_alone_and_its_neighbours_get_their_rows(pair):
    """A token id past the vocabulary makes the shared forward raise (as an out-of-memory prompt
    would): the batch's calls are run again alone, so only that call fails, with its own error."""
    target_path, _ = pair
    reference = Scheduler(BatchedModelRunner(str(target_path)))

    async def scenario():
        engine = TargetEngine(spec(target_path), options())
        broken = HISTORIES[0][:-1] + [10**6]
        answers = await asyncio.gather(verify(engine, "ok0", HISTORIES[1], 2, GREEDY),
                                       verify(engine, "bad", broken, 1, GREEDY),
                                       verify(engine, "ok1", HISTORIES[2], 1, GREEDY), return_exceptions=True)
        return answers, await engine.active_sequences()

    (ok0, bad, ok1), held = asyncio.run(scenario())
    assert isinstance(bad, IndexError)
    assert ok0[0] == torch.argmax(reference.forward("r0", HISTORIES[1], 2), dim=-1).tolist()
    assert ok1[0] == torch.argmax(reference.forward("r1", HISTORIES[2], 1), dim=-1).tolist()
    assert held == ["ok0", "ok1"]


def test_a_prompt_prefilled_in_chunks_for_longer_than_the_admission_deadline_is_not_expired(pair):
    """The admission deadline is for waiting to be admitted: a prompt that is admitted and makes
    progress chunk by chunk finishes however long its chunks take together."""
    target_path, _ = pair
    reference = Scheduler(BatchedModelRunner(str(target_path)))
    prompt = [5 + i % 80 for i in range(240)]
    deadline_s = 0.01   # far below 60 chunks' time on any box

    async def scenario():
        engine = TargetEngine(spec(target_path), options(admission_timeout_s=deadline_s, prefill_token_budget=4))
        started = asyncio.get_running_loop().time()
        rows, _ = await verify(engine, "long", prompt, 1, GREEDY)
        return rows, asyncio.get_running_loop().time() - started

    rows, elapsed_s = asyncio.run(scenario())
    assert elapsed_s > 3 * deadline_s  # the deadline passed mid-prefill (60 chunks of 4 tokens)
    assert rows == torch.argmax(reference.forward("r", prompt, 1), dim=-1).tolist()


def test_a_preempted_sequences_waiting_call_gets_the_full_deadline_again():
    """A call whose sequence is held waits without a deadline (it is past admission); once its
    sequence is let go (preempted), it waits for admission again, its clock started then, not
    when it arrived."""
    from types import SimpleNamespace

    from specserve.deployments.engine_loop import EngineLoop

    held, iterations = {"a"}, []

    def iterate(calls):  # held for 15 iterations (each waits 20 ms for a slot), answered 2 after
        iterations.append(len(calls))
        if len(iterations) == 15:
            held.discard("a")
        return ({0: "done"}, 1) if len(iterations) == 17 else ({}, 0)

    async def scenario():
        loop = EngineLoop(iterate, lambda seq_id: None, admission_timeout_s=0.25,
                          admitted=lambda seq_id: seq_id in held)
        started = time.monotonic()
        answer = await loop.submit(SimpleNamespace(seq_id="a"))
        return answer, time.monotonic() - started

    answer, waited_s = asyncio.run(scenario())
    assert answer == "done" and waited_s > 0.25   # it waited longer than the deadline in all


def test_stats_are_read_between_iterations_and_a_lone_forward_leaves_the_event_loop_free(pair):
    """While a lone call's forward runs (held up here inside the model), a ping answers at once and
    stats wait for the iteration to end: the worker thread changes the runner's sequences meanwhile."""
    import threading

    target_path, _ = pair

    async def scenario():
        engine = TargetEngine(spec(target_path), options())
        in_forward, go_on = threading.Event(), threading.Event()
        read_during_forward = []

        def hold(module, args):
            in_forward.set()
            go_on.wait(5)

        engine.runner.model.get_input_embeddings().register_forward_pre_hook(hold)
        active_sequences = engine.scheduler.blocks.active_sequences

        def spy():
            read_during_forward.append(in_forward.is_set() and not go_on.is_set())
            return active_sequences()

        engine.scheduler.blocks.active_sequences = spy
        running = asyncio.create_task(verify(engine, "a", HISTORIES[0], 1, GREEDY))
        while not in_forward.is_set():
            await asyncio.sleep(0.01)
        await asyncio.wait_for(engine.ping(), 1)   # the event loop is free mid-forward
        assert not running.done()
        stats = asyncio.create_task(engine.stats())
        await asyncio.sleep(0.05)
        assert not stats.done()                     # it waits for the iteration to end
        go_on.set()
        await running
        return (await stats).sequences, read_during_forward

    sequences, read_during_forward = asyncio.run(scenario())
    assert sequences == 1 and read_during_forward and not any(read_during_forward)


class RepeatLastProposer:
    """A proposer outside the shipped ones: it proposes the last token again, num_tokens times."""

    def propose(self, seq_id, history, num_tokens, params, generator=None, prompt_len=None) -> Proposal:
        return Proposal([history[-1]] * num_tokens, None)

    def propose_batch(self, calls) -> list[Proposal]:
        return [self.propose(c.seq_id, c.history, c.num_tokens, c.params) for c in calls]

    def release(self, seq_id) -> None:
        pass


def test_a_proposer_registered_by_name_is_accepted_by_the_config_and_built_by_the_draft_engine(pair, monkeypatch):
    """Adding a proposer is one entry in decoding.proposer_registry.PROPOSERS (docs/extending.md): the config
    validates the name and the draft engine builds and calls it, with no other edit."""
    target_path, _ = pair
    monkeypatch.setitem(PROPOSERS, "repeat", ProposerKind(False, lambda *_: RepeatLastProposer(), "repeat the last token"))
    config = SpecServeConfig.model_validate({"speculation": {"proposer": "repeat"}, "draft": None})
    assert config.uses_draft_workers and not config.speculation.needs_draft_model
    with pytest.raises(ValueError, match=r"unknown proposer 'eagle': choose one of \['draft', 'eagle3', 'ngram', 'repeat'\]"):
        SpecServeConfig.model_validate({"speculation": {"proposer": "eagle"}, "draft": None})

    async def scenario():
        engine = DraftEngine("repeat", None, str(target_path), options())
        try:
            return await engine.propose("r", whole(HISTORIES[0]), 3, GREEDY, None)
        finally:
            await engine.release("r")

    proposal, _ = asyncio.run(scenario())
    assert proposal.token_ids == [HISTORIES[0][-1]] * 3


def test_the_ngram_proposer_drafts_in_the_draft_engine(pair):
    """A model-free proposer has no runner: its per-request generators live on the CPU."""
    target_path, _ = pair

    async def scenario():
        engine = DraftEngine("ngram", None, str(target_path), options())
        try:
            return await engine.propose("n", whole([5, 6, 7, 5, 6]), 2, GREEDY, None)
        finally:
            await engine.release("n")

    proposal, _ = asyncio.run(scenario())
    assert proposal.token_ids == [7, 5]
