"""The engine's iteration planner: which waiting calls share the next forward."""

import torch

from specserve.decoding.batched_runner import BatchedModelRunner
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.errors import SequenceStateError
from specserve.decoding.scheduler import CallShape, Scheduler, WaitingCall, plan_iteration
from tests.tiny_pair import tiny_model

PLAN = dict(max_step_tokens=10, prefill_token_budget=256, max_batch_rows=8)


def held(seq_id: str, new_tokens: int = 5) -> WaitingCall:
    return WaitingCall(seq_id, new_tokens, holds_slot=True)


def new(seq_id: str, new_tokens: int) -> WaitingCall:
    return WaitingCall(seq_id, new_tokens, holds_slot=False)


def test_every_waiting_step_joins_one_batch():
    plan = plan_iteration([held("a"), held("b", 1), held("c", 9)], free_slots=0, **PLAN)
    assert plan.steps == [0, 1, 2] and plan.prefills == [] and plan.waiting == []


def test_prefills_run_apart_from_steps_and_are_chunked_under_the_budget():
    calls = [new("p1", 200), held("a"), new("p2", 100), new("p3", 40)]
    plan = plan_iteration(calls, free_slots=10, **PLAN)
    assert plan.steps == [1]
    assert plan.prefills == [(0, 200), (2, 56)]  # the budget of 256 cuts p2's chunk; p3 waits
    assert plan.waiting == [3]


def test_a_new_sequence_waits_for_a_free_slot_in_arrival_order():
    calls = [new("x", 3), new("y", 3), held("a"), new("z", 3)]
    plan = plan_iteration(calls, free_slots=1, **PLAN)
    assert plan.steps == [0, 2]
    assert plan.waiting == [1, 3]


def test_a_sequence_runs_at_most_once_per_iteration():
    plan = plan_iteration([held("a"), held("a", 2)], free_slots=0, **PLAN)
    assert plan.steps == [0] and plan.waiting == [1]


def test_batch_rows_are_capped():
    plan = plan_iteration([held(str(i)) for i in range(10)], free_slots=0, **PLAN)
    assert plan.steps == list(range(8)) and plan.waiting == [8, 9]


def test_calls_wait_for_the_kv_blocks_their_new_tokens_fill():
    # Blocks of 4 tokens, 3 free. a holds 8 tokens in 2 blocks and verifies 5 more (13: 2 new blocks);
    # b holds 3 in 1 block and takes 1 (4: none new); p's 20-token prompt needs 5 and waits;
    # q's 4-token prompt would need 1, but a took 2 of the 3 and b none, so q fits.
    calls = [WaitingCall("a", 5, True, num_cached=8, blocks_held=2), WaitingCall("b", 1, True, num_cached=3, blocks_held=1),
             new("p", 20), new("q", 4)]
    plan = plan_iteration(calls, free_slots=10, **PLAN, free_blocks=3, block_size=4)
    assert plan.steps == [0, 1, 3] and plan.waiting == [2]
    # No block pool (a per-sequence runner): only slots and budgets count.
    assert plan_iteration(calls, free_slots=10, **PLAN).waiting == []
    # With KV cache groups (sliding-window layers: Gemma 3's 3 groups), a block of tokens takes a
    # block in each: a's 2 new blocks are 6, more than the 5 free; b's none still none.
    grouped = [WaitingCall("a", 5, True, num_cached=8, blocks_held=2, kv_groups=3),
               WaitingCall("b", 1, True, num_cached=3, blocks_held=1, kv_groups=3)]
    assert plan_iteration(grouped, free_slots=10, **PLAN, free_blocks=5, block_size=4).waiting == [0]
    assert plan_iteration(grouped, free_slots=10, **PLAN, free_blocks=6, block_size=4).steps == [0, 1]


def test_a_draft_call_reserves_blocks_for_its_later_decode_steps_and_a_chunk_only_for_itself():
    drafting = WaitingCall("d", 1, True, num_cached=4, blocks_held=1, extra_tokens=7)   # 12 tokens: 2 more
    assert plan_iteration([drafting], free_slots=0, **PLAN, free_blocks=1, block_size=4).waiting == [0]
    assert plan_iteration([drafting], free_slots=0, **PLAN, free_blocks=2, block_size=4).steps == [0]
    # A 300-token prompt chunked to the 256 budget needs 64 blocks now, its decode steps later.
    prompt = WaitingCall("p", 300, False, extra_tokens=7)
    assert plan_iteration([prompt], free_slots=1, **PLAN, free_blocks=64, block_size=4).prefills == [(0, 256)]


# The Scheduler: plan_iteration over the blocks it owns, with calls that cannot run answered by
# their error (indices always into the engine's own call list).

def scheduler_over_tiny_runner(max_step_tokens: int = 10) -> Scheduler:
    runner = BatchedModelRunner.from_model(tiny_model("llama"), max_sequences=3)
    return Scheduler(runner, max_step_tokens, prefill_token_budget=64, max_batch_rows=8)


def test_calls_that_cannot_run_get_their_error_and_the_rest_keep_their_indices():
    scheduler = scheduler_over_tiny_runner()
    scheduler.forward_batch([ForwardCall("held", [3, 4, 5, 6])])
    too_long = [7] * (scheduler.max_context + 1)
    schedule = scheduler.schedule([CallShape("new", list(range(2, 22))), CallShape("long", too_long),
                                   CallShape("held", [3, 4, 5, 6, 8, 9], num_rows=3),
                                   CallShape("rows", [3, 4], num_rows=3)])
    assert sorted(schedule.errors) == [1, 3]
    assert all(isinstance(error, SequenceStateError) for error in schedule.errors.values())
    assert "exceed the model's context" in str(schedule.errors[1]) and "num_rows=3" in str(schedule.errors[3])
    assert schedule.plan.steps == [2] and schedule.plan.prefills == [(0, 20)] and schedule.plan.waiting == []
    held = schedule.calls[2]
    assert (held.holds_slot, held.num_cached, held.num_new_tokens) == (True, 4, 3)  # 2 new tokens, 3 rows


def test_a_call_that_needs_a_slot_waits_while_none_is_free():
    scheduler = scheduler_over_tiny_runner()
    scheduler.forward_batch([ForwardCall(name, [3, 4]) for name in ("a", "b", "c")])
    schedule = scheduler.schedule([CallShape("d", [5, 6]), CallShape("a", [3, 4, 9])])
    assert schedule.plan.steps == [1] and schedule.plan.prefills == [] and schedule.plan.waiting == [0]


def test_a_model_free_proposer_runs_every_call_at_once():
    schedule = Scheduler(None, 10, 64, 8).schedule([CallShape("a", [1, 2, 3]), CallShape("b", [4])])
    assert schedule.plan.steps == [0, 1] and schedule.errors == {}


def test_a_new_sequence_whose_prefix_is_cached_plans_its_prefill_from_there():
    """A second request with the same 40-token prompt: the prefix cache holds its first 32
    tokens (2 full blocks of 16; the last block is recomputed for its row), so one chunk of the
    8 others completes it, where the first request needed chunks of the whole prompt."""
    scheduler = scheduler_over_tiny_runner(max_step_tokens=4)
    scheduler.prefill_token_budget = 16
    prompt = list(range(2, 42))
    assert scheduler.schedule([CallShape("first", prompt)]).plan.prefills == [(0, 16)]
    scheduler.forward_batch([ForwardCall("first", prompt)])
    scheduler.release("first")
    schedule = scheduler.schedule([CallShape("second", prompt)])
    assert schedule.plan.prefills == [(0, 8)] and schedule.calls[0].chunk_end(8) is None
    assert (schedule.calls[0].holds_slot, schedule.calls[0].num_cached) == (False, 32)


def test_decodes_keep_flowing_beside_a_long_prompts_chunked_prefill():
    """The default budget (vLLM's 2,048 tokens a step) chunks a 5,000-token prompt over three
    iterations; the sequences decoding meanwhile take a step in every one of them, in their own
    forward, and the prompt's rows equal one whole forward's."""
    from specserve.common.config import BatchingSpec
    from tests.reference_runner import full_logits

    assert BatchingSpec().prefill_token_budget == 2048
    model = tiny_model("llama", max_position_embeddings=8192)
    scheduler = Scheduler(BatchedModelRunner.from_model(model, max_sequences=4), max_step_tokens=10,
                          prefill_token_budget=BatchingSpec().prefill_token_budget, max_batch_rows=8)
    decoding = {"a": [3, 4, 5], "b": [6, 7]}
    scheduler.forward_batch([ForwardCall(seq_id, history) for seq_id, history in decoding.items()])
    prompt = [2 + i % 90 for i in range(5000)]
    chunks, last_rows = [], None
    while last_rows is None:
        shapes = [CallShape(seq_id, history + [8]) for seq_id, history in decoding.items()] + [CallShape("p", prompt)]
        schedule = scheduler.schedule(shapes)
        assert schedule.plan.steps == [0, 1]   # both decodes run in every iteration of the prefill
        (index, chunk), = schedule.plan.prefills
        chunks.append(chunk)
        scheduler.forward_batch([ForwardCall(shape.seq_id, shape.token_ids) for shape in shapes[:2]])
        for history in decoding.values():
            history.append(8)
        end = schedule.calls[index].chunk_end(chunk)
        rows = scheduler.forward_batch([ForwardCall("p", prompt if end is None else prompt[:end])])[0]
        last_rows = rows if end is None else None
    assert chunks == [2048, 2048, 904]
    torch.testing.assert_close(last_rows, full_logits(model, prompt)[-1:], atol=1e-4, rtol=0)
