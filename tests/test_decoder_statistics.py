"""Sampled speculation on architectures beyond Llama follows the target exactly: Qwen3 (q/k norms)
and Gemma 3 (sliding windows shorter than the prompt, scaled embeddings), target and draft both
served by the engine's batched paged runner, 6,000 seeded requests (20,000 under the stat_full
marker: `make stat-full`) through the real round path
(decoding.generate.generate_batch: DraftModelProposer, target_rows, block verification).

At the first speculative position and the next one, the emitted tokens' marginal must pass a
chi-square test (p > 1e-3) and stay under exact sampling's 99.9% TV quantile against the target's
exact marginal (enumerated with transformers' own cache-free forward), while the same test rejects
the draft's marginal: a sampler that emitted the draft's tokens would fail."""

import pytest
import torch

from specserve.decoding.scheduler import engine_for_model
from specserve.decoding.generate import generate_batch
from specserve.decoding.proposers import DraftModelProposer
from specserve.decoding.sampling import SamplingParams, logits_to_probs
from specserve.decoding.sequence import RequestState
from tests.reference_runner import reference_model
from tests.test_generate import chi_square_p_value, null_tv_bound, total_variation
from tests.tiny_pair import SHORT_WINDOW, tiny_model

VOCAB_SIZE = 24
NUM_REQUESTS = 20_000   # the full run: `make stat-full` (marker stat_full)
CI_REQUESTS = 6_000     # what `make test` runs: the draft's marginal is still rejected
CHUNK = 5_000           # requests per generate_batch (bounds the forward's memory)
PARAMS = SamplingParams(temperature=0.9, top_k=16, max_tokens=3)
PROMPT = [3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7]   # longer than SHORT_WINDOW


def exact_marginals(model, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """P(token 1) and P(token 2) under `model` after the target's token 0, float64."""
    reference = reference_model(model)

    def probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = reference(torch.tensor(prefixes)).logits[:, -1].float()
        return logits_to_probs(logits, PARAMS).double()

    tokens = range(VOCAB_SIZE)
    p1 = probs([prompt + [a] for a in tokens])
    p2 = probs([prompt + [a, b] for a in tokens for b in tokens]).reshape(VOCAB_SIZE, VOCAB_SIZE, -1)
    return p1, p2


@pytest.mark.parametrize("num_requests", [CI_REQUESTS, pytest.param(NUM_REQUESTS, marks=pytest.mark.stat_full)])
@pytest.mark.parametrize("architecture", ["qwen3", "gemma3"])
def test_sampled_speculation_follows_the_target_on_new_architectures(architecture, num_requests):
    assert len(PROMPT) > SHORT_WINDOW
    assert_speculation_follows_the_target(tiny_model(architecture, seed=0, vocab_size=VOCAB_SIZE),
                                          tiny_model(architecture, seed=1, vocab_size=VOCAB_SIZE), num_requests)


def assert_speculation_follows_the_target(target_model, draft_model, num_requests: int, seed: int = 2026,
                                          check=None) -> None:
    """num_requests seeded requests (PARAMS, PROMPT) through the round path with draft_model drafting
    for target_model: the emitted marginals at positions 1 and 2 pass against the target's exact ones
    and fail against the draft's. check(marginals), where given, sees the exact marginals first."""
    with torch.no_grad():
        p0 = logits_to_probs(reference_model(target_model)(torch.tensor([PROMPT])).logits[0, -1].float(),
                             PARAMS).double()
    marginals = {}
    for name, model in (("target", target_model), ("draft", draft_model)):
        p1, p2 = exact_marginals(model, PROMPT)
        joint01 = p0[:, None] * p1
        marginals[name] = (joint01.sum(0), torch.einsum("ab,abc->c", joint01, p2))
    if check is not None:
        check(marginals)
    target = engine_for_model(target_model, max_sequences=CHUNK)
    draft = engine_for_model(draft_model, max_sequences=CHUNK)
    # Seeds drawn at random (from a fixed stream), as an unseeded request's are (docs/testing.md
    # says what seeds 0, 1, 2, ... gave).
    seeds = torch.randint(0, 2**62, (num_requests,), generator=torch.Generator().manual_seed(seed)).tolist()
    outputs = []
    for start in range(0, num_requests, CHUNK):
        states = [RequestState(f"r{i}", PROMPT, SamplingParams(**{**PARAMS.__dict__, "seed": seeds[i]}), None,
                               max_context=64) for i in range(start, min(start + CHUNK, num_requests))]
        generate_batch(target, states, DraftModelProposer(draft), num_draft_tokens=2)
        outputs += [state.output_ids for state in states]
    emitted = torch.tensor(outputs)
    for position in (1, 2):
        counts = torch.bincount(emitted[:, position], minlength=VOCAB_SIZE).double()
        wanted, draft_marginal = marginals["target"][position - 1], marginals["draft"][position - 1]
        bound = null_tv_bound(wanted, num_requests)
        assert chi_square_p_value(counts, wanted) > 1e-3 and total_variation(counts, wanted) < bound
        assert chi_square_p_value(counts, draft_marginal) < 1e-3 and total_variation(counts, draft_marginal) > bound
