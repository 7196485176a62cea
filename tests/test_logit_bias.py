"""logit_bias (OpenAI) and allowed_token_ids (vLLM): decoding.row_processors.LogitBias.

The semantics: a bias is added to its token's logit and every token outside allowed_token_ids
gets -inf, before the penalties (vLLM's sampler order; a repetition penalty scales a logit, so the
order shows), on draft and target rows alike. Greedy decoding with a bias equals HF `generate`
with its SequenceBiasLogitsProcessor, target-only and speculative, and the bias changes the text.
Sampled speculation stays lossless: the first tokens of seeded requests follow the exact biased
target distribution (enumerated), and the same test rejects a target that ignores the bias while
its draft applies it.

The equalities asserted here hold on CPU in float32, where the tests run (docs/gpu.md).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, SequenceBiasLogitsProcessor

from specserve.decoding.row_processors import LogitBias, RowBatch, history_processor
from specserve.decoding.sampling import SamplingParams, penalize
from specserve.decoding.speculation import target_rows
# The pair and its fixtures (target_model, draft_model) are test_penalties' own.
from tests.test_penalties import (BROKEN_SAMPLES, CI_SAMPLES, CI_TV_BOUND, NUM_EMITTED, NUM_SAMPLES, P_VALUE_FLOOR,
                                  PROMPTS, TV_BOUND, VOCAB_SIZE, chi_square_p_value, draft_model, exact_joint,
                                  ours_greedy, speculative_samples, target_model, total_variation)

BIAS = {7: 2.5, 42: -1.5, 90: 3.5}
ALLOWED = [3, 5, 7, 8, 11, 17, 33, 42, 50, 60, 61, 62, 63, 90]


def test_bias_and_allowed_ids_on_random_logits_in_vllms_order():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB_SIZE) * 3
    params = SamplingParams(temperature=1.0, logit_bias=BIAS, allowed_token_ids=ALLOWED, repetition_penalty=1.7)
    history = [5, 17, 42, 8, 3, 33, 7]
    processed = history_processor(params, history, 6, VOCAB_SIZE).process(logits[:1])[0]
    expected = logits[0].clone()
    for token, bias in BIAS.items():
        expected[token] += bias
    seen = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    seen[history] = True
    expected = penalize(expected[None], torch.zeros(1, VOCAB_SIZE), seen[None], 1.7, 0.0, 0.0)[0]
    outside = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    outside[ALLOWED] = False
    expected[outside] = float("-inf")
    assert torch.equal(processed, expected)
    # The order matters: a bias applied after the penalty gives other logits for the biased seen tokens.
    penalized_first = penalize(logits[:1], torch.zeros(1, VOCAB_SIZE), seen[None], 1.7, 0.0, 0.0)[0]
    assert not torch.allclose(penalized_first[42] - 1.5, processed[42])


def test_rows_of_a_batch_each_get_their_own_bias():
    logits = torch.randn(5, VOCAB_SIZE)
    first = LogitBias(SamplingParams(logit_bias={1: 4.0}), VOCAB_SIZE)
    second = LogitBias(SamplingParams(allowed_token_ids=[2, 9]), VOCAB_SIZE)
    batch = RowBatch()
    first.contribute(batch, 0, 2)
    second.contribute(batch, 3, 2)
    processed = batch.apply(logits)
    assert torch.equal(processed[2], logits[2])                          # a row nobody added
    assert torch.equal(processed[:2, 1], logits[:2, 1] + 4.0)
    assert torch.equal(processed[:2, 2:], logits[:2, 2:])
    assert torch.isinf(processed[3:]).sum() == 2 * (VOCAB_SIZE - 2)
    assert torch.equal(processed[3:, [2, 9]], logits[3:, [2, 9]])


def test_a_draft_row_that_can_propose_no_allowed_id_is_left_unmasked():
    """An EAGLE-3 head's row is -inf outside its reduced vocabulary: where that holds none of the
    allowed ids, masking would leave nothing to draw from, so the row stays as it was."""
    head_row = torch.full((2, VOCAB_SIZE), float("-inf"))
    head_row[:, :10] = torch.randn(2, 10)
    processed = LogitBias(SamplingParams(allowed_token_ids=[50, 60]), VOCAB_SIZE).process(head_row)
    assert torch.equal(processed, head_row)
    processed = LogitBias(SamplingParams(allowed_token_ids=[5, 60]), VOCAB_SIZE).process(head_row)
    assert torch.isfinite(processed).sum() == 2 and torch.equal(processed[:, 5], head_row[:, 5])


def test_ids_past_a_narrower_drafts_width_are_left_out():
    """A draft whose vocabulary is smaller than the target's: the ids it lacks do not index its
    rows, and where it has none of the allowed ids its rows stay unmasked (it only proposes)."""
    logits = torch.randn(1, 10)
    narrow = LogitBias(SamplingParams(logit_bias={3: 1.0, 50: 2.0}, allowed_token_ids=[50, 60]), 10)
    processed = narrow.process(logits)
    assert torch.equal(processed[0, 3], logits[0, 3] + 1.0) and torch.isfinite(processed).all()


def test_a_greedy_target_row_takes_the_biased_argmax():
    logits = torch.randn(3, VOCAB_SIZE)
    lowest = int(logits[0].argmin())
    forced = target_rows(logits, SamplingParams(temperature=0, logit_bias={lowest: 100.0}), token_ids=[1, 2, 3, 4],
                         first_output_index=0)
    assert forced.tolist() == [lowest] * 3
    allowed = target_rows(logits, SamplingParams(temperature=0, allowed_token_ids=[4, 6]), token_ids=[1, 2, 3, 4],
                          first_output_index=0)
    assert set(allowed.tolist()) <= {4, 6}


class AllowedTokens(LogitsProcessor):
    """vLLM's allowed_token_ids for HF `generate`: every other token -inf."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        kept = torch.full_like(scores, float("-inf"))
        kept[:, self.allowed] = scores[:, self.allowed]
        return kept


def hf_greedy_biased(model, prompt: list[int], max_tokens: int, bias: dict, allowed: list[int] | None) -> list[int]:
    processors = LogitsProcessorList([AllowedTokens(allowed)] if allowed else [])
    if bias:
        processors.append(SequenceBiasLogitsProcessor({(token,): value for token, value in bias.items()}))
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                logits_processor=processors, pad_token_id=0)
    ids = output[0, len(prompt):].tolist()
    eos = model.config.eos_token_id
    return ids[:ids.index(eos)] if eos in ids else ids


@pytest.mark.parametrize("allowed", [None, ALLOWED])
@pytest.mark.parametrize("speculative", [False, True])
def test_greedy_with_a_bias_equals_hf_generate(target_model, draft_model, speculative, allowed):
    fields = {"logit_bias": BIAS, "allowed_token_ids": allowed}
    for prompt in PROMPTS:
        expected = hf_greedy_biased(target_model, prompt, 30, BIAS, allowed)
        assert ours_greedy(target_model, prompt, 30, fields, draft_model if speculative else None) == expected
        if allowed:
            assert set(expected) <= set(ALLOWED)
    unbiased = hf_greedy_biased(target_model, PROMPTS[0], 30, {}, None)
    assert unbiased != hf_greedy_biased(target_model, PROMPTS[0], 30, BIAS, allowed)   # the bias shows


# Sampled: the bias lifts tokens the target finds unlikely and lowers one it likes, so a target
# ignoring it samples visibly differently (the broken variant below).
SAMPLING = {"temperature": 1.0, "top_k": 3, "max_tokens": 8, "logit_bias": {7: 3.0, 42: 2.0, 60: -2.0}}


def target_rows_ignoring_the_bias(logits, params, eos_token_id=None, first_output_index=None, token_ids=None):
    """A target that drops the request's bias (its draft still applies it)."""
    return target_rows(logits, params.model_copy(update={"logit_bias": {}}), eos_token_id, first_output_index,
                       token_ids)


@pytest.fixture(scope="module")
def biased_case(target_model):
    prompt = PROMPTS[2]
    params = SamplingParams(**SAMPLING)
    expected = exact_joint(target_model, params, prompt, NUM_EMITTED)
    unbiased = exact_joint(target_model, params.model_copy(update={"logit_bias": {}}), prompt, NUM_EMITTED)
    return prompt, expected, unbiased


@pytest.mark.parametrize("num_samples, tv_bound", [
    (CI_SAMPLES, CI_TV_BOUND), pytest.param(NUM_SAMPLES, TV_BOUND, marks=pytest.mark.stat_full)])
def test_sampled_speculation_with_a_bias_follows_the_biased_target(target_model, draft_model, biased_case,
                                                                    num_samples, tv_bound):
    prompt, expected, unbiased = biased_case
    assert total_variation_between(expected, unbiased) > 0.2   # the bias moves the distribution
    observed, acceptance = speculative_samples(target_model, draft_model, prompt, num_samples, sampling=SAMPLING)
    assert 0.2 < acceptance < 0.98
    assert set(observed) <= set(expected)
    p_value, distance = chi_square_p_value(observed, expected), total_variation(observed, expected)
    print(f"biased: acceptance {acceptance:.3f}, p {p_value:.3g}, TV {distance:.4f}")
    assert p_value > P_VALUE_FLOOR
    assert distance < tv_bound


def test_the_lossless_test_rejects_a_target_that_ignores_the_bias(target_model, draft_model, biased_case):
    prompt, expected, _ = biased_case
    observed, _ = speculative_samples(target_model, draft_model, prompt, BROKEN_SAMPLES,
                                      target_rows_ignoring_the_bias, sampling=SAMPLING)
    p_value = chi_square_p_value(observed, expected)
    print(f"bias ignored by the target: p {p_value:.3g}, TV {total_variation(observed, expected):.4f}")
    assert p_value < P_VALUE_FLOOR


def total_variation_between(first: dict, second: dict) -> float:
    return 0.5 * sum(abs(first.get(cell, 0.0) - second.get(cell, 0.0)) for cell in set(first) | set(second))
