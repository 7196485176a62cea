"""The engine's iteration planner: which waiting calls share the next forward."""

from decoding.scheduler import WaitingCall, plan_iteration

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
