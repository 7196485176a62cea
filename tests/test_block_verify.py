"""Block verification (decoding/rejection.py block_verify): losslessness of the joint output, more
tokens than token-wise, exact agreement with token-wise where the two must agree, degenerate rows.

The joint test: prefix-dependent toy target and draft models over a small vocabulary (every prefix
its own random row, with zeros so that q = 0 < p and p = 0 < q both occur), drafts sampled from
the draft model, one verification, the output continued with the target to K+1 tokens. The
emitted sequence's distribution over all V^(K+1) sequences must be the target's: a chi-square
test (cells expected below 5 pooled) that does not reject at 1e-3, and a total-variation distance
below TV_TOLERANCE (at n = 200k over 256 cells the sampling noise is ~0.01). The same test rejects
two broken verifiers at 1e-3. All generators are seeded.
"""

import pytest
import torch
from scipy.stats import chisquare

import specserve.decoding.rejection as rejection
from specserve.common.config import SpeculationSpec
from specserve.decoding.rejection import (PLACEHOLDER_TOKEN_ID, block_verify, expected_num_accepted, greedy_verify,
                                rejection_sample)
from specserve.decoding.sampling import SamplingParams, make_generator, sample_from_probs
from specserve.decoding.sequence import RequestState
from specserve.decoding.proposers import DraftModelProposer, Proposal
from specserve.decoding.compact_verify import draft_support
from specserve.decoding.speculation import accept_round, verify_answer
from tests.test_generate import (PROMPTS, VOCAB_SIZE, TableRunner, chi_square_p_value, logit_table,
                                 position_marginals, seeded_requests, target_model, total_variation,
                                 unrelated_draft_model)
from tests.test_rejection import drafts_against_greedy_targets, one_hot, random_rows, rows_given_prefix

NUM_SAMPLES = 200_000
TOY_VOCAB_SIZE, NUM_DRAFT_TOKENS = 4, 3
NUM_GENERATE_RUNS = 6000
TV_TOLERANCE = 0.02
P_VALUE_THRESHOLD = 1e-3
MIN_EXPECTED_COUNT = 5


def toy_models(seed: int, vocab_size: int = TOY_VOCAB_SIZE, num_draft_tokens: int = NUM_DRAFT_TOKENS):
    """Target tables for tokens 0..K and draft tables for tokens 0..K-1 (table i: [V]*i x [V],
    token i's row given tokens 0..i-1), one zero per row at a random place."""
    generator = make_generator(seed)
    target = [random_rows((vocab_size,) * i, vocab_size, 1, generator) for i in range(num_draft_tokens + 1)]
    draft = [random_rows((vocab_size,) * i, vocab_size, 1, generator) for i in range(num_draft_tokens)]
    return target, draft


def draft_and_rows(target_tables, draft_tables, batch_size: int, generator: torch.Generator, draft_ids=None):
    """(draft ids [B, K], draft rows [B, K, V] or None, target rows [B, K+1, V]) for one round:
    drafts sampled from the draft tables, or the fixed draft_ids when draft_tables is None."""
    if draft_tables is None:
        draft_token_ids, draft_probs = torch.tensor(draft_ids).expand(batch_size, len(draft_ids)), None
    else:
        prefix, q_rows = [], []
        for table in draft_tables:
            q_rows.append(rows_given_prefix(table, prefix, batch_size))
            prefix.append(sample_from_probs(q_rows[-1], generator))
        draft_token_ids, draft_probs = torch.stack(prefix, dim=1), torch.stack(q_rows, dim=1)
    prefix = list(draft_token_ids.unbind(1))
    target_probs = torch.stack(
        [rows_given_prefix(table, prefix[:i], batch_size) for i, table in enumerate(target_tables)], dim=1)
    return draft_token_ids, draft_probs, target_probs


def emitted_sequences(verifier, target_tables, draft_tables, seed: int, draft_ids=None,
                      batch_size: int = NUM_SAMPLES) -> torch.Tensor:
    """One verification per sample, its output continued with the target to K+1 tokens [B, K+1]."""
    generator = make_generator(seed)
    inputs = draft_and_rows(target_tables, draft_tables, batch_size, generator, draft_ids)
    return continued_with_target(verifier(*inputs, generator=generator), target_tables, generator)


def continued_with_target(sequences: torch.Tensor, target_tables, generator: torch.Generator) -> torch.Tensor:
    """A verifier's output [B, K+1] with its -1 slots filled by sampling the target tables."""
    for position, table in enumerate(target_tables):
        continuation = sample_from_probs(rows_given_prefix(table, list(sequences[:, :position].unbind(1)),
                                                           sequences.shape[0]), generator)
        sequences[:, position] = torch.where(sequences[:, position] == PLACEHOLDER_TOKEN_ID, continuation,
                                             sequences[:, position])
    return sequences


def joint_probabilities(tables) -> torch.Tensor:
    """The exact distribution of whole sequences, flattened [V^(K+1)] in the order of sequence_codes."""
    joint = tables[0].double()
    for table in tables[1:]:
        joint = joint.unsqueeze(-1) * table.double()
    return (joint / joint.sum()).flatten()


def sequence_codes(sequences: torch.Tensor, vocab_size: int) -> torch.Tensor:
    codes = torch.zeros(sequences.shape[0], dtype=torch.long)
    for position in range(sequences.shape[1]):
        codes = codes * vocab_size + sequences[:, position]
    return codes


def pooled_chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit with cells expected below MIN_EXPECTED_COUNT pooled into one; 0 if any
    sample fell on a zero-probability cell."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    large = expected >= MIN_EXPECTED_COUNT
    small = (probs > 0) & ~large
    observed_cells, expected_cells = counts[large], expected[large]
    if small.any():
        observed_cells = torch.cat([observed_cells, counts[small].sum().unsqueeze(0)])
        expected_cells = torch.cat([expected_cells, expected[small].sum().unsqueeze(0)])
    return float(chisquare(observed_cells.numpy(), expected_cells.numpy()).pvalue)


def joint_fit(sequences: torch.Tensor, target_tables) -> tuple[float, float]:
    """(chi-square p-value, total variation) of the sequences against the target's joint."""
    probs = joint_probabilities(target_tables)
    counts = torch.bincount(sequence_codes(sequences, target_tables[0].numel()), minlength=probs.numel()).double()
    tv = 0.5 * (counts / counts.sum() - probs).abs().sum().item()
    return pooled_chi_square_pvalue(counts, probs), tv


def num_accepted(output: torch.Tensor) -> torch.Tensor:
    return (output != PLACEHOLDER_TOKEN_ID).sum(-1) - 1


# --- the joint distribution is the target's ----------------------------------------------------

@pytest.mark.parametrize("proposer", ["draft model", "deterministic"])
def test_emitted_sequences_follow_the_targets_joint_distribution(proposer):
    target_tables, draft_tables = toy_models(seed=1)
    if proposer == "deterministic":   # q one-hot: a fixed guess, its last token impossible for the target
        first = int(target_tables[0].argmax())
        second = int(target_tables[1][first].argmax())
        draft_tables, draft_ids = None, [first, second, int(target_tables[2][first, second].argmin())]
    else:
        draft_ids = None
    sequences = emitted_sequences(block_verify, target_tables, draft_tables, seed=2, draft_ids=draft_ids)
    pvalue, tv = joint_fit(sequences, target_tables)
    assert pvalue > P_VALUE_THRESHOLD, f"chi-square rejects the target's joint distribution (p-value {pvalue:.2e})"
    assert tv < TV_TOLERANCE, f"total variation {tv:.4f} >= {TV_TOLERANCE}"


def _stop_without_residual(weights, target, draft):
    return weights[:, 1:]                     # h_i = P_i: the residual masses r_i left out


def _unweighted_residual(weight, target, draft):
    return (target - draft).clamp(min=0.0)    # max(p - q, 0) instead of max(P p - q, 0)


@pytest.mark.parametrize("helper, broken", [("_stop_probabilities", _stop_without_residual),
                                            ("_weighted_residual", _unweighted_residual)])
def test_the_joint_test_rejects_a_broken_verifier(monkeypatch, helper, broken):
    monkeypatch.setattr(rejection, helper, broken)
    target_tables, draft_tables = toy_models(seed=1)
    sequences = emitted_sequences(block_verify, target_tables, draft_tables, seed=2)
    pvalue, _ = joint_fit(sequences, target_tables)
    assert pvalue < P_VALUE_THRESHOLD, f"the joint test cannot tell a broken verifier (p-value {pvalue:.2e})"


# --- more tokens than token-wise ---------------------------------------------------------------

def test_papers_example_accepts_11_9_tokens_against_token_wises_10_9():
    # Sun et al., section 2: context-independent p = (1/3, 2/3), q = (2/3, 1/3), K = 2. Token-wise
    # keeps 10/9 draft tokens per round in expectation, block verification 11/9.
    blocks = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]])
    q = torch.tensor([2 / 3, 1 / 3])
    exact = expected_num_accepted(blocks, q.expand(4, 2, 2), torch.tensor([1 / 3, 2 / 3]).expand(4, 3, 2))
    draft_probability = q[blocks].prod(-1).double()
    token_wise, block = ((draft_probability * expectation).sum().item() for expectation in exact)
    assert token_wise == pytest.approx(10 / 9) and block == pytest.approx(11 / 9)
    # One block can lose: (a, a) keeps 3/4 token-wise, 1/2 jointly. The gain is over the drafts.
    assert exact[0][0].item() == pytest.approx(3 / 4) and exact[1][0].item() == pytest.approx(1 / 2)


def test_sampled_counts_match_the_exact_expectations_and_block_beats_token_wise():
    target_tables, draft_tables = toy_models(seed=4, vocab_size=6, num_draft_tokens=4)
    inputs = draft_and_rows(target_tables, draft_tables, NUM_SAMPLES, make_generator(5))
    token_exact, block_exact = expected_num_accepted(*inputs)
    assert block_exact.mean().item() > 1.02 * token_exact.mean().item()
    # Sampled counts agree with the expectations: 5 standard errors (< 0.02 tokens at n = 200k).
    for verifier, exact in ((block_verify, block_exact), (rejection_sample, token_exact)):
        counts = num_accepted(verifier(*inputs, generator=make_generator(6))).double()
        assert abs(counts.mean().item() - exact.mean().item()) < 5 * (counts.var() / NUM_SAMPLES).sqrt().item()


# --- where block and token-wise must agree exactly ---------------------------------------------

def test_one_hot_rows_give_exactly_token_wises_output():
    num_draft_tokens, vocab_size = 5, 7
    draft_token_ids, target_token_ids = drafts_against_greedy_targets(500, num_draft_tokens, vocab_size, seed=10)
    greedy = greedy_verify(draft_token_ids, target_token_ids)
    for draft_probs in (one_hot(draft_token_ids, vocab_size), None):
        output = block_verify(draft_token_ids, draft_probs, one_hot(target_token_ids, vocab_size), make_generator(11))
        assert torch.equal(output, greedy)
    assert set(num_accepted(greedy).tolist()) == set(range(num_draft_tokens + 1))


def test_a_single_draft_token_gives_token_wises_output_under_the_same_seed():
    # K = 1: h_1 = P_1 = min(1, p/q) is token-wise's test, with the same draws in the same order.
    target_tables, draft_tables = toy_models(seed=12, vocab_size=8, num_draft_tokens=1)
    inputs = draft_and_rows(target_tables, draft_tables, 4000, make_generator(13))
    assert torch.equal(block_verify(*inputs, generator=make_generator(14)),
                       rejection_sample(*inputs, generator=make_generator(14)))


# --- degenerate rows ---------------------------------------------------------------------------

def test_identical_rows_accept_every_draft_token_and_sample_the_bonus_from_the_last_row():
    batch_size = 2000
    rows = random_rows((batch_size, 4), 5, 0, make_generator(15))
    draft_token_ids = sample_from_probs(rows[:, :3], make_generator(16))
    output = block_verify(draft_token_ids, rows[:, :3], rows, make_generator(17))
    assert torch.equal(output[:, :3], draft_token_ids)
    assert (output[:, 3] >= 0).all()


def test_first_token_impossible_for_the_target_cuts_the_block_at_zero():
    # p(x_1) = 0 < q(x_1): P_1 = 0, so nothing after it counts either; the recovered token comes
    # from max(0, p - q) = [0, 0.2, 0.5, 0]: token 1 : 2 = 2 : 5, as token-wise.
    batch_size = 20_000
    draft_probs = torch.tensor([0.7, 0.3, 0.0, 0.0]).expand(batch_size, 3, 4)
    target_probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]] + [[0.25] * 4] * 3).expand(batch_size, 4, 4)
    output = block_verify(torch.zeros(batch_size, 3, dtype=torch.long), draft_probs, target_probs, make_generator(18))
    assert (output[:, 1:] == PLACEHOLDER_TOKEN_ID).all()
    assert set(output[:, 0].unique().tolist()) == {1, 2}
    assert abs((output[:, 0] == 1).float().mean().item() - 2 / 7) < 0.02


def test_draft_token_the_draft_gives_zero_mass_is_kept_when_the_target_allows_it():
    # q(x_1) = 0 < p(x_1): P_1 = 1 and the residual after it is positive, so x_1 is always kept.
    batch_size = 2000
    draft_probs = torch.tensor([0.5, 0.5, 0.0, 0.0]).expand(batch_size, 2, 4)
    target_probs = torch.tensor([[0.2, 0.2, 0.6, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]).expand(
        batch_size, 3, 4)
    output = block_verify(torch.tensor([[2, 0]]).expand(batch_size, 2), draft_probs, target_probs, make_generator(19))
    assert (output[:, 0] == 2).all() and (output[:, 1] == 3).all() and (output[:, 2] == -1).all()
    assert not torch.isnan(output.float()).any()


def test_empty_residual_falls_back_to_the_target_row():
    # The draft proposed a token neither p nor q supports: cut at 0, and max(0, p - q) is all zero.
    batch_size = 1000
    rows = torch.tensor([0.5, 0.5, 0.0, 0.0])
    output = block_verify(torch.full((batch_size, 2), 3), rows.expand(batch_size, 2, 4),
                          rows.expand(batch_size, 3, 4), make_generator(20))
    assert set(output[:, 0].unique().tolist()) == {0, 1}
    assert (output[:, 1:] == PLACEHOLDER_TOKEN_ID).all()


def test_a_long_block_of_tiny_ratios_does_not_underflow_into_nan():
    # 20 ratios of 1e-20 (P below float64's range), 12 of 1e25, then a last ratio of 1 (first half of
    # the batch: P_K ~ e^-230, so the block is cut at 0) or q = 0 < p (second half: ratio infinite,
    # P_K = 1, the whole block kept). A plain product would reach 0 * inf there.
    num_draft_tokens, vocab_size, batch_size = 33, 3, 200
    half = batch_size // 2
    target_probs = torch.zeros(batch_size, num_draft_tokens + 1, vocab_size)
    draft_probs = torch.zeros(batch_size, num_draft_tokens, vocab_size)
    target_probs[:, :20] = torch.tensor([1e-20, 0.5, 0.5 - 1e-20])
    draft_probs[:, :20] = torch.tensor([1.0, 0.0, 0.0])
    target_probs[:, 20:32] = torch.tensor([1.0, 0.0, 0.0])
    draft_probs[:, 20:32] = torch.tensor([1e-25, 0.5, 0.5 - 1e-25])
    target_probs[:, 32:] = torch.tensor([0.5, 0.5, 0.0])
    draft_probs[:half, 32] = torch.tensor([0.5, 0.5, 0.0])
    draft_probs[half:, 32] = torch.tensor([0.0, 0.0, 1.0])
    output = block_verify(torch.zeros(batch_size, num_draft_tokens, dtype=torch.long), draft_probs, target_probs,
                          make_generator(21))
    assert (num_accepted(output[:half]) == 0).all() and (output[:half, 0] != 0).all()
    assert (num_accepted(output[half:]) == num_draft_tokens).all()


def test_zero_draft_tokens_sample_from_target_row_zero_and_seeds_reproduce():
    target_probs = torch.tensor([0.1, 0.0, 0.6, 0.3]).expand(1000, 1, 4)
    output = block_verify(torch.empty(1000, 0, dtype=torch.long), None, target_probs, make_generator(22))
    assert output.shape == (1000, 1) and (output != 1).all()
    target_tables, draft_tables = toy_models(seed=23)
    inputs = draft_and_rows(target_tables, draft_tables, 256, make_generator(24))
    first, second, other = (block_verify(*inputs, generator=make_generator(seed)) for seed in (25, 25, 26))
    assert torch.equal(first, second) and not torch.equal(first, other)


def test_mismatched_shapes_raise_value_error():
    with pytest.raises(ValueError, match="draft_probs"):
        block_verify(torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 3, 4), torch.rand(2, 4, 5))


# --- wiring: accept_round ----------------------------------------------------------------------

def paper_round(verification: str, seed: int, with_draft_rows: bool = True) -> tuple[list[int], int]:
    """accept_round on the paper's rows with the draft block (a, b) = (0, 1): block verification
    keeps both (P_1 = 1/2, P_2 = min(1, 1/2 * 2) = 1 = h_2), token-wise keeps a only half the time.
    Returns (committed tokens, accepted count in the request's stats)."""
    state = RequestState(request_id=f"r{seed}", prompt_ids=[0], params=SamplingParams(seed=seed, max_tokens=8),
                         eos_token_id=None, max_context=64)
    support = draft_support(torch.tensor([[2 / 3, 1 / 3]] * 2), None) if with_draft_rows else None
    proposal = Proposal([0, 1], support)
    answer = verify_answer(torch.tensor([[1 / 3, 2 / 3]] * 3), proposal, state.verify_generator, verification)
    committed = accept_round(state, proposal, answer, verification)
    return committed, state.stats.num_accepted


def test_accept_round_verifies_a_sampled_draft_block_jointly_by_default():
    assert SpeculationSpec().verification == "block"
    outcomes = [paper_round("block", seed) for seed in range(50)]
    assert all(committed[:2] == [0, 1] and len(committed) == 3 and accepted == 2 for committed, accepted in outcomes)
    token_wise = [paper_round("token", seed)[1] for seed in range(50)]
    assert 0 < token_wise.count(2) < 50


def test_accept_round_keeps_blocks_without_draft_rows_token_wise():
    for seed in range(20):
        assert paper_round("block", seed, with_draft_rows=False) == paper_round("token", seed, with_draft_rows=False)


# --- end to end in process: the round loop with real (tiny) models, two draft tokens per round ---

def test_generate_with_block_verification_keeps_the_targets_marginals(target_model, unrelated_draft_model):
    """NUM_GENERATE_RUNS seeded 3-token requests with K = 2 (temperature 0.9, top-k 16, top-p 0.95):
    tokens 1 and 2 come from one block-verified round. Each position's distribution must match
    the target's exact marginal (chi-square at 1e-3; TV < 0.04, about twice its expectation at
    6,000 samples over <= 16 live tokens) and not the draft's."""
    prompt = PROMPTS[2]
    target = TableRunner(logit_table(target_model, prompt, depth=2))
    draft = TableRunner(logit_table(unrelated_draft_model, prompt, depth=2))
    states = seeded_requests(target, DraftModelProposer(draft), prompt, range(NUM_GENERATE_RUNS), num_draft_tokens=2)
    outputs = torch.tensor([state.output_ids for state in states])
    for position in (1, 2):
        counts = torch.bincount(outputs[:, position], minlength=VOCAB_SIZE).double()
        target_marginal = position_marginals(target, target, prompt)[position - 1]
        draft_marginal = position_marginals(draft, target, prompt)[position - 1]
        assert chi_square_p_value(counts, target_marginal) > 1e-3
        assert total_variation(counts, target_marginal) < 0.04
        assert chi_square_p_value(counts, draft_marginal) < 1e-3
