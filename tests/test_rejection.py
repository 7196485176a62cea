"""Rejection sampling (decoding/rejection.py): exact cases, invariants, and statistical losslessness.

Statistical tests batch the SAME rows >= 100k times and call rejection_sample once. Tolerances:
total-variation distance to the target row < 0.01 (at n = 200k the sampling noise is ~0.003 for
V <= 16), and a chi-square goodness-of-fit test that does not reject at 1e-3, while the draft
distribution (or the unprocessed target) is rejected at 1e-3. All generators are seeded.
"""

import pytest
import torch
from scipy.stats import chisquare

from specserve.decoding.compact_verify import DraftSupport, saguaro_support
from specserve.decoding.rejection import PLACEHOLDER_TOKEN_ID, greedy_verify, rejection_sample
from specserve.decoding.sampling import SamplingParams, logits_to_probs, make_generator, sample_from_probs

NUM_SAMPLES = 200_000
TV_TOLERANCE = 0.01
P_VALUE_THRESHOLD = 1e-3


def one_hot(ids, vocab_size: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.as_tensor(ids), vocab_size).float()


def random_rows(shape, vocab_size: int, num_zeros: int, generator: torch.Generator) -> torch.Tensor:
    """Normalised rows [*shape, V] with exactly num_zeros zero entries at random places; the other
    entries are >= ~0.2/V so every supported cell has a healthy expected count."""
    weights = torch.empty(*shape, vocab_size).uniform_(0.2, 1.0, generator=generator)
    ranks = torch.rand(*shape, vocab_size, generator=generator).argsort(-1).argsort(-1)
    weights = weights.masked_fill(ranks < num_zeros, 0.0)
    return weights / weights.sum(-1, keepdim=True)


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    freqs = torch.bincount(samples, minlength=probs.numel()).double() / samples.numel()
    return 0.5 * (freqs - probs.double()).abs().sum().item()


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of samples to probs; 0 if a sample hit a zero-probability token."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    probs = probs.double()
    probs = probs / probs.sum()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs[support] * counts.sum()
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def assert_matches(samples: torch.Tensor, probs: torch.Tensor, check_tv: bool = True) -> None:
    pvalue = chi_square_pvalue(samples, probs)
    assert pvalue > P_VALUE_THRESHOLD, f"chi-square rejects the target row (p-value {pvalue:.2e})"
    if check_tv:
        tv = total_variation(samples, probs)
        assert tv < TV_TOLERANCE, f"total variation {tv:.4f} >= {TV_TOLERANCE}"


def assert_differs(samples: torch.Tensor, probs: torch.Tensor) -> None:
    pvalue = chi_square_pvalue(samples, probs)
    assert pvalue < P_VALUE_THRESHOLD, f"chi-square cannot tell samples from this row (p-value {pvalue:.2e})"


def rows_given_prefix(table: torch.Tensor, prefix_ids: list[torch.Tensor], batch_size: int) -> torch.Tensor:
    """The row for each sample's prefix: table [V]*len(prefix) x [V] indexed by the prefix ids."""
    if not prefix_ids:
        return table.expand(batch_size, table.shape[-1])
    return table[tuple(prefix_ids)]


def speculate(target_tables, draft_tables, batch_size: int, seed: int, draft_ids=None):
    """One speculative round for batch_size copies of the same toy language model.

    target_tables[i] / draft_tables[i] hold the target's / draft's distribution of token i given
    tokens 0..i-1 (shape [V]*i x [V]). The draft samples its K tokens from its tables, or, when
    draft_tables is None, proposes the fixed draft_ids (a deterministic, n-gram-like proposer).
    """
    generator = make_generator(seed)
    num_draft_tokens = len(target_tables) - 1
    if draft_tables is None:
        draft_token_ids = torch.tensor(draft_ids).expand(batch_size, num_draft_tokens)
        draft_probs = None
    else:
        prefix, q_rows = [], []
        for table in draft_tables:
            q_rows.append(rows_given_prefix(table, prefix, batch_size))
            prefix.append(sample_from_probs(q_rows[-1], generator))
        draft_token_ids = torch.stack(prefix, dim=1)
        draft_probs = torch.stack(q_rows, dim=1)
    prefix = list(draft_token_ids.unbind(1))
    target_probs = torch.stack(
        [rows_given_prefix(table, prefix[:i], batch_size) for i, table in enumerate(target_tables)], dim=1)
    output = rejection_sample(draft_token_ids, draft_probs, target_probs, generator)
    return draft_token_ids, output


def random_rejection_inputs(batch_size: int, num_draft_tokens: int, vocab_size: int, seed: int):
    generator = make_generator(seed)
    draft_probs = random_rows((batch_size, num_draft_tokens), vocab_size, vocab_size // 4, generator)
    target_probs = random_rows((batch_size, num_draft_tokens + 1), vocab_size, vocab_size // 4, generator)
    draft_token_ids = sample_from_probs(draft_probs, generator)
    return draft_token_ids, draft_probs, target_probs


# --- exact cases ---------------------------------------------------------------------------------

def test_perfect_match_accepts_every_draft_token_and_appends_the_bonus_token():
    draft_token_ids = torch.tensor([[1, 2, 3]])
    target_probs = one_hot([[1, 2, 3, 4]], 5)
    output = rejection_sample(draft_token_ids, one_hot(draft_token_ids, 5), target_probs, make_generator(0))
    assert output.tolist() == [[1, 2, 3, 4]]


def test_early_mismatch_emits_the_recovered_token_then_placeholders():
    draft_token_ids = torch.tensor([[1, 2, 3]])
    target_probs = one_hot([[1, 0, 3, 4]], 5)
    output = rejection_sample(draft_token_ids, one_hot(draft_token_ids, 5), target_probs, make_generator(0))
    assert output.tolist() == [[1, 0, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID]]


def test_rejection_at_the_first_position_emits_only_the_recovered_token():
    draft_token_ids = torch.tensor([[4, 4, 4]])
    target_probs = one_hot([[2, 4, 4, 4]], 5)
    output = rejection_sample(draft_token_ids, one_hot(draft_token_ids, 5), target_probs, make_generator(0))
    assert output.tolist() == [[2, -1, -1, -1]]


def test_sequences_in_one_batch_get_their_own_outcomes():
    draft_token_ids = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 4, 4], [0, 1, 2]])
    target_ids = torch.tensor([[1, 2, 3, 4], [1, 0, 3, 4], [0, 4, 4, 4], [0, 1, 3, 3]])
    output = rejection_sample(draft_token_ids, one_hot(draft_token_ids, 5), one_hot(target_ids, 5),
                              make_generator(0))
    assert output.tolist() == [[1, 2, 3, 4], [1, 0, -1, -1], [0, -1, -1, -1], [0, 1, 3, -1]]


@pytest.mark.parametrize("target_ids, expected", [([2, 3], [2, 3]), ([0, 3], [0, -1])])
def test_single_draft_token(target_ids, expected):
    draft_token_ids = torch.tensor([[2]])
    output = rejection_sample(draft_token_ids, one_hot(draft_token_ids, 4), one_hot([target_ids], 4),
                              make_generator(0))
    assert output.tolist() == [expected]


def test_zero_draft_tokens_sample_one_token_from_target_row_zero():
    target_row = torch.tensor([0.1, 0.0, 0.6, 0.3])
    batch_size = 20_000
    target_probs = target_row.expand(batch_size, 1, 4)
    for draft_probs in (torch.empty(batch_size, 0, 4), None):
        output = rejection_sample(torch.empty(batch_size, 0, dtype=torch.long), draft_probs, target_probs,
                                  make_generator(1))
        assert output.shape == (batch_size, 1) and output.dtype == torch.long
        assert (output[:, 0] != 1).all()
        assert total_variation(output[:, 0], target_row) < 0.02    # ~6 standard deviations at n = 20k


def test_ngram_draft_is_accepted_with_target_probability_and_residual_excludes_it():
    # draft_probs None: q is one-hot at the draft token, so accept iff u < p(x); on rejection the
    # recovered token comes from p with x removed.
    batch_size = 20_000
    draft_token_ids = torch.full((batch_size, 1), 1)
    target_probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.25, 0.25, 0.25, 0.25]]).expand(batch_size, 2, 4)
    output = rejection_sample(draft_token_ids, None, target_probs, make_generator(2))
    accepted = output[:, 0] == 1
    assert abs(accepted.float().mean().item() - 0.5) < 0.02
    assert (output[~accepted, 0] == 3).all()
    assert (output[~accepted, 1] == PLACEHOLDER_TOKEN_ID).all()
    assert (output[accepted, 1] >= 0).all()


@pytest.mark.parametrize("target_row, expected_first_token", [
    ([0.0, 1.0, 0.0], 1),   # p(x) = 1: always accepted
    ([1.0, 0.0, 0.0], 0),   # p(x) = 0: always rejected, token 0 recovered
])
def test_ngram_draft_with_certain_or_impossible_target_probability(target_row, expected_first_token):
    target_probs = torch.tensor(target_row).expand(1000, 2, 3)
    output = rejection_sample(torch.full((1000, 1), 1), None, target_probs, make_generator(3))
    assert (output[:, 0] == expected_first_token).all()


def test_same_seed_gives_same_output_and_another_seed_differs():
    inputs = random_rejection_inputs(batch_size=256, num_draft_tokens=4, vocab_size=12, seed=4)
    first = rejection_sample(*inputs, generator=make_generator(7))
    second = rejection_sample(*inputs, generator=make_generator(7))
    other = rejection_sample(*inputs, generator=make_generator(8))
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


def test_draft_token_with_zero_target_probability_is_always_rejected():
    # p(x) = 0 < q(x): reject, and recover from max(0, p - q) = [0, 0.2, 0.5, 0] -> token 1 : 2 = 2 : 5.
    batch_size = 20_000
    draft_probs = torch.tensor([0.7, 0.3, 0.0, 0.0]).expand(batch_size, 1, 4)
    target_probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25] * 4]).expand(batch_size, 2, 4)
    output = rejection_sample(torch.zeros(batch_size, 1, dtype=torch.long), draft_probs, target_probs,
                              make_generator(5))
    assert (output[:, 1] == PLACEHOLDER_TOKEN_ID).all()
    assert set(output[:, 0].unique().tolist()) == {1, 2}
    assert abs((output[:, 0] == 1).float().mean().item() - 2 / 7) < 0.02


def test_draft_token_with_zero_draft_probability_is_accepted_when_target_allows_it():
    # q(x) = 0 < p(x): min(1, p/q) = 1, so always accept (no division by zero, no NaN).
    batch_size = 1000
    draft_probs = torch.tensor([0.5, 0.5, 0.0, 0.0]).expand(batch_size, 1, 4)
    target_probs = torch.tensor([[0.2, 0.2, 0.6, 0.0], [0.0, 0.0, 0.0, 1.0]]).expand(batch_size, 2, 4)
    output = rejection_sample(torch.full((batch_size, 1), 2), draft_probs, target_probs, make_generator(6))
    assert (output == torch.tensor([2, 3])).all()


def test_empty_residual_falls_back_to_the_target_row():
    # The draft proposed a token neither p nor q supports: rejected, and max(0, p - q) is all zero.
    batch_size = 1000
    rows = torch.tensor([0.5, 0.5, 0.0, 0.0])
    output = rejection_sample(torch.full((batch_size, 1), 3), rows.expand(batch_size, 1, 4),
                              rows.expand(batch_size, 2, 4), make_generator(7))
    assert set(output[:, 0].unique().tolist()) == {0, 1}
    assert (output[:, 1] == PLACEHOLDER_TOKEN_ID).all()


def test_output_shape_and_placeholder_padding_invariants():
    batch_size, num_draft_tokens, vocab_size = 4000, 4, 10
    draft_token_ids, draft_probs, target_probs = random_rejection_inputs(
        batch_size, num_draft_tokens, vocab_size, seed=8)
    output = rejection_sample(draft_token_ids, draft_probs, target_probs, make_generator(9))
    assert output.shape == (batch_size, num_draft_tokens + 1) and output.dtype == torch.long

    num_emitted = (output != PLACEHOLDER_TOKEN_ID).sum(-1)
    num_accepted = num_emitted - 1
    positions = torch.arange(num_draft_tokens + 1)
    # Emitted tokens form a prefix of at least one token; the rest is placeholder.
    assert torch.equal(output != PLACEHOLDER_TOKEN_ID, positions < num_emitted.unsqueeze(-1))
    # The accepted part is the draft's own prefix.
    accepted_slots = positions[:num_draft_tokens] < num_accepted.unsqueeze(-1)
    assert torch.equal(output[:, :num_draft_tokens][accepted_slots], draft_token_ids[accepted_slots])
    # A recovered token has positive residual p - q at its position; a bonus token has p > 0.
    rows = torch.arange(batch_size)
    emitted = output[rows, num_accepted]
    target_of_emitted = target_probs[rows, num_accepted, emitted]
    draft_of_emitted = torch.where(
        num_accepted < num_draft_tokens,
        draft_probs[rows, num_accepted.clamp(max=num_draft_tokens - 1), emitted], torch.zeros(()))
    assert (target_of_emitted > draft_of_emitted).all()
    # The inputs are random enough that every outcome 0..K occurs.
    assert set(num_accepted.tolist()) == set(range(num_draft_tokens + 1))


def test_mismatched_shapes_raise_value_error():
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(torch.zeros(2, 3, dtype=torch.long), None, torch.rand(2, 3, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 3, 4), torch.rand(2, 4, 5))
    with pytest.raises(ValueError, match="target_token_ids"):
        greedy_verify(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))


# --- greedy --------------------------------------------------------------------------------------

def test_greedy_verify_accepts_while_draft_equals_target_argmax():
    draft_token_ids = torch.tensor([[1, 2, 3], [1, 2, 3], [5, 2, 3], [1, 9, 9]])
    target_token_ids = torch.tensor([[1, 2, 3, 7], [1, 2, 4, 7], [1, 2, 3, 7], [1, 2, 3, 7]])
    assert greedy_verify(draft_token_ids, target_token_ids).tolist() == [
        [1, 2, 3, 7], [1, 2, 4, -1], [1, -1, -1, -1], [1, 2, -1, -1]]


def drafts_against_greedy_targets(batch_size: int, num_draft_tokens: int, vocab_size: int, seed: int):
    """(draft ids [B, K], target argmax ids [B, K+1]): drafts copy the target's ids except where a
    quarter of positions, at random, are replaced, so every number of accepted tokens occurs."""
    generator = make_generator(seed)
    target_token_ids = torch.randint(vocab_size, (batch_size, num_draft_tokens + 1), generator=generator)
    corrupt = torch.rand(batch_size, num_draft_tokens, generator=generator) < 0.25
    draft_token_ids = torch.where(
        corrupt, torch.randint(vocab_size, (batch_size, num_draft_tokens), generator=generator),
        target_token_ids[:, :num_draft_tokens])
    return draft_token_ids, target_token_ids


def test_greedy_verify_equals_rejection_sample_with_one_hot_rows():
    batch_size, num_draft_tokens, vocab_size = 500, 5, 7
    draft_token_ids, target_token_ids = drafts_against_greedy_targets(batch_size, num_draft_tokens, vocab_size, 10)
    greedy = greedy_verify(draft_token_ids, target_token_ids)
    target_probs = one_hot(target_token_ids, vocab_size)
    for draft_probs in (one_hot(draft_token_ids, vocab_size), None):
        sampled = rejection_sample(draft_token_ids, draft_probs, target_probs, make_generator(11))
        assert torch.equal(greedy, sampled)
    assert set(((greedy != -1).sum(-1) - 1).tolist()) == set(range(num_draft_tokens + 1))


def test_greedy_verify_with_zero_draft_tokens_returns_the_target_token():
    assert greedy_verify(torch.empty(2, 0, dtype=torch.long), torch.tensor([[4], [6]])).tolist() == [[4], [6]]


# --- statistical losslessness --------------------------------------------------------------------

def check_positions(target_tables, draft_token_ids, output, min_conditional_samples: int = 5000):
    """Position 0 matches target row 0; position i, among samples whose draft prefix 0..i-1 was
    accepted, matches the target's row given that prefix (checked for every well-sampled prefix).
    Returns the number of conditional checks made."""
    assert_matches(output[:, 0], target_tables[0])
    num_checks = 0
    for position in range(1, output.shape[1]):
        reached = output[:, position] != PLACEHOLDER_TOKEN_ID
        prefixes, counts = draft_token_ids[reached, :position].unique(dim=0, return_counts=True)
        for prefix, count in zip(prefixes, counts):
            if count < min_conditional_samples:
                continue
            same_prefix = reached & (draft_token_ids[:, :position] == prefix).all(-1)
            assert_matches(output[same_prefix, position], target_tables[position][tuple(prefix)],
                           check_tv=False)   # conditional samples are fewer; chi-square carries it
            num_checks += 1
    return num_checks


def toy_language_model(vocab_size: int, num_draft_tokens: int, generator: torch.Generator):
    """Tables of token i's distribution given tokens 0..i-1, 3 zeros per row at random places."""
    return [random_rows((vocab_size,) * i, vocab_size, 3, generator) for i in range(num_draft_tokens + 1)]


def test_emitted_tokens_follow_the_target_not_the_draft():
    vocab_size, num_draft_tokens = 12, 2
    generator = make_generator(20)
    target_tables = toy_language_model(vocab_size, num_draft_tokens, generator)
    draft_tables = toy_language_model(vocab_size, num_draft_tokens - 1, generator)
    # Row 0 explicitly: q is zero where p is not (tokens 0, 1) and p is zero where q is not (2, 3).
    target_tables[0] = random_rows((), vocab_size, 0, generator).index_fill(0, torch.tensor([2, 3]), 0.0)
    draft_tables[0] = random_rows((), vocab_size, 0, generator).index_fill(0, torch.tensor([0, 1]), 0.0)
    target_tables[0] /= target_tables[0].sum()
    draft_tables[0] /= draft_tables[0].sum()

    draft_token_ids, output = speculate(target_tables, draft_tables, NUM_SAMPLES, seed=21)
    assert_differs(output[:, 0], draft_tables[0])
    assert check_positions(target_tables, draft_token_ids, output) >= 3
    # The draft's own conditional row at position 1 is rejected by the same test.
    token = draft_token_ids[output[:, 1] != -1, 0].mode().values
    reached = (output[:, 1] != -1) & (draft_token_ids[:, 0] == token)
    assert_differs(output[reached, 1], draft_tables[1][token])


def test_ngram_draft_emitted_tokens_follow_the_target():
    vocab_size, num_draft_tokens = 12, 2
    target_tables = toy_language_model(vocab_size, num_draft_tokens, make_generator(30))
    first = int(target_tables[0].argmax())
    second = int(target_tables[1][first].argmax())
    draft_token_ids, output = speculate(target_tables, None, NUM_SAMPLES, seed=31, draft_ids=[first, second])
    assert_differs(output[:, 0], one_hot(first, vocab_size))
    assert check_positions(target_tables, draft_token_ids, output) == 2


def test_processed_target_distribution_is_preserved():
    vocab_size, num_draft_tokens = 16, 2
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    generator = make_generator(40)
    target_logits = [2.0 * torch.randn((vocab_size,) * (i + 1), generator=generator)
                     for i in range(num_draft_tokens + 1)]
    draft_logits = [logits + torch.randn(logits.shape, generator=generator)
                    for logits in target_logits[:num_draft_tokens]]
    target_tables = [logits_to_probs(logits, params) for logits in target_logits]
    draft_tables = [logits_to_probs(logits, params) for logits in draft_logits]
    assert (target_tables[0] == 0).sum() >= 6 and (draft_tables[0] == 0).sum() >= 6

    draft_token_ids, output = speculate(target_tables, draft_tables, NUM_SAMPLES, seed=41)
    assert check_positions(target_tables, draft_token_ids, output) >= 2
    assert_differs(output[:, 0], draft_tables[0])
    assert_differs(output[:, 0], torch.softmax(target_logits[0], dim=-1))   # the unprocessed target


# --- Saguaro sampling: the draft lowers its top tokens, the output stays the target's ------------

def lowered(rows: torch.Tensor, num_lowered: int, downweight: float) -> torch.Tensor:
    """rows [..., V] as a draft sampling with Saguaro sampling draws from them."""
    ids = torch.arange(rows.shape[-1]).expand_as(rows)
    return saguaro_support(DraftSupport(ids, rows), num_lowered, downweight).probs


def saguaro_case(seed: int = 11, vocab_size: int = 8):
    """A toy pair of K = 2: target tables, and the draft's tables close to them."""
    generator = make_generator(seed)
    target = [random_rows((vocab_size,) * i, vocab_size, 1, generator) for i in range(3)]
    noise = [random_rows((vocab_size,) * i, vocab_size, 0, generator) for i in range(2)]
    draft = [0.7 * target[i] + 0.3 * noise[i] for i in range(2)]
    return target, draft


def test_a_draft_sampling_from_its_lowered_rows_keeps_the_targets_distribution():
    """Drafted from q' (top 2 of each row scaled by 0.3), verified against that q': the first token
    is the target's; and a recovered token falls on the lowered tokens (those the speculation cache
    pre-drafts for) far more often than when the draft samples from its own q."""
    target, draft = saguaro_case()
    saguaro = [lowered(table, 2, 0.3) for table in draft]
    draft_ids, output = speculate(target, saguaro, NUM_SAMPLES, seed=3)
    assert_matches(output[:, 0], target[0])

    def recovered_on_top(draft_tables) -> float:
        ids, out = speculate(target, draft_tables, NUM_SAMPLES, seed=4)
        rejected = out[:, 0] != ids[:, 0]
        top = torch.topk(draft[0], 2).indices
        return torch.isin(out[rejected, 0], top).double().mean().item()

    assert recovered_on_top(saguaro) > 0.8 > recovered_on_top(draft) + 0.3


def test_the_saguaro_test_rejects_a_draft_verified_against_the_row_it_did_not_sample_from():
    """Drawn from q' but verified against the draft's own q: not the target's distribution."""
    target, draft = saguaro_case()
    generator = make_generator(3)
    drawn = lowered(draft[0], 2, 0.3).expand(NUM_SAMPLES, -1)
    first = sample_from_probs(drawn, generator)
    second_rows = lowered(draft[1], 2, 0.3)[first]
    second = sample_from_probs(second_rows, generator)
    draft_ids = torch.stack([first, second], dim=1)
    claimed = torch.stack([draft[0].expand(NUM_SAMPLES, -1), draft[1][first]], dim=1)
    target_rows = torch.stack([target[0].expand(NUM_SAMPLES, -1), target[1][first], target[2][first, second]], dim=1)
    output = rejection_sample(draft_ids, claimed, target_rows, generator)
    assert_differs(output[:, 0], target[0])


def test_saguaro_support_lowers_the_top_tokens_and_refuses_a_bad_downweight():
    row = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    ids = torch.tensor([[2, 0, 1, 3]])
    out = saguaro_support(DraftSupport(ids, row), 1, 0.5)
    assert torch.equal(out.ids, ids)
    assert torch.allclose(out.probs, torch.tensor([[0.25, 0.3, 0.2, 0.0]]) / 0.75)
    assert saguaro_support(DraftSupport(ids, row), 1, 1.0).probs is row
    assert torch.allclose(saguaro_support(DraftSupport(ids, row), 3, 0.2).probs, row)   # all lowered: as it was
    with pytest.raises(ValueError, match="downweight"):
        saguaro_support(DraftSupport(ids, row), 1, 0.0)
