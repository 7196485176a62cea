"""decoding.speculation: the target rows a verify call returns (target_rows: EOS masked below
min_tokens) and the greedy acceptance on plain lists."""

from __future__ import annotations

import pytest
import torch

from specserve.decoding.sampling import SamplingParams
from specserve.decoding.rejection import PLACEHOLDER_TOKEN_ID, greedy_verify
from specserve.decoding.row_processors import RowBatch
from specserve.decoding.speculation import greedy_emitted, joined_rows, target_rows

def test_target_rows_mask_eos_for_output_positions_below_min_tokens():
    eos = 2
    logits = torch.zeros(4, 5)
    logits[:, eos] = 10.0                         # EOS is every row's argmax
    before = logits.clone()
    params = SamplingParams(temperature=0, min_tokens=5, max_tokens=10)
    # Rows score output positions 3, 4, 5, 6: only 3 and 4 are below min_tokens.
    ids = target_rows(logits, params, eos_token_id=eos, first_output_index=3)
    assert ids[:2].tolist() != [eos, eos] and ids[2:].tolist() == [eos, eos]
    probs = target_rows(logits, params.model_copy(update={"temperature": 1.0}), eos, 3)
    assert probs[:2, eos].tolist() == [0.0, 0.0] and (probs[2:, eos] > 0.9).all()
    assert torch.equal(logits, before)             # the caller's logits are untouched
    # The two-argument call and min_tokens 0 leave EOS alone.
    assert target_rows(logits, params).tolist() == [eos] * 4
    assert target_rows(logits, SamplingParams(temperature=0), eos, 0).tolist() == [eos] * 4


def test_token_logprobs_read_each_committed_token_from_its_own_row():
    from specserve.decoding.speculation import token_logprobs

    rows = torch.log_softmax(torch.tensor([[3.0, 1.0, 0.0, -1.0], [0.0, 2.0, 1.0, 0.5], [1.0, 1.0, 4.0, 0.0]]), dim=-1)
    entries = token_logprobs([0, 2], rows.numpy(), num_alternatives=2)
    assert [e["token_id"] for e in entries] == [0, 2]
    assert entries[0]["logprob"] == pytest.approx(float(rows[0, 0]))
    assert entries[1]["logprob"] == pytest.approx(float(rows[1, 2]))   # row 1, not the token's best row
    assert [i for i, _ in entries[1]["top"]] == [1, 2]
    assert token_logprobs([3], rows, 0)[0]["top"] == []


def test_a_verify_carries_the_entries_of_the_tokens_each_row_may_commit_not_its_rows():
    """O(K x N) logprobs: per row the top N and the log-probabilities of the drafted token and of
    the target's own (argmax, recovered or bonus): whatever the owner commits is among them."""
    from specserve.decoding.compact_verify import TargetNumbers
    from specserve.decoding.proposers import Proposal
    from specserve.decoding.speculation import LogprobEntries, token_logprobs, tokens_each_row_may_commit

    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0], [0.0, 2.0, 1.0, 0.5], [1.0, 1.0, 4.0, 0.0]])
    dense = torch.log_softmax(logits, dim=-1)
    proposal = Proposal([0, 3], None)
    greedy = tokens_each_row_may_commit(proposal, [0, 1, 2])          # d1 kept, d2 rejected for 1, bonus 2
    assert greedy == [[0, 0], [3, 1], [2]]
    sampled = tokens_each_row_may_commit(proposal, TargetNumbers([0.5, 0.1], [0.0, 0.2], [2, 1], 3))
    assert sampled == [[0, 2], [3, 1], [3]]
    entries = LogprobEntries.of(logits, 2, greedy)
    for committed in ([0, 1], [0, 3, 2]):
        assert entries.entries(committed) == token_logprobs(committed, dense, 2)
    assert LogprobEntries.of(logits, 0, greedy).entries([0])[0]["top"] == []
    with pytest.raises(KeyError):   # a token no row may commit has no entry: a protocol error, not a guess
        entries.entries([1])


def test_greedy_on_plain_lists_emits_what_greedy_verify_emits():
    generator = torch.Generator().manual_seed(3)
    for _ in range(500):
        num_draft = int(torch.randint(0, 6, (1,), generator=generator))
        draft = torch.randint(0, 3, (1, num_draft), generator=generator)  # 3 ids: matches are common
        target = torch.randint(0, 3, (1, num_draft + 1), generator=generator)
        expected = [t for t in greedy_verify(draft, target)[0].tolist() if t != PLACEHOLDER_TOKEN_ID]
        assert greedy_emitted(draft[0].tolist(), target[0].tolist()) == expected


def test_target_rows_mask_every_eos_id_and_stop_token_id_below_min_tokens():
    logits = torch.zeros(2, 6)
    logits[:, [1, 2, 4]] = torch.tensor([12.0, 11.0, 10.0])     # EOS set {1, 2}, then stop id 4
    params = SamplingParams(temperature=0, min_tokens=1, max_tokens=5, stop_token_ids=[4])
    ids = target_rows(logits, params, eos_token_id=frozenset({1, 2}), first_output_index=0)
    assert ids.tolist() == [0, 1]                  # row 0 masks 1, 2 and 4; row 1 is past min_tokens
    # With ignore_eos an EOS id is an ordinary token, so min_tokens leaves it alone (as vLLM): the stop id goes.
    ignoring = params.model_copy(update={"ignore_eos": True})
    assert target_rows(logits, ignoring, eos_token_id=frozenset({1, 2}), first_output_index=0).tolist() == [1, 1]


def test_a_forwards_split_rows_are_joined_as_a_view_and_any_other_rows_as_a_copy():
    logits = torch.randn(9, 13)[:, :11]   # served columns of a padded vocabulary
    split = list(logits.split([2, 0, 5, 2]))
    joined = joined_rows(split)
    assert torch.equal(joined, logits) and joined.data_ptr() == logits.data_ptr()
    for rows in ([split[0], split[3]],                          # a gap: call 2's rows left out
                 [split[2], split[0]],                          # out of order
                 [torch.randn(2, 11), torch.randn(3, 11)],      # separate tensors
                 [split[0], split[2][-1:]]):                    # a call's last row only
        joined = joined_rows(rows)
        assert torch.equal(joined, torch.cat(rows)) and joined.data_ptr() != rows[0].data_ptr()


def test_rows_with_nothing_to_process_are_not_copied_and_processed_rows_leave_the_input_alone():
    logits = torch.randn(3, 7)
    assert RowBatch().apply(logits) is logits
    batch, before = RowBatch(), logits.clone()
    batch.forbid_stops(0, 2, [4])
    processed = batch.apply(logits)
    assert torch.equal(logits, before) and processed[:2, 4].eq(float("-inf")).all()
