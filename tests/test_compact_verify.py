"""Verification on O(K) numbers (decoding/compact_verify.py): the draft samples from a truncated
support, the target computes p(x_i), residual draws and masses, the owner decides.

The joint test is tests/test_block_verify.py's: prefix-dependent toy target and draft models over
a small vocabulary, 200k seeded rounds, each output continued with the target to K+1 tokens; the
emitted sequences' distribution over all V^(K+1) sequences must be the target's (chi-square with
small cells pooled does not reject at 1e-3, total variation below 0.01 at 400k rounds). The draft keeps
MAX_CANDIDATES of its V tokens, so its truncated q differs from its processed row; a verifier
handed the untruncated row instead of the q the draft sampled from is rejected by the same test.
"""

import numpy as np
import pytest
import torch

from specserve.decoding import compact_verify
from specserve.decoding.compact_verify import (TAIL_SHARE, DraftSupport, TargetNumbers, compact_block_verify,
                                               compact_rejection_sample, draft_support, ragged_target_numbers,
                                               sample_from_support, target_numbers)
from specserve.decoding.rejection import _block_weights, stop_probabilities_from_mass
from specserve.decoding.sampling import make_generator, sample_from_probs
from tests.test_block_verify import P_VALUE_THRESHOLD, continued_with_target, joint_fit, toy_models
from tests.test_rejection import rows_given_prefix

MAX_CANDIDATES = 2  # of the toy vocabulary's 4 tokens (3 supported per draft row)
NUM_SAMPLES = 400_000  # over 256 cells: sampling noise in total variation ~0.006
TV_TOLERANCE = 0.01
VERIFIERS = {"token": compact_rejection_sample, "block": compact_block_verify}


def compact_sequences(target_tables, draft_tables, verification: str, seed: int, use_untruncated_q: bool = False,
                      batch_size: int = NUM_SAMPLES) -> torch.Tensor:
    """One compact round per sample (draft, target and owner each with its own generator), the
    output continued with the target to K+1 tokens [B, K+1]."""
    draft_generator, target_generator, owner_generator = (make_generator(seed + i) for i in range(3))
    prefix, supports, rows = [], [], []
    for table in draft_tables:
        rows.append(rows_given_prefix(table, prefix, batch_size))
        supports.append(draft_support(rows[-1], MAX_CANDIDATES))
        pick = sample_from_probs(supports[-1].probs, draft_generator)
        prefix.append(supports[-1].ids.gather(-1, pick.unsqueeze(-1)).squeeze(-1))
    draft_ids = torch.stack(prefix, dim=1)
    support = DraftSupport(torch.stack([s.ids for s in supports], 1), torch.stack([s.probs for s in supports], 1))
    if use_untruncated_q:  # broken: the processed rows, not the q the draft sampled from
        full = torch.stack(rows, dim=1)
        support = DraftSupport(torch.arange(full.shape[-1]).expand_as(full), full)
    target_probs = torch.stack(
        [rows_given_prefix(table, prefix[:i], batch_size) for i, table in enumerate(target_tables)], dim=1)
    numbers = target_numbers(draft_ids, support, target_probs, target_generator, block=verification == "block")
    sequences = VERIFIERS[verification](draft_ids, support.probs_of(draft_ids), numbers, owner_generator)
    return continued_with_target(torch.from_numpy(sequences), target_tables, owner_generator)


@pytest.mark.parametrize("verification", ["token", "block"])
def test_emitted_sequences_from_a_truncated_draft_follow_the_targets_joint_distribution(verification):
    target_tables, draft_tables = toy_models(seed=1)
    pvalue, tv = joint_fit(compact_sequences(target_tables, draft_tables, verification, seed=2), target_tables)
    assert pvalue > P_VALUE_THRESHOLD, f"chi-square rejects the target's joint distribution (p-value {pvalue:.2e})"
    assert tv < TV_TOLERANCE, f"total variation {tv:.4f} >= {TV_TOLERANCE}"


@pytest.mark.parametrize("verification", ["token", "block"])
def test_the_joint_test_rejects_verifying_against_another_q_than_the_one_sampled_from(verification):
    target_tables, draft_tables = toy_models(seed=1)
    sequences = compact_sequences(target_tables, draft_tables, verification, seed=2, use_untruncated_q=True)
    pvalue, _ = joint_fit(sequences, target_tables)
    assert pvalue < P_VALUE_THRESHOLD, f"the joint test cannot tell the wrong q (p-value {pvalue:.2e})"


def test_a_support_wider_than_the_row_keeps_the_processed_distribution_exactly():
    row = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]])  # e.g. top-k 3 already applied
    support = draft_support(row, max_candidates=4)
    torch.testing.assert_close(support.dense(6), row)
    assert support.probs_of(torch.tensor([3])).item() == pytest.approx(0.3)
    assert support.probs_of(torch.tensor([0])).item() == 0.0
    narrower = draft_support(row, max_candidates=2)
    torch.testing.assert_close(narrower.dense(6), torch.tensor([[0.0, 0.625, 0.0, 0.375, 0.0, 0.0]]))



def test_a_cut_support_is_as_wide_as_its_widest_kept_row_and_blocks_of_such_rows_stack():
    rows = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0],    # three kept (a top-p cut)
                         [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])   # one kept
    cut = draft_support(rows, max_candidates=5, cut=True)
    assert cut.width == 3
    torch.testing.assert_close(cut.dense(6), rows)
    assert draft_support(rows, max_candidates=5).width == 3               # not told: its likely tokens, as wide
    assert draft_support(rows, max_candidates=2, cut=True).width == 2     # never wider than max_candidates
    uncut = torch.tensor([[0.1, 0.2, 0.3, 0.1, 0.2, 0.1]])
    assert draft_support(uncut, max_candidates=None, cut=True).width == 6  # a whole row stays whole
    # A block's steps may keep different counts: stacked, the narrower pads with probability 0.
    alone = draft_support(rows[1:], max_candidates=5, cut=True)
    assert alone.width == 1
    block = DraftSupport.stack([DraftSupport(cut.ids[0], cut.probs[0]), DraftSupport(alone.ids[0], alone.probs[0])])
    assert block.width == 3
    torch.testing.assert_close(block.dense(6), rows)
    assert block.probs_of(torch.tensor([3, 2])).tolist() == pytest.approx([0.3, 1.0])
    assert block.probs_of(torch.tensor([0, 0])).tolist() == [0.0, 0.0]

def test_a_support_leaves_out_the_tail_below_its_share_of_the_likeliest_and_keeps_the_likeliest():
    """The support: at most max_candidates tokens, the likeliest, none at or below TAIL_SHARE of
    the row's likeliest token's probability; found from the likely tokens, with a top-k over them
    where there are more than max_candidates, or by one top-k over the row where there are far
    more. Against the definition, on rows of all three kinds."""
    generator = torch.Generator().manual_seed(0)
    vocab_size, max_candidates = 4096, 64
    peaked = torch.softmax(torch.randn(3, vocab_size, generator=generator) * 14, -1)    # fewer likely than 64
    wide = torch.softmax(torch.randn(3, vocab_size, generator=generator) * 8, -1)       # more, under 4 * 64
    flat = torch.full((1, vocab_size), 1.0 / vocab_size)                                 # all of it likely
    for rows in (peaked, wide, flat, torch.cat([peaked, wide]), torch.cat([peaked, flat])):
        support = draft_support(rows, max_candidates)
        for row, ids, probs in zip(rows, support.ids, support.probs):
            likely = set((row > row.max() * TAIL_SHARE).nonzero().squeeze(-1).tolist())
            kept = ids[probs > 0]
            left = torch.tensor(sorted(likely - set(kept.tolist())), dtype=torch.long)
            assert set(kept.tolist()) <= likely and len(set(kept.tolist())) == min(max_candidates, len(likely))
            assert not left.numel() or row[kept].min() >= row[left].max()   # the likeliest (ties either way)
            torch.testing.assert_close(probs[probs > 0], row[kept] / row[kept].sum())
        assert support.width <= max_candidates

    def likely_counts(rows):
        return (rows > rows.max(-1, keepdim=True).values * TAIL_SHARE).sum(-1)

    # each path taken: the likely tokens gathered, then also a top-k over them, then one over the row
    assert likely_counts(peaked).max() < max_candidates < (peaked > 0).sum(-1).min()   # a tail left out
    assert max_candidates < likely_counts(wide).max() <= 4 * max_candidates
    assert likely_counts(flat).min() > 4 * max_candidates


@pytest.mark.parametrize("cut", [False, True])
def test_an_accelerators_support_is_the_same_distribution_without_reading_counts_back(cut):
    """On an accelerator the support is a top-k over the row with the tail at probability 0 (no
    host read of counts for an uncut row): the same distribution as the CPU's gathered support."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.softmax(torch.randn(4, 4096, generator=generator) * torch.tensor([[14.0], [8.0], [3.0], [0.0]]), -1)
    if cut:   # top-k 40 (the flat row keeps its ties: all of it)
        rows = rows * (rows >= rows.topk(40, dim=-1).values[:, -1:])
        rows = rows / rows.sum(-1, keepdim=True)
    on_cpu = draft_support(rows, 64, cut)
    floor = 0.0 if cut else rows.amax(dim=-1, keepdim=True) * TAIL_SHARE
    values, ids = compact_verify._top_entries_above(rows, floor, 64, cut)
    torch.testing.assert_close(DraftSupport(ids, values / values.sum(-1, keepdim=True)).dense(4096), on_cpu.dense(4096),
                               rtol=1e-4, atol=1e-7)   # the same entries, summed in another order
    assert ids.shape[-1] == (min(64, int((rows > 0).sum(-1).max())) if cut else 64)


@pytest.mark.parametrize("verification", ["token", "block"])
def test_identical_rows_accept_every_draft_token_and_emit_the_bonus(verification):
    rows = torch.tensor([[[0.2, 0.8, 0.0], [0.5, 0.0, 0.5], [0.1, 0.1, 0.8]]])
    draft_ids = torch.tensor([[1, 2]])
    support = draft_support(rows[:, :2], 3)
    numbers = target_numbers(draft_ids, support, rows, make_generator(0), block=verification == "block")
    output = VERIFIERS[verification](draft_ids, support.probs_of(draft_ids), numbers, make_generator(1))
    assert output[0, :2].tolist() == [1, 2] and output[0, 2].item() == numbers.bonus.item()


def test_zero_draft_tokens_emit_one_token_from_target_row_zero():
    rows = torch.tensor([[[0.0, 1.0, 0.0]]]).expand(5, 1, 3)
    numbers = target_numbers(torch.zeros(5, 0, dtype=torch.long), None, rows, make_generator(0))
    output = compact_rejection_sample(torch.zeros(5, 0, dtype=torch.long), torch.zeros(5, 0), numbers)
    assert output.tolist() == [[1]] * 5


def test_the_hosts_block_weights_and_stop_probabilities_are_the_dense_verifiers():
    """The owner's verifiers run on host arrays; their P_i and h_i are decoding.rejection's, on
    ratios of every kind (p = 0, q = 0 < p, both, finite)."""
    generator = torch.Generator().manual_seed(5)
    log_ratio = torch.randn(64, 6, generator=generator, dtype=torch.float64) * 3
    kinds = torch.randint(0, 8, (64, 6), generator=generator)
    log_ratio = torch.where(kinds == 0, float("-inf"), torch.where(kinds == 1, float("inf"), log_ratio))
    weights = compact_verify.host_block_weights(log_ratio.numpy())
    np.testing.assert_allclose(weights, _block_weights(log_ratio).numpy(), rtol=1e-13, atol=0)
    mass = torch.rand(64, 5, generator=generator, dtype=torch.float64) * (torch.rand(64, 5, generator=generator) > 0.2)
    np.testing.assert_allclose(compact_verify.host_stop_probabilities(weights, mass.numpy()),
                               stop_probabilities_from_mass(torch.from_numpy(weights), mass).numpy(), rtol=1e-13, atol=0)
    draft_of_draft = torch.rand(64, 6, generator=generator, dtype=torch.float64) * (kinds != 2)
    target_of_draft = torch.rand(64, 6, generator=generator, dtype=torch.float64) * (kinds != 3)
    np.testing.assert_array_equal(compact_verify.host_log_ratios(target_of_draft.numpy(), draft_of_draft.numpy()),
                                  compact_verify.log_ratios(target_of_draft, draft_of_draft).numpy())


@pytest.mark.parametrize("verification", ["token", "block"])
def test_a_verify_answer_off_the_wire_verifies_as_in_process(verification):
    """The router's case: one request's numbers as lists, its q off the wire (numpy, whole rows
    without their ids, or a truncated support), the same output as the tensors in process."""
    generator = torch.Generator().manual_seed(6)
    for max_candidates in (None, 3):
        rows = torch.softmax(torch.randn(1, 4, 7, generator=generator), -1)
        support = draft_support(rows[:, :3], max_candidates)
        draft_ids = sample_from_support(support, generator)
        numbers = target_numbers(draft_ids, support, rows, make_generator(0), block=verification == "block")
        in_process = VERIFIERS[verification](draft_ids, support.probs_of(draft_ids), numbers, make_generator(1))
        wired = DraftSupport(support.ids[0], support.probs[0]).wire()
        listed = TargetNumbers(numbers.target_of_draft[0].tolist(), numbers.residual_mass[0].tolist(),
                               numbers.recovered[0].tolist(), int(numbers.bonus[0]))
        off_wire = VERIFIERS[verification](draft_ids[0].numpy(), wired.probs_of(draft_ids[0].numpy()), listed,
                                           make_generator(1))
        np.testing.assert_array_equal(off_wire, in_process)
        np.testing.assert_array_equal(wired.probs_of(draft_ids[0].numpy()), support.probs_of(draft_ids)[0].numpy())


def test_the_same_seeds_give_the_same_output():
    target_tables, draft_tables = toy_models(seed=3)
    first = compact_sequences(target_tables, draft_tables, "block", seed=4, batch_size=1000)
    again = compact_sequences(target_tables, draft_tables, "block", seed=4, batch_size=1000)
    assert torch.equal(first, again)


def ragged_blocks(seed: int, vocab_size: int = 7):
    """Requests with K = 0..3 draft tokens, a truncated support or none (a deterministic proposer),
    block or token-wise verification, each with its own rows and seeded stream."""
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    for i, (count, with_support, block) in enumerate([(3, True, True), (0, True, True), (2, False, False),
                                                       (1, True, False), (3, False, True), (2, True, True)]):
        rows = torch.softmax(torch.randn(count + 1, vocab_size, generator=generator) * 2, -1)
        q = torch.softmax(torch.randn(count, vocab_size, generator=generator) * 2, -1)
        support = draft_support(q, 4) if with_support else None
        if support is not None and count:
            ids = support.ids.gather(-1, sample_from_probs(support.probs, generator).view(-1, 1)).view(-1).tolist()
        else:
            ids = torch.randint(vocab_size, (count,), generator=generator).tolist()
        blocks.append((rows, ids, support, block, 100 + i))
    return blocks


def test_a_ragged_batch_answers_each_request_as_it_would_alone_under_its_own_seed():
    blocks = ragged_blocks(seed=5)
    numbers = ragged_target_numbers(torch.cat([rows for rows, *_ in blocks]), [ids for _, ids, *_ in blocks],
                                    [support for _, _, support, *_ in blocks],
                                    [make_generator(seed) for *_, seed in blocks], [block for *_, block, _ in blocks])
    draft_start = token_start = 0
    for rows, ids, support, block, seed in blocks:
        alone = target_numbers(torch.tensor([ids], dtype=torch.long).view(1, -1),
                               None if support is None else DraftSupport(support.ids[None], support.probs[None]),
                               rows[None], make_generator(seed), block=block)
        count = len(ids)
        assert torch.equal(numbers.target_of_draft[draft_start:draft_start + count], alone.target_of_draft[0])
        assert torch.equal(numbers.residual_mass[draft_start:draft_start + count], alone.residual_mass[0])
        assert numbers.tokens[token_start:token_start + count + 1].tolist() == [*alone.recovered[0].tolist(),
                                                                                  alone.bonus.item()]
        draft_start += count
        token_start += count + 1


@pytest.mark.parametrize("block", [False, True])
def test_a_position_whose_q_is_p_draws_its_recovered_token_from_p_in_a_ragged_batch_as_alone(block):
    """Where the draft's q equals the target's p the residual max(p - q, 0) has no mass, and the
    recovered token (never emitted: every token there is accepted) is drawn from p itself so the
    stream's draws stay in step; a ragged batch mixing such a request with others answers it bit
    for bit as it answers alone."""
    generator = torch.Generator().manual_seed(11)
    same = torch.softmax(torch.randn(3, 7, generator=generator) * 2, -1)
    blocks = [(same, [1, 4], draft_support(same[:2], None), block, 21), *ragged_blocks(seed=5)[:3]]
    numbers = ragged_target_numbers(torch.cat([rows for rows, *_ in blocks]), [ids for _, ids, *_ in blocks],
                                    [support for _, _, support, *_ in blocks],
                                    [make_generator(seed) for *_, seed in blocks], [b for *_, b, _ in blocks])
    alone = target_numbers(torch.tensor([[1, 4]]), DraftSupport(blocks[0][2].ids[None], blocks[0][2].probs[None]),
                           same[None], make_generator(21), block=block)
    assert numbers.residual_mass[:2].tolist() == [0.0, 0.0] == alone.residual_mass[0].tolist()
    assert numbers.tokens[:3].tolist() == [*alone.recovered[0].tolist(), alone.bonus.item()]
    assert all(same[i, token] > 0 for i, token in enumerate(numbers.tokens[:2].tolist()))


def test_whole_rows_travel_without_their_ids_and_answer_as_they_do_in_process():
    """A draft row that nothing cut is the whole vocabulary in id order: the wire drops those ids
    (half its bytes) and the receiver restores them; a cut row keeps its own. A ragged batch of
    wire supports answers bit for bit what the in-process supports do."""
    blocks = ragged_blocks(seed=7)
    whole = torch.softmax(torch.randn(2, 7, generator=torch.Generator().manual_seed(1)), -1)
    blocks.append((torch.softmax(torch.randn(3, 7), -1), [4, 1], draft_support(whole, None), True, 200))
    wired = [None if support is None else support.wire() for _, _, support, *_ in blocks]
    assert wired[-1].ids.shape == (2, 0) and wired[-1].width == 7
    assert wired[0].ids.shape == (3, 4) and wired[0].width == 4
    restored = wired[-1].tensors()
    assert torch.equal(restored.ids, blocks[-1][2].ids) and torch.equal(restored.probs, whole)

    def answers(supports):
        return ragged_target_numbers(torch.cat([rows for rows, *_ in blocks]), [ids for _, ids, *_ in blocks],
                                     supports, [make_generator(seed) for *_, seed in blocks],
                                     [block for *_, block, _ in blocks])

    in_process, off_the_wire = answers([support for _, _, support, *_ in blocks]), answers(wired)
    for field in ("target_of_draft", "residual_mass", "tokens"):
        assert torch.equal(getattr(in_process, field), getattr(off_the_wire, field)), field


def test_the_ragged_check_rejects_requests_sharing_one_stream():
    """The test above must fail when the requests' draws come from one shared generator."""
    blocks = ragged_blocks(seed=5)
    shared = make_generator(0)
    numbers = ragged_target_numbers(torch.cat([rows for rows, *_ in blocks]), [ids for _, ids, *_ in blocks],
                                    [support for _, _, support, *_ in blocks], [shared] * len(blocks),
                                    [block for *_, block, _ in blocks])
    alone = [target_numbers(torch.tensor([ids], dtype=torch.long).view(1, -1),
                            None if support is None else DraftSupport(support.ids[None], support.probs[None]),
                            rows[None], make_generator(seed), block=block)
             for rows, ids, support, block, seed in blocks]
    expected = [token for a in alone for token in (*a.recovered[0].tolist(), a.bonus.item())]
    assert numbers.tokens.tolist() != expected
