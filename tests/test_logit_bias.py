"""logit_bias (OpenAI), allowed_token_ids and bad_words (vLLM): decoding.row_processors'
LogitBias and BadWords.

The semantics: a bias is added to its token's logit and every token outside allowed_token_ids
gets -inf, before the penalties (vLLM's sampler order; a repetition penalty scales a logit, so the
order shows), on draft and target rows alike. Greedy decoding with a bias equals HF `generate`
with its SequenceBiasLogitsProcessor, target-only and speculative, and the bias changes the text.
Sampled speculation stays lossless: the first tokens of seeded requests follow the exact biased
target distribution (enumerated), and the same test rejects a target that ignores the bias while
its draft applies it. A bad word's last token is banned where the output ends with the rest of
it; greedy output with bad words equals HF `generate` with an output-only bad-words processor, and
sampled speculation with a two-token bad word follows the enumerated target, a target whose rows
do not see the block's earlier draft tokens rejected.

The equalities asserted here hold on CPU in float32, where the tests run (docs/gpu.md).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, SequenceBiasLogitsProcessor

from specserve.decoding.row_processors import BadWords, LogitBias, RowBatch, bad_words_token_ids, history_processor
from specserve.decoding.sampling import SamplingParams, penalize
from specserve.decoding.speculation import target_rows
# The pair and its fixtures (target_model, draft_model) are test_penalties' own.
from tests.test_penalties import (BROKEN_SAMPLES, CI_SAMPLES, CI_TV_BOUND, NUM_EMITTED, NUM_SAMPLES, P_VALUE_FLOOR,
                                  PROMPTS, TV_BOUND, VOCAB_SIZE, assert_lossless, broken_target_rows,
                                  chi_square_p_value, draft_model, exact_joint, ours_greedy, speculative_samples,
                                  target_model, total_variation)

BIAS = {7: 2.5, 42: -1.5, 90: 3.5}
# (samples, TV bound): what `make test` runs, and the full run (`make stat-full`).
SAMPLE_SIZES = [(CI_SAMPLES, CI_TV_BOUND), pytest.param(NUM_SAMPLES, TV_BOUND, marks=pytest.mark.stat_full)]
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


@pytest.mark.parametrize("num_samples, tv_bound", SAMPLE_SIZES)
def test_sampled_speculation_with_a_bias_follows_the_biased_target(target_model, draft_model, biased_case,
                                                                    num_samples, tv_bound):
    prompt, expected, unbiased = biased_case
    assert total_variation_between(expected, unbiased) > 0.2   # the bias moves the distribution
    observed, acceptance = speculative_samples(target_model, draft_model, prompt, num_samples, sampling=SAMPLING)
    assert_lossless(observed, acceptance, expected, tv_bound, "biased")


def test_the_lossless_test_rejects_a_target_that_ignores_the_bias(target_model, draft_model, biased_case):
    prompt, expected, _ = biased_case
    observed, _ = speculative_samples(target_model, draft_model, prompt, BROKEN_SAMPLES,
                                      target_rows_ignoring_the_bias, sampling=SAMPLING)
    p_value = chi_square_p_value(observed, expected)
    print(f"bias ignored by the target: p {p_value:.3g}, TV {total_variation(observed, expected):.4f}")
    assert p_value < P_VALUE_FLOOR


def total_variation_between(first: dict, second: dict) -> float:
    return 0.5 * sum(abs(first.get(cell, 0.0) - second.get(cell, 0.0)) for cell in set(first) | set(second))


# --- bad_words ---------------------------------------------------------------------------------------

def test_a_bad_words_last_token_is_banned_where_the_output_ends_with_the_rest():
    params = SamplingParams(bad_words_token_ids=[[9], [4, 5], [1, 2, 3]])
    logits = torch.zeros(4, VOCAB_SIZE)
    processor = history_processor(params, [70, 71, 1, 2, 4], 2, VOCAB_SIZE)   # output [1, 2, 4]
    processed = processor.process(logits, block=[1, 2, 3])
    banned = [set(torch.nonzero(torch.isinf(row)).flatten().tolist()) for row in processed]
    # Row i's output: [1, 2, 4] + block[:i].
    assert banned == [{9, 5}, {9}, {9, 3}, {9}]
    prompt_only = history_processor(params, [1, 2], 2, VOCAB_SIZE).process(logits[:1])   # the prompt does not count
    assert set(torch.nonzero(torch.isinf(prompt_only[0])).flatten().tolist()) == {9}
    processor.advance([4])
    assert torch.isinf(processor.process(logits[:1])[0, 5])
    everything = BadWords(SamplingParams(bad_words_token_ids=[[t] for t in range(VOCAB_SIZE)]), [], 0, VOCAB_SIZE)
    assert torch.equal(everything.process(logits[:1]), logits[:1])   # nothing would be left: the row stays


def test_bad_words_are_tokenized_as_vllm_does():
    vocabulary = {"foo": [5], " foo": [6], "bar baz": [7, 8], " bar baz": [9, 8], "qux": [3, 4], " qux": [3, 4, 1]}
    assert bad_words_token_ids(["foo", " bar baz", "qux"], lambda text: vocabulary[text]) == [[5], [6], [7, 8], [9, 8],
                                                                                             [3, 4]]


class OutputBadWords(LogitsProcessor):
    """vLLM's bad_words for HF `generate`: a word's last token -inf where the output (not the
    prompt) ends with the rest of it."""

    def __init__(self, prompt_len: int, words: list[list[int]]) -> None:
        self.prompt_len, self.words = prompt_len, words

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        output = input_ids[0, self.prompt_len:].tolist()
        for word in self.words:
            if len(word) == 1 or output[len(output) - len(word) + 1:] == word[:-1] and len(output) >= len(word) - 1:
                scores[:, word[-1]] = float("-inf")
        return scores


@pytest.mark.parametrize("speculative", [False, True])
def test_greedy_with_bad_words_equals_hf_generate(target_model, draft_model, speculative):
    changed = False
    for prompt in PROMPTS:
        plain = hf_greedy_biased(target_model, prompt, 30, {}, None)
        words = [[plain[3]], plain[6:9]]            # a token it emits, and three tokens it emits in a row
        with torch.no_grad():
            output = target_model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                                           logits_processor=LogitsProcessorList([OutputBadWords(len(prompt), words)]),
                                           pad_token_id=0)
        expected = output[0, len(prompt):].tolist()
        eos = target_model.config.eos_token_id
        expected = expected[:expected.index(eos)] if eos in expected else expected
        got = ours_greedy(target_model, prompt, 30, {"bad_words_token_ids": words}, draft_model if speculative else None)
        assert got == expected
        assert words[0][0] not in got
        changed |= got != plain
    assert changed   # the bad words changed the text


BAD_WORDS_SAMPLING = {"temperature": 1.0, "top_k": 3, "max_tokens": 8}


@pytest.fixture(scope="module")
def bad_words_case(target_model):
    """A two-token bad word made of the likeliest first token and its likeliest follower, so a
    row blind to the block's earlier tokens (the broken variant) lets the pair through."""
    prompt = PROMPTS[1]
    plain = SamplingParams(**BAD_WORDS_SAMPLING)
    joint = exact_joint(target_model, plain, prompt, 2)
    first, second = max(joint, key=joint.get)
    sampling = {**BAD_WORDS_SAMPLING, "bad_words_token_ids": [[first, second]]}
    expected = exact_joint(target_model, SamplingParams(**sampling), prompt, NUM_EMITTED)
    assert not any(cell[:2] == (first, second) or cell[1:] == (first, second) for cell in expected)
    return prompt, sampling, expected


@pytest.mark.parametrize("num_samples, tv_bound", SAMPLE_SIZES)
def test_sampled_speculation_with_bad_words_follows_the_target(target_model, draft_model, bad_words_case,
                                                                num_samples, tv_bound):
    prompt, sampling, expected = bad_words_case
    observed, acceptance = speculative_samples(target_model, draft_model, prompt, num_samples, sampling=sampling)
    assert_lossless(observed, acceptance, expected, tv_bound, "bad words")


def test_the_bad_words_test_rejects_verify_rows_blind_to_earlier_draft_tokens(target_model, draft_model,
                                                                             bad_words_case):
    """Rows blind to the block's earlier tokens let the banned pair through: samples the target
    gives no mass (so chi-square has no cell for them) are the rejection."""
    prompt, sampling, expected = bad_words_case
    observed, _ = speculative_samples(target_model, draft_model, prompt, BROKEN_SAMPLES, broken_target_rows,
                                      sampling=sampling)
    outside = sum(count for cell, count in observed.items() if cell not in expected)
    print(f"bad words, blind rows: {outside} of {BROKEN_SAMPLES} samples hold the banned pair, "
          f"TV {total_variation(observed, expected):.4f}")
    assert outside > BROKEN_SAMPLES // 20
