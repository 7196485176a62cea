"""Proposers: n-gram prompt lookup and a draft model drafting over a ReferenceRunner.

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md)."""

import pytest
import torch
from transformers import LlamaForCausalLM

from specserve.decoding.scheduler import engine_for_model
from tests.reference_runner import ReferenceRunner
from specserve.decoding.proposers import DraftModelProposer, NgramProposer, ProposeCall
from specserve.decoding.sampling import SamplingParams, logits_to_probs, make_generator, sample_from_probs
from tests.tiny_pair import tiny_llama

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=0.8, top_k=40)


def last_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1].float()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


# --- n-gram ---------------------------------------------------------------------------------

def test_ngram_continues_the_longest_matching_suffix():
    # Suffix [1, 2, 3] occurred at the start (followed by 4, 5); the 1-gram [3] recurs later,
    # followed by 6, but the longer match wins.
    history = [1, 2, 3, 4, 5, 9, 3, 6, 1, 2, 3]
    proposal = NgramProposer(max_ngram=4).propose("s", history, 3, GREEDY)
    assert proposal.token_ids == [4, 5, 9]
    assert proposal.support is None


def test_ngram_uses_the_most_recent_earlier_occurrence():
    history = [7, 1, 5, 7, 1, 6, 7, 1]
    assert NgramProposer().propose("s", history, 2, GREEDY).token_ids == [6, 7]


def test_ngram_returns_nothing_without_a_match():
    assert NgramProposer().propose("s", [1, 2, 3, 4, 5], 4, GREEDY).token_ids == []


def test_ngram_ignores_matches_shorter_than_min_ngram():
    history = [1, 9, 8, 2, 9]   # only the 1-gram [9] recurs
    assert NgramProposer(min_ngram=1).propose("s", history, 2, GREEDY).token_ids == [8, 2]
    assert NgramProposer(min_ngram=2).propose("s", history, 2, GREEDY).token_ids == []


def test_ngram_respects_num_tokens():
    history = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    proposer = NgramProposer()
    assert proposer.propose("s", history, 3, GREEDY).token_ids == [3, 4, 5]
    assert proposer.propose("s", history, 1, GREEDY).token_ids == [3]
    assert proposer.propose("s", history, 0, GREEDY).token_ids == []
    # Fewer tokens than asked when the match sits near the end of the history.
    assert proposer.propose("s", [4, 4, 4], 5, GREEDY).token_ids == [4]


# --- draft model ------------------------------------------------------------------------------

def test_greedy_draft_is_the_argmax_chain_of_its_model(model):
    history = [3, 14, 15, 92, 65, 35]
    proposal = DraftModelProposer(ReferenceRunner.from_model(model)).propose("s", history, 5, GREEDY)
    expected, ids = [], list(history)
    for _ in range(5):
        token = int(torch.argmax(last_logits(model, ids)))
        expected.append(token)
        ids.append(token)
    assert proposal.token_ids == expected
    assert proposal.support is None


def test_sampled_draft_returns_normalised_q_rows_for_its_tokens(model):
    history = [3, 14, 15, 92, 65, 35]
    proposal = DraftModelProposer(ReferenceRunner.from_model(model)).propose(
        "s", history, 4, SAMPLED, make_generator(123))
    q = proposal.support.dense(96)
    assert q.shape == (4, 96) and q.dtype == torch.float32
    torch.testing.assert_close(q.sum(dim=-1), torch.ones(4), atol=1e-5, rtol=0)
    assert all(q[i, token] > 0 for i, token in enumerate(proposal.token_ids))


def test_a_capped_draft_samples_from_its_rows_top_candidates_renormalised(model):
    history = [3, 14, 15, 92, 65, 35]
    proposal = DraftModelProposer(ReferenceRunner.from_model(model), max_candidates=5).propose(
        "s", history, 4, SAMPLED, make_generator(123))
    assert tuple(proposal.support.ids.shape) == (4, 5)
    torch.testing.assert_close(proposal.support.probs.sum(dim=-1), torch.ones(4), atol=1e-5, rtol=0)
    assert all(token in proposal.support.ids[i].tolist() for i, token in enumerate(proposal.token_ids))
    first = logits_to_probs(last_logits(model, history), SAMPLED)
    top = torch.topk(first, 5)
    renormalised = torch.zeros_like(first).scatter_(-1, top.indices, top.values / top.values.sum())
    torch.testing.assert_close(proposal.support.rows(0, 1).dense(first.shape[-1])[0], renormalised, atol=1e-5, rtol=0)


def test_sampled_draft_follows_the_generator_seed(model):
    history = [3, 14, 15, 92, 65, 35]
    proposer = DraftModelProposer(ReferenceRunner.from_model(model))
    first = proposer.propose("a", history, 6, SAMPLED, make_generator(7))
    again = proposer.propose("b", history, 6, SAMPLED, make_generator(7))
    # The same draws as sampling the chain by hand with the same seed.
    generator, ids, expected, rows = make_generator(7), list(history), [], []
    for _ in range(6):
        q = logits_to_probs(last_logits(model, ids), SAMPLED)
        token = int(sample_from_probs(q, generator))
        expected.append(token)
        rows.append(q)
        ids.append(token)
    assert first.token_ids == again.token_ids == expected
    torch.testing.assert_close(first.support.dense(96), torch.stack(rows), atol=1e-5, rtol=0)


def test_draft_keeps_its_cache_between_rounds_and_releases_it(model):
    runner = ReferenceRunner.from_model(model)
    proposer = DraftModelProposer(runner)
    history = [3, 14, 15, 92, 65, 35]
    proposal = proposer.propose("s", history, 4, GREEDY)
    # The last drafted token is never fed to the draft.
    assert runner.num_cached("s") == len(history) + 3
    accepted_and_bonus = proposal.token_ids[:2] + [11]
    proposer.propose("s", history + accepted_and_bonus, 4, GREEDY)
    assert runner.num_cached("s") == len(history) + len(accepted_and_bonus) + 3
    proposer.release("s")
    proposer.release("s")
    assert runner.active_sequences() == []


def test_draft_proposes_fewer_tokens_near_the_end_of_its_context():
    proposer = DraftModelProposer(ReferenceRunner.from_model(tiny_llama(max_position_embeddings=16)))
    assert len(proposer.propose("s", list(range(2, 15)), 8, GREEDY).token_ids) == 4
    assert proposer.propose("s", list(range(2, 20)), 8, GREEDY).token_ids == []


# --- batched drafting -------------------------------------------------------------------------

def ragged_propose_calls(params: SamplingParams, seed: int = 0) -> list[ProposeCall]:
    """Different history lengths and K, one K=0 and one history at the draft's context limit."""
    histories = [[3, 14, 15, 92, 65, 35], list(range(2, 40)), [7], [5 + i % 80 for i in range(120)], [9, 9, 8]]
    budgets = [4, 2, 5, 8, 0]   # the fourth may draft only 128 - 120 + 1 = 9 > 8 tokens; the last none
    return [ProposeCall(f"s{i}", history, budget, params, make_generator(seed + i))
            for i, (history, budget) in enumerate(zip(histories, budgets))]


@pytest.mark.parametrize("make_engine", [engine_for_model, ReferenceRunner.from_model])
def test_greedy_propose_batch_equals_propose_call_by_call(model, make_engine):
    calls = ragged_propose_calls(GREEDY)
    batched = DraftModelProposer(make_engine(model)).propose_batch(calls)
    alone = DraftModelProposer(ReferenceRunner.from_model(model))
    for call, proposal in zip(calls, batched):
        expected = alone.propose(call.seq_id, call.history, call.num_tokens, GREEDY)
        assert proposal.token_ids == expected.token_ids
        assert len(proposal.token_ids) == call.num_tokens and proposal.support is None


def test_propose_batch_continues_each_cache_and_rows_drop_out_when_done(model):
    engine = engine_for_model(model)
    proposer = DraftModelProposer(engine)
    calls = ragged_propose_calls(GREEDY)
    forwarded: list[int] = []
    hook = engine.runner.model.get_input_embeddings().register_forward_hook(
        lambda module, args, output: forwarded.append(args[0].shape[0]))
    proposals = proposer.propose_batch(calls)
    hook.remove()
    # max K = 8 steps; a row leaves once it has its K tokens (K = 4, 2, 5, 8; K=0 never enters).
    assert forwarded == [4, 4, 3, 3, 2, 1, 1, 1]
    for call, proposal in zip(calls, proposals):
        # The last drafted token is never fed.
        expected_cached = len(call.history) + len(proposal.token_ids) - 1 if proposal.token_ids else 0
        assert engine.blocks.num_cached(call.seq_id) == expected_cached
    # Next round: histories that accepted a prefix plus a bonus token reuse the cache.
    follow = [ProposeCall(call.seq_id, list(call.history) + proposal.token_ids[:1] + [11], 3, GREEDY)
              for call, proposal in zip(calls[:2], proposals[:2])]
    alone = DraftModelProposer(ReferenceRunner.from_model(model))
    for call, proposal in zip(follow, proposer.propose_batch(follow)):
        assert proposal.token_ids == alone.propose(call.seq_id, call.history, 3, GREEDY).token_ids


def test_a_seeded_sampled_draft_does_not_depend_on_what_shares_its_batch(model):
    mine = ProposeCall("mine", [3, 14, 15, 92, 65, 35], 6, SAMPLED, make_generator(7))
    alone = DraftModelProposer(engine_for_model(model)).propose_batch([mine])[0]
    others = [ProposeCall("greedy", list(range(2, 50)), 3, GREEDY),
              ProposeCall("sampled", [8, 8, 8, 8], 6, SAMPLED, make_generator(7)),
              ProposeCall("short", [40, 41], 1, SAMPLED, make_generator(99))]
    mine_again = ProposeCall("mine", mine.history, 6, SAMPLED, make_generator(7))
    shared = DraftModelProposer(engine_for_model(model)).propose_batch(others[:2] + [mine_again]
                                                                                    + others[2:])[2]
    assert shared.token_ids == alone.token_ids
    torch.testing.assert_close(shared.support.probs, alone.support.probs, atol=1e-5, rtol=0)
    # And both equal the single-call path over the per-sequence runner.
    single = DraftModelProposer(ReferenceRunner.from_model(model)).propose(
        "mine", mine.history, 6, SAMPLED, make_generator(7))
    assert single.token_ids == alone.token_ids


def test_ngram_propose_batch_is_propose_per_call():
    calls = [ProposeCall("a", [1, 2, 3, 4, 5, 9, 3, 6, 1, 2, 3], 3, GREEDY), ProposeCall("b", [1, 2, 3], 2, GREEDY)]
    proposer = NgramProposer()
    assert [p.token_ids for p in proposer.propose_batch(calls)] == [[4, 5, 9], []]
