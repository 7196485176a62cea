"""Repetition / presence / frequency penalties and min_p (decoding.sampling, decoding.row_processors).

The semantics are checked against Hugging Face's processors (repetition, min_p) and a small HF
LogitsProcessor with OpenAI's presence/frequency definition; greedy decoding with penalties equals HF
`generate` with those processors, target-only and speculative. Speculation stays lossless with
penalties: the first three emitted tokens of seeded sampled requests follow the exact penalized target
distribution (enumerated), and the same test rejects a target whose verify rows do not see the
block's earlier draft tokens. A draft identical to the target is always accepted, which fails when
draft steps do not see their own earlier tokens: draft and target rows are processed alike.

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from transformers import LogitsProcessor, LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from specserve.decoding.generate import generate
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.scheduler import engine_for_model
from specserve.decoding.proposers import DraftModelProposer, ProposeCall, empty_proposal
from specserve.decoding.row_processors import Penalties, history_processor
from specserve.decoding.sampling import SamplingParams, apply_penalties, logits_to_probs
from specserve.decoding.sequence import RequestState
from specserve.decoding.speculation import accept_round, target_rows, verify_answer
from tests.test_generate import perturbed_copy
from tests.tiny_pair import tiny_llama

VOCAB_SIZE = 96
PROMPTS = [[5, 17, 42, 8, 3, 33], [60, 2, 2, 9, 14, 27, 50, 11, 7], [12, 40, 21]]
PENALTIES = {"repetition_penalty": 1.6, "presence_penalty": 1.0, "frequency_penalty": 1.5}


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence/frequency penalties for HF `generate`: over the output tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        output = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_processors(prompt_len: int, penalties: dict) -> LogitsProcessorList:
    return LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalties["repetition_penalty"]),
                                OpenAIPenalties(prompt_len, penalties["presence_penalty"],
                                                penalties["frequency_penalty"])])


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(VOCAB_SIZE, seed=0)


@pytest.fixture(scope="module")
def draft_model(target_model):
    return perturbed_copy(target_model, noise_std=0.02, seed=1)


# --- semantics -------------------------------------------------------------------------------------

def test_penalties_match_hf_processors_on_random_logits():
    torch.manual_seed(0)
    logits = 3 * torch.randn(4, VOCAB_SIZE)
    history = torch.randint(0, VOCAB_SIZE, (4, 12))
    prompt_len = 7
    params = SamplingParams(**PENALTIES)
    counts = torch.zeros(4, VOCAB_SIZE).scatter_add_(1, history[:, prompt_len:], torch.ones(4, 5))
    seen = torch.zeros(4, VOCAB_SIZE, dtype=torch.bool).scatter_(1, history, True)
    expected = hf_processors(prompt_len, PENALTIES)(history, logits.clone())
    torch.testing.assert_close(apply_penalties(logits, counts, seen, params), expected)
    processed = torch.stack([Penalties(params, row.tolist(), prompt_len, VOCAB_SIZE).process(logits[i:i + 1])[0]
                             for i, row in enumerate(history)])
    torch.testing.assert_close(processed, expected)


def test_min_p_matches_hf_after_temperature():
    torch.manual_seed(1)
    logits = 3 * torch.randn(5, VOCAB_SIZE)
    for min_p in (0.05, 0.3, 1.0):
        params = SamplingParams(temperature=0.7, min_p=min_p)
        hf = MinPLogitsWarper(min_p)(None, logits / 0.7)
        torch.testing.assert_close(logits_to_probs(logits, params), torch.softmax(hf, dim=-1))
        assert (logits_to_probs(logits, params) > 0).sum() < VOCAB_SIZE * 5 or min_p == 0.05


def test_a_block_row_sees_the_history_plus_the_earlier_block_tokens():
    """Row i of one verify call == draft step i after advancing by d1..d_i: the seam's contract."""
    torch.manual_seed(2)
    params = SamplingParams(**PENALTIES)
    history, prompt_len, block = [4, 9, 9, 30, 4, 7], 3, [9, 50, 50, 4]
    logits = 3 * torch.randn(len(block) + 1, VOCAB_SIZE)
    rows = Penalties(params, history, prompt_len, VOCAB_SIZE).process(logits, block)
    stepping = Penalties(params, history, prompt_len, VOCAB_SIZE)
    for i in range(len(block) + 1):
        assert torch.equal(rows[i], stepping.process(logits[i:i + 1])[0])
        fresh = Penalties(params, history + block[:i], prompt_len, VOCAB_SIZE).process(logits[i:i + 1])[0]
        assert torch.equal(rows[i], fresh)
        if i < len(block):
            stepping.advance([block[i]])


def test_requests_without_penalties_get_no_processor():
    assert history_processor(SamplingParams(temperature=0.5, top_k=4, min_p=0.2), [1, 2, 3], None, VOCAB_SIZE) is None
    logits = torch.randn(3, VOCAB_SIZE)
    greedy = SamplingParams(temperature=0)
    assert torch.equal(target_rows(logits, greedy), logits.argmax(dim=-1))  # no token ids needed


# --- greedy: equal to HF generate ------------------------------------------------------------------

def ours_greedy(target_model, prompt: list[int], max_tokens: int, penalties: dict, draft_model=None) -> list[int]:
    state = RequestState("g", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **penalties),
                         eos_token_id=target_model.config.eos_token_id, max_context=128)
    proposer = None if draft_model is None else DraftModelProposer(engine_for_model(draft_model))
    for _ in generate(engine_for_model(target_model), state, proposer, num_draft_tokens=4):
        pass
    return state.output_ids


def hf_greedy(model, prompt: list[int], max_tokens: int, penalties: dict) -> list[int]:
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                logits_processor=hf_processors(len(prompt), penalties), pad_token_id=0)
    ids = output[0, len(prompt):].tolist()
    eos = model.config.eos_token_id
    return ids[:ids.index(eos)] if eos in ids else ids


@pytest.mark.parametrize("speculative", [False, True])
def test_greedy_with_penalties_equals_hf_generate(target_model, draft_model, speculative):
    for prompt in PROMPTS:
        expected = hf_greedy(target_model, prompt, 40, PENALTIES)
        assert ours_greedy(target_model, prompt, 40, PENALTIES, draft_model if speculative else None) == expected
    # The penalties change the text, so equality above is not the unpenalized greedy chain's.
    neutral = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert hf_greedy(target_model, PROMPTS[0], 40, neutral) != hf_greedy(target_model, PROMPTS[0], 40, PENALTIES)


# --- sampled: speculation stays lossless -----------------------------------------------------------

# Negative presence/frequency penalties make repeats likely, so a row that misses an earlier draft
# token of its block gets a visibly different distribution (the broken variant's TV is about 0.2).
SAMPLING = {"temperature": 1.0, "top_k": 3, "max_tokens": 8,
            "repetition_penalty": 0.9, "presence_penalty": -1.0, "frequency_penalty": -1.0}
SAMPLED = SamplingParams(**SAMPLING)
NUM_EMITTED = 3        # tokens per sample compared with the exact joint distribution
NUM_DRAFT_TOKENS = 3
NUM_SAMPLES = 1500      # the full run (marker stat_full, `make stat-full`)
CI_SAMPLES = 750        # what `make test` runs
BATCH = 500
P_VALUE_FLOOR = 1e-3
TV_BOUND = 0.07        # expected empirical TV over <= 27 cells at 1500 samples is about 0.04
CI_TV_BOUND = 0.1      # about 0.057 at 750 samples: the same margin over the expectation
BROKEN_SAMPLES = 500   # the broken variant is rejected at this size (both runs)


def exact_joint(model, params: SamplingParams, prompt: list[int], num_tokens: int) -> dict[tuple, float]:
    """P(t1..tn) of the processed (penalized, biased) target, enumerated over the top-k support (float64)."""
    joint = {(): 1.0}
    for _ in range(num_tokens):
        prefixes = list(joint)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1].float()
        grown = {}
        for prefix, row in zip(prefixes, logits):
            processor = history_processor(params, prompt + list(prefix), len(prompt), row.shape[-1])
            row = row if processor is None else processor.process(row[None])[0]
            probs = logits_to_probs(row, params).double()
            for token in torch.nonzero(probs).flatten().tolist():
                grown[prefix + (token,)] = joint[prefix] * float(probs[token])
        joint = grown
    return joint


def broken_target_rows(logits, params, eos_token_id=None, first_output_index=None, token_ids=None):
    """A target whose verify rows are all penalized for the committed history only."""
    committed = list(token_ids[:len(token_ids) - logits.shape[0] + 1])
    return torch.cat([target_rows(logits[i:i + 1], params, eos_token_id, first_output_index, committed)
                      for i in range(logits.shape[0])])


def speculative_samples(target_model, draft_model, prompt: list[int], num_samples: int,
                        rows=target_rows, sampling: dict = SAMPLING) -> tuple[Counter, float]:
    """The first NUM_EMITTED tokens of num_samples seeded speculative requests under `sampling`,
    run BATCH at a time through the production pieces (batched runners, DraftModelProposer, rows,
    accept_round), and the acceptance rate."""
    target = engine_for_model(target_model, max_sequences=BATCH)
    proposer = DraftModelProposer(engine_for_model(draft_model, max_sequences=BATCH))
    observed, drafted, accepted = Counter(), 0, 0
    for start in range(0, num_samples, BATCH):
        states = [RequestState(f"s{seed}", prompt, SamplingParams(**sampling, seed=seed), None, 128)
                  for seed in range(start, min(start + BATCH, num_samples))]
        blocks = [empty_proposal() for _ in states]  # the first pass is the prefill
        live = states
        while live:
            logits = target.forward_batch([ForwardCall(s.request_id, s.history + b.token_ids, len(b.token_ids) + 1)
                                           for s, b in zip(live, blocks)])
            for state, block, row in zip(live, blocks, logits):
                processed = rows(row, state.params, None, state.next_output_index, state.history + block.token_ids)
                accept_round(state, block, verify_answer(processed, block, state.verify_generator))
            live = [s for s in live if len(s.output_ids) < NUM_EMITTED]
            blocks = proposer.propose_batch([ProposeCall(s.request_id, s.history, s.draft_budget(NUM_DRAFT_TOKENS),
                                                         s.params, s.draft_generator, len(prompt)) for s in live])
        for state in states:
            observed[tuple(state.output_ids[:NUM_EMITTED])] += 1
            drafted += state.stats.num_drafted
            accepted += state.stats.num_accepted
            target.release(state.request_id)
            proposer.release(state.request_id)
    return observed, accepted / drafted


def chi_square_p_value(observed: Counter, expected: dict[tuple, float]) -> float:
    """Goodness of fit over the cells expecting >= 5 samples, the rest pooled into one cell."""
    total = sum(observed.values())
    frequent = [cell for cell, p in expected.items() if p * total >= 5]
    observed_cells = [observed[cell] for cell in frequent]
    expected_cells = [expected[cell] * total for cell in frequent]
    observed_cells.append(total - sum(observed_cells))
    expected_cells.append(total - sum(expected_cells))
    return float(chisquare(observed_cells, expected_cells).pvalue)


def total_variation(observed: Counter, expected: dict[tuple, float]) -> float:
    total = sum(observed.values())
    return 0.5 * sum(abs(observed[c] / total - expected.get(c, 0.0)) for c in set(observed) | set(expected))


@pytest.fixture(scope="module")
def lossless_case(target_model, draft_model):
    prompt = PROMPTS[0]
    expected = exact_joint(target_model, SAMPLED, prompt, NUM_EMITTED)
    return prompt, expected


@pytest.mark.parametrize("num_samples, tv_bound", [
    (CI_SAMPLES, CI_TV_BOUND), pytest.param(NUM_SAMPLES, TV_BOUND, marks=pytest.mark.stat_full)])
def test_sampled_speculation_with_penalties_follows_the_penalized_target(target_model, draft_model, lossless_case,
                                                                         num_samples, tv_bound):
    prompt, expected = lossless_case
    observed, acceptance = speculative_samples(target_model, draft_model, prompt, num_samples)
    assert_lossless(observed, acceptance, expected, tv_bound, "lossless")


def assert_lossless(observed: Counter, acceptance: float, expected: dict[tuple, float], tv_bound: float,
                    label: str) -> None:
    """The samples follow the enumerated distribution (chi-square above P_VALUE_FLOOR, TV under
    tv_bound), from rounds that both accept and reject, so every block position is exercised."""
    assert 0.2 < acceptance < 0.98
    assert set(observed) <= set(expected)
    p_value, distance = chi_square_p_value(observed, expected), total_variation(observed, expected)
    print(f"{label}: acceptance {acceptance:.3f}, p {p_value:.3g}, TV {distance:.4f}")
    assert p_value > P_VALUE_FLOOR
    assert distance < tv_bound


def test_the_lossless_test_rejects_verify_rows_blind_to_earlier_draft_tokens(target_model, draft_model,
                                                                            lossless_case):
    prompt, expected = lossless_case
    observed, _ = speculative_samples(target_model, draft_model, prompt, BROKEN_SAMPLES, broken_target_rows)
    p_value = chi_square_p_value(observed, expected)
    print(f"broken: p {p_value:.3g}, TV {total_variation(observed, expected):.4f}")
    assert p_value < P_VALUE_FLOOR


def test_a_draft_equal_to_the_target_is_always_accepted_only_if_its_steps_see_their_own_tokens(
        target_model, monkeypatch):
    _, acceptance = speculative_samples(target_model, target_model, PROMPTS[1], 200)
    monkeypatch.setattr(Penalties, "advance", lambda self, token_ids: None)  # draft steps blind to the block
    _, blind = speculative_samples(target_model, target_model, PROMPTS[1], 200)
    print(f"acceptance of the target as its own draft: {acceptance:.4f}; blind draft steps {blind:.4f}")
    assert acceptance > 0.99
    assert blind < 0.9
