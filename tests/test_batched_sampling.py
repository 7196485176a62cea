"""Batched sampling on the engine's device: one engine step processes and draws every request's row
with that request's own parameters (decoding.sampling.process_rows / sample_rows,
decoding.row_processors.RowBatch, decoding.proposers.draft_step, decoding.speculation.
target_rows_batch / verify_answers).

Statistical test (tolerances stated, not tuned to pass): NUM_DRAWS draws per request from one
batched draft step whose rows mix greedy, temperature, top-k, top-p, min-p and penalties; each
request's draws must fit its exact distribution (the row processed alone: decoding.row_processors'
`process` and `logits_to_probs`) with a chi-square p-value above 1e-3 and a total-variation distance
below TV_BOUND = 0.02 (its expectation at 20k draws over these 12 tokens is under 0.01; every row
of the step is a separate request's row, so 20k keeps the test within seconds); the same check must
reject a step that ignores per-row parameters (every row under the first request's parameters), so
the test can see a mixed-up row. Greedy rows equal the argmax of their processed row.

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md).
"""

from __future__ import annotations

import pytest
import torch

from specserve.decoding.compact_verify import DraftSupport, saguaro_support
from specserve.decoding.proposers import Proposal, ProposeCall, SaguaroSampling, draft_step
from specserve.decoding.row_processors import history_processor
from specserve.decoding.sampling import RowParams, SamplingParams, logits_to_probs, make_generator, process_rows
from specserve.decoding.speculation import RowsCall, target_rows, target_rows_batch, verify_answer, verify_answers
from tests.test_rejection import P_VALUE_THRESHOLD, assert_differs, chi_square_pvalue, total_variation

VOCAB_SIZE = 12
NUM_DRAWS = 20_000
TV_BOUND = 0.02
PROMPT = [3, 5, 5, 7]
HISTORY = PROMPT + [5, 9, 9, 2]  # four prompt tokens, then four output tokens
MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=0.9, min_p=0.08),
    SamplingParams(temperature=1.1, top_k=6, repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.4),
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=1.5),
]


def mixed_logits(seed: int) -> torch.Tensor:
    """One row of logits per MIXED request; output tokens sit among the likely ones so penalties matter."""
    logits = torch.randn(len(MIXED), VOCAB_SIZE, generator=torch.Generator().manual_seed(seed)) * 1.5
    logits[:, [5, 9, 2]] += 1.5
    return logits


def processor(params: SamplingParams):
    return history_processor(params, HISTORY, len(PROMPT), VOCAB_SIZE)


def exact_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each request's row processed alone (the per-request reference)."""
    rows = []
    for row, request_params in zip(logits, params):
        history = processor(request_params)
        processed = row[None] if history is None else history.process(row[None])
        rows.append(logits_to_probs(processed, request_params)[0])
    return torch.stack(rows)


def step_draws(logits: torch.Tensor, params: list[SamplingParams], num_draws: int, seed: int) -> torch.Tensor:
    """num_draws draws [num_draws, requests] from one batched draft step over num_draws copies of
    each request's row (each copy with its own processor and the request's generator)."""
    generators = [make_generator(seed + j) for j in range(len(params))]
    calls = [ProposeCall(f"s{j}", HISTORY, 1, request_params, generators[j], len(PROMPT))
             for _ in range(num_draws) for j, request_params in enumerate(params)]
    shared = [processor(request_params) for request_params in params]  # contribute does not change a processor
    processors = shared * num_draws
    step = draft_step(logits.repeat(num_draws, 1), calls, processors, [True] * len(calls))
    return torch.tensor([token for token, *_ in step]).reshape(num_draws, len(params))


def test_mixed_rows_are_processed_as_each_row_alone():
    logits = torch.randn(40, VOCAB_SIZE, generator=torch.Generator().manual_seed(1)) * 3
    params = [MIXED[i % len(MIXED)] for i in range(len(logits))]
    batched = process_rows(logits, RowParams.of(params, VOCAB_SIZE))
    alone = torch.cat([logits_to_probs(row[None], p) for row, p in zip(logits, params)])
    torch.testing.assert_close(batched, alone, rtol=0, atol=1e-7)


def test_row_params_are_built_once_per_settings_and_vocabulary_and_told_apart_by_each():
    """RowParams.of is memoised: the same rows' settings give the same tensors, while a change of
    any setting, of the vocabulary or of the rows' order gives its own."""
    base, greedy = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05), SamplingParams(temperature=0)
    built = RowParams.of([base, greedy], VOCAB_SIZE)
    assert RowParams.of([base.model_copy(update={"seed": 3}), greedy], VOCAB_SIZE) is built   # seed: not a row setting
    for name, value in (("temperature", 0.8), ("top_k", 6), ("top_p", 0.95), ("min_p", 0.1)):
        other = RowParams.of([base.model_copy(update={name: value}), greedy], VOCAB_SIZE)
        row = {"top_k": other.top_k, "top_p": other.top_p, "min_p": other.min_p,
               "temperature": other.temperature}[name]
        assert float(row[0]) == pytest.approx(value), name
    assert int(RowParams.of([greedy, base], VOCAB_SIZE).top_k[1]) == 5   # rows in their own order
    assert int(RowParams.of([greedy], VOCAB_SIZE + 1).top_k[0]) == VOCAB_SIZE + 1   # top-k off: V of its own


def test_batched_step_draws_each_rows_exact_distribution_and_greedy_rows_take_the_argmax():
    logits = mixed_logits(2)
    exact = exact_rows(logits, MIXED)
    draws = step_draws(logits, MIXED, NUM_DRAWS, seed=10)
    for j, request_params in enumerate(MIXED):
        if request_params.is_greedy:
            assert (draws[:, j] == exact[j].argmax()).all()
        else:
            assert chi_square_pvalue(draws[:, j], exact[j]) > P_VALUE_THRESHOLD, f"row {j}"
            assert total_variation(draws[:, j], exact[j]) < TV_BOUND, f"row {j}"
    # The penalized row really differs from its unpenalized self: the test can see penalties.
    unpenalized = logits_to_probs(logits[4:5], MIXED[4].model_copy(update={
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}))[0]
    assert_differs(draws[:, 4], unpenalized)


def test_the_check_rejects_a_step_that_ignores_per_row_parameters():
    logits = mixed_logits(2)
    exact = exact_rows(logits, MIXED)
    broken = step_draws(logits, [MIXED[0]] * len(MIXED), NUM_DRAWS // 4, seed=10)  # every row under row 0's params
    for j in (1, 2, 4):
        assert_differs(broken[:, j], exact[j])


def test_a_seeded_rows_draws_do_not_depend_on_what_shares_its_batch():
    logits = mixed_logits(3)
    calls_alone = [ProposeCall("a", HISTORY, 1, MIXED[1], make_generator(77), len(PROMPT))]
    alone = [draft_step(logits[1:2], calls_alone, [None], [True])[0][0] for _ in range(20)]
    shared = make_generator(77)
    together = []
    for _ in range(20):
        calls = [ProposeCall(f"s{j}", HISTORY, 1, p, shared if j == 1 else make_generator(j), len(PROMPT))
                 for j, p in enumerate(MIXED)]
        together.append(draft_step(logits, calls, [processor(p) for p in MIXED], [True] * len(MIXED))[1][0])
    assert alone == together and len(set(alone)) > 1


def assert_same_rows(q: DraftSupport, expected: DraftSupport) -> None:
    """The same distribution: a support is a set of (id, probability), in no particular order."""
    vocab_size = int(max(q.ids.max(), expected.ids.max())) + 1
    torch.testing.assert_close(q.dense(vocab_size), expected.dense(vocab_size))


def test_draft_step_returns_the_q_each_token_was_drawn_from():
    logits = mixed_logits(4)
    calls = [ProposeCall(f"s{j}", HISTORY, 1, p, make_generator(j), len(PROMPT)) for j, p in enumerate(MIXED)]
    step = draft_step(logits, calls, [processor(p) for p in MIXED], [True] * len(MIXED), max_candidates=5)
    exact = exact_rows(logits, MIXED)
    for (token, _, q, _), request_params, row in zip(step, MIXED, exact):
        if request_params.is_greedy:
            assert q is None
            continue
        top = torch.topk(row, 5)
        assert_same_rows(q, DraftSupport(top.indices, top.values / top.values.sum()))
        assert token in q.ids.tolist()


def test_saguaro_rows_are_the_q_drawn_and_shipped_and_the_odds_read_the_drafts_own_row():
    """With Saguaro sampling the q a sampled token is drawn from, and shipped for verification, is
    the lowered row; the odds give the draft's own probabilities (its processed row) beside it; a
    pre-draft's guess of rank r is the row's r-th likeliest token, drawn with no randomness."""
    logits = mixed_logits(6)
    saguaro = SaguaroSampling(2, 0.25)
    calls = [ProposeCall(f"s{j}", HISTORY, 1, p, make_generator(j), len(PROMPT), num_candidates=3, lowered=True)
             for j, p in enumerate(MIXED)]
    step = draft_step(logits, calls, [processor(p) for p in MIXED], [True] * len(MIXED), 5, saguaro)
    exact = exact_rows(logits, MIXED)
    for (token, ranked, q, odds), request_params, row in zip(step, MIXED, exact):
        top = torch.topk(row, 5)
        if request_params.is_greedy:   # its own row: the softmax of its logits, the argmax drawn
            assert ranked[0] == token and q is None and odds.candidate_drawn is None
            continue
        likely = torch.topk(row, 3)
        assert ranked[:int((likely.values > 0).sum())] == likely.indices[likely.values > 0].tolist()
        assert odds.drafted_q == pytest.approx(float(row[token]), abs=1e-6)
        base = DraftSupport(top.indices, top.values / top.values.sum())
        assert_same_rows(q, saguaro_support(base, 2, 0.25))
        assert odds.drafted_drawn == pytest.approx(float(q.probs_of(torch.tensor(token))), abs=1e-6)
    guessing = [ProposeCall(f"g{j}", HISTORY, 1, p, make_generator(j), len(PROMPT), guess_rank=1, lowered=True)
                for j, p in enumerate(MIXED)]
    guessed = draft_step(logits, guessing, [processor(p) for p in MIXED], [True] * len(MIXED), 5, saguaro)
    plain = [ProposeCall(f"p{j}", HISTORY, 1, p, make_generator(j), len(PROMPT), num_candidates=3)
             for j, p in enumerate(MIXED)]
    for (_, _, q, _), request_params, row in zip(draft_step(logits, plain, [processor(p) for p in MIXED],
                                                            [True] * len(MIXED), 5, saguaro), MIXED, exact):
        if not request_params.is_greedy:   # a row not asked to be lowered keeps its own q
            top = torch.topk(row, 5)
            assert_same_rows(q, DraftSupport(top.indices, top.values / top.values.sum()))
    second = [torch.topk(row, 2) for row in exact]
    assert all(token == top.indices[1].item() for (token, *_), top, request_params in zip(guessed, second, MIXED)
               if not request_params.is_greedy and top.values[1] > 0)


def test_target_rows_batch_equals_each_call_alone():
    calls, rows = [], []
    generator = torch.Generator().manual_seed(5)
    for j, params in enumerate(MIXED):
        block = [9, 4, 9]
        params = params.model_copy(update={"min_tokens": 6 if j % 2 else 0})
        calls.append(RowsCall(len(block) + 1, params, 4, HISTORY + block, eos_token_id=2))
        rows.append(torch.randn(len(block) + 1, VOCAB_SIZE, generator=generator))
    batched = target_rows_batch(torch.cat(rows), calls)
    for call, logits, answer in zip(calls, rows, batched):
        alone = target_rows(logits, call.params, 2, call.first_output_index, call.token_ids)
        if call.params.is_greedy:
            assert torch.equal(answer, alone)
        else:
            torch.testing.assert_close(answer, alone, rtol=0, atol=1e-7)


def test_verify_answers_in_one_batch_equal_each_answer_alone_under_the_same_seeds():
    rows = [logits_to_probs(torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(s)),
                            SamplingParams(temperature=1.0)) for s in range(3)]
    q = torch.softmax(torch.randn(3, VOCAB_SIZE, generator=torch.Generator().manual_seed(9)), -1)
    proposal = Proposal(token_ids=[1, 2, 3], support=DraftSupport(torch.arange(VOCAB_SIZE).expand(3, -1), q))
    greedy = torch.tensor([4, 4, 1, 0])
    together = verify_answers([rows[0], greedy, rows[1]], [proposal] * 3,
                              [make_generator(1), None, make_generator(2)], ["block", "block", "token"])
    assert together[1] == [4, 4, 1, 0]
    for answer, probs, seed, verification in ((together[0], rows[0], 1, "block"), (together[2], rows[1], 2, "token")):
        alone = verify_answer(probs, proposal, make_generator(seed), verification)
        assert answer == alone


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU on this machine"))])
def test_rows_and_generators_stay_on_the_rows_device(device):
    logits = mixed_logits(6).to(device)
    calls = [ProposeCall(f"s{j}", HISTORY, 1, p, make_generator(j, device), len(PROMPT)) for j, p in enumerate(MIXED)]
    step = draft_step(logits, calls, [None] * len(MIXED), [True] * len(MIXED))
    assert all(q is None or q.probs.device.type == device for _, _, q, _ in step)
