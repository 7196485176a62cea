"""SamplingParams validation and the logits -> probabilities processing (decoding/sampling.py)."""

import pytest
import torch
from pydantic import ValidationError

from specserve.decoding.sampling import (
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    SamplingParams,
    draft_seed,
    greedy_ids,
    logits_to_probs,
    make_generator,
    sample_from_probs,
)


# --- SamplingParams validation -------------------------------------------------------------------

def test_defaults_are_valid_and_not_greedy():
    params = SamplingParams()
    assert params.temperature == 1.0 and params.top_k == 0 and params.top_p == 1.0
    assert params.stop == [] and params.seed is None
    assert not params.is_greedy


def test_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0).is_greedy


def test_a_vanishing_temperature_is_greedy_not_nan():
    # Found by the HTTP fuzzer: temperature 1.7e-162 made logits / T overflow and softmax NaN.
    params = SamplingParams(temperature=1.7338245023557562e-162)
    assert params.is_greedy and not SamplingParams(temperature=1e-4).is_greedy
    probs = logits_to_probs(torch.tensor([[3.0, 1.0, -2.0]]), params)
    assert probs.tolist() == [[1.0, 0.0, 0.0]]


@pytest.mark.parametrize("temperature", [-0.1, MAX_TEMPERATURE + 0.01, float("nan"), float("inf")])
def test_temperature_out_of_range_is_rejected(temperature):
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.01])
def test_top_p_outside_zero_one_is_rejected(top_p):
    with pytest.raises(ValidationError, match="top_p"):
        SamplingParams(top_p=top_p)


def test_max_tokens_zero_is_rejected():
    with pytest.raises(ValidationError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_negative_seed_is_rejected():
    with pytest.raises(ValidationError, match="seed"):
        SamplingParams(seed=-1)


def test_stop_string_is_normalised_to_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValidationError, match="non-empty"):
        SamplingParams(stop=["ok", ""])


def test_more_stop_strings_than_openai_allows_are_rejected():
    assert len(SamplingParams(stop=[str(i) for i in range(MAX_STOP_STRINGS)]).stop) == MAX_STOP_STRINGS == 4
    with pytest.raises(ValidationError, match=f"at most {MAX_STOP_STRINGS}"):
        SamplingParams(stop=[str(i) for i in range(MAX_STOP_STRINGS + 1)])


def test_seed_beyond_64_bits_is_rejected():
    # torch.Generator.manual_seed would raise deep in the router past 64 bits.
    assert SamplingParams(seed=MAX_SEED).seed == MAX_SEED
    with pytest.raises(ValidationError, match="seed"):
        SamplingParams(seed=MAX_SEED + 1)


def test_min_tokens_and_ignore_eos_default_off_and_min_tokens_is_bounded_by_max_tokens():
    params = SamplingParams()
    assert params.min_tokens == 0 and not params.ignore_eos
    assert SamplingParams(min_tokens=8, max_tokens=8, ignore_eos=True).min_tokens == 8
    with pytest.raises(ValidationError, match="min_tokens"):
        SamplingParams(min_tokens=9, max_tokens=8)
    with pytest.raises(ValidationError, match="min_tokens"):
        SamplingParams(min_tokens=-1)


def test_unknown_field_is_forbidden():
    with pytest.raises(ValidationError, match="temprature"):
        SamplingParams(temprature=0.5)


def test_params_are_frozen():
    params = SamplingParams()
    with pytest.raises(ValidationError):
        params.temperature = 0.0


# --- logits_to_probs -----------------------------------------------------------------------------

def test_greedy_gives_one_hot_at_argmax_with_lowest_index_on_ties():
    logits = torch.tensor([[0.1, 3.0, -1.0, 3.0], [5.0, 1.0, 2.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0))
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("shape", [(1, 8192), (5, 8192), (64, 2048), (3, 4, 8192), (7, 32001), (2, 128256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_are_torch_argmax_ties_to_the_lowest_index(shape, dtype):
    """The blocked CPU argmax picks what torch.argmax picks: random rows (bfloat16's coarse values
    tie often), a maximum repeated in two blocks, twice in one block, in the tail past the last
    whole block (tied with a block's: the block's, earlier), rows of -inf with one finite logit or
    none, and rows read through a strided view."""
    logits = torch.randn(shape, generator=make_generator(3)).to(dtype)
    flat = logits.view(-1, shape[-1])
    vocab = shape[-1]
    flat[0, [vocab - 1, 300, 5]] = 50.0                     # in two blocks and the tail: the first
    if flat.shape[0] > 1:
        flat[1, [140, 130]] = 50.0                          # twice in one block
        flat[-1] = float("-inf")                            # nothing finite: 0, as torch.argmax
    if flat.shape[0] > 2:
        flat[2] = float("-inf")
        flat[2, vocab - 2] = 1.0                            # only the tail's (or last block's) logit
    assert torch.equal(greedy_ids(logits), logits.argmax(dim=-1))
    strided = torch.cat([logits, logits], dim=-1)[..., :vocab]   # rows 2V apart
    assert torch.equal(greedy_ids(strided), logits.argmax(dim=-1))
    transposed = logits.reshape(-1, vocab).t().contiguous().t()  # the vocabulary not contiguous
    assert torch.equal(greedy_ids(transposed), transposed.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_temperature_scaling_matches_softmax_of_scaled_logits(temperature):
    logits = torch.randn(3, 5, 11, generator=make_generator(0))
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))


def test_top_k_keeps_exactly_k_most_likely_tokens():
    logits = torch.randn(4, 6, 20, generator=make_generator(1))
    probs = logits_to_probs(logits, SamplingParams(top_k=5))
    assert torch.equal((probs > 0).sum(-1), torch.full((4, 6), 5))
    kept = probs > 0
    top5 = torch.zeros_like(kept).scatter_(-1, logits.topk(5, dim=-1).indices, True)
    assert torch.equal(kept, top5)
    masked = logits.masked_fill(~kept, float("-inf"))
    torch.testing.assert_close(probs, torch.softmax(masked, dim=-1))


def test_top_k_breaks_ties_towards_lowest_index_and_still_keeps_k():
    logits = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0])
    probs = logits_to_probs(logits, SamplingParams(top_k=2))
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]))


def test_top_k_at_least_vocab_size_is_a_no_op():
    logits = torch.randn(2, 7, generator=make_generator(2))
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(top_k=7)), torch.softmax(logits, -1))
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(top_k=-1)), torch.softmax(logits, -1))


@pytest.mark.parametrize("top_p, kept", [
    (0.05, [0]),          # the top token always survives
    (0.5, [0]),           # 0.5 alone reaches 0.5
    (0.75, [0, 1]),       # 0.5 < 0.75 <= 0.8
    (0.85, [0, 1, 2]),    # 0.8 < 0.85 <= 0.95
    (1.0, [0, 1, 2, 3]),
])
def test_top_p_keeps_the_minimal_nucleus(top_p, kept):
    target = torch.tensor([0.15, 0.5, 0.05, 0.3])       # sorted: 0.5 (1), 0.3 (3), 0.15 (0), 0.05 (2)
    by_rank = [1, 3, 0, 2]
    probs = logits_to_probs(target.log(), SamplingParams(top_p=top_p))
    kept_ids = sorted(by_rank[rank] for rank in kept)
    assert torch.nonzero(probs).flatten().tolist() == kept_ids
    expected = torch.zeros(4)
    expected[kept_ids] = target[kept_ids] / target[kept_ids].sum()
    torch.testing.assert_close(probs, expected)


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # top-k=2 leaves [4/7, 3/7]; top-p=0.5 on that keeps only the first (on the raw 0.4 it would not).
    target = torch.tensor([0.4, 0.3, 0.2, 0.1])
    probs = logits_to_probs(target.log(), SamplingParams(top_k=2, top_p=0.5))
    torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_processing_is_vectorised_over_leading_dims():
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.8)
    logits = torch.randn(3, 4, 10, generator=make_generator(3))
    batched = logits_to_probs(logits, params)
    per_row = torch.stack([logits_to_probs(row, params) for row in logits.reshape(-1, 10)])
    torch.testing.assert_close(batched, per_row.view(3, 4, 10))
    torch.testing.assert_close(batched.sum(-1), torch.ones(3, 4))


# --- sample_from_probs / make_generator ----------------------------------------------------------

def test_sample_from_probs_is_deterministic_under_seed():
    probs = torch.softmax(torch.randn(2, 50, 32, generator=make_generator(4)), dim=-1)
    first = sample_from_probs(probs, make_generator(123))
    second = sample_from_probs(probs, make_generator(123))
    other = sample_from_probs(probs, make_generator(124))
    assert first.shape == (2, 50) and first.dtype == torch.long
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


def test_sample_from_probs_never_draws_zero_probability_tokens_and_follows_probs():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.8])
    samples = sample_from_probs(probs.expand(20_000, 4), make_generator(5))
    counts = torch.bincount(samples, minlength=4).float() / samples.numel()
    assert counts[0] == 0 and counts[2] == 0
    assert abs(counts[3].item() - 0.8) < 0.02       # ~7 standard deviations at n = 20k


def test_make_generator_without_seed_gives_different_streams():
    draws = {torch.rand(4, generator=make_generator(None)).sum().item() for _ in range(3)}
    assert len(draws) == 3
    assert torch.equal(torch.rand(4, generator=make_generator(9)), torch.rand(4, generator=make_generator(9)))


def test_the_draft_stream_differs_from_every_choice_stream_of_its_request():
    """Torch's CPU generator keeps a seed's low 32 bits: a draft seed equal to seed + j there would
    make the draft and choice j's target draw the same numbers (and seed ^ 2**62 equals seed)."""
    for seed in (0, 1, 7, 123456789, MAX_SEED - 3):
        draft = draft_seed(seed)
        assert 0 <= draft <= MAX_SEED
        assert all((draft - (seed + j)) % 2**32 for j in range(17))
        first = torch.rand(4, generator=make_generator(draft))
        assert not torch.equal(first, torch.rand(4, generator=make_generator(seed)))
