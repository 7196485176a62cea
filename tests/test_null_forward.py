"""The null forward (decoding/null_forward.py): the rule the stack's capacity bench serves.

What the bench relies on: a null target predicts one token per (token, position), never EOS; a
null draft agrees with it at the rate it is given (binomial tolerance); the engine's runner with
the option returns exactly those one-hot rows through its whole step; and speculative decoding
over a null pair is as lossless as over real models (greedy == target-only), accepting at the
draft's agreement."""

import math
from pathlib import Path

import pytest
import torch

from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.generate import generate
from specserve.decoding.model_runner import load_causal_lm
from specserve.decoding.null_forward import OFF_LOGIT, allowed_tokens, null_logits, predicted_tokens
from specserve.decoding.proposers import DraftModelProposer
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.scheduler import engine_for_model
from specserve.decoding.sequence import RequestState

DEFAULT_PAIR = Path(__file__).resolve().parents[1] / "models" / "default"
VOCAB = 8192
EOS = (0, 5)


def pairs(count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (count,), generator=generator),
            torch.randint(0, 4096, (count,), generator=generator))


def test_the_reference_is_a_function_of_token_and_position_and_never_eos():
    tokens, positions = pairs(50_000)
    allowed = allowed_tokens(VOCAB, EOS)
    reference = predicted_tokens(tokens, positions, allowed, 1.0)
    assert torch.equal(reference, predicted_tokens(tokens.clone(), positions.clone(), allowed, 1.0))
    assert not torch.isin(reference, torch.tensor(EOS)).any()
    # Spread over the vocabulary, not a handful of ids (a stream would repeat itself).
    assert reference.unique().numel() > 0.9 * VOCAB * (1 - math.exp(-50_000 / VOCAB))
    # A different position or token gives a different token almost always.
    assert (predicted_tokens(tokens, positions + 1, allowed, 1.0) != reference).float().mean() > 0.99


@pytest.mark.parametrize("agreement", [0.0, 0.3, 0.8, 1.0])
def test_a_draft_agrees_with_the_reference_at_its_rate(agreement):
    count = 40_000
    tokens, positions = pairs(count, seed=1)
    allowed = allowed_tokens(VOCAB, EOS)
    reference = predicted_tokens(tokens, positions, allowed, 1.0)
    agrees = predicted_tokens(tokens, positions, allowed, agreement) == reference
    tolerance = 4 * math.sqrt(max(agreement * (1 - agreement), 1e-12) / count)   # four binomial sigmas
    assert abs(float(agrees.float().mean()) - agreement) <= tolerance + 1e-9
    # The check can fail: the rate of a neighbouring agreement is outside it.
    if 0 < agreement < 1:
        other = predicted_tokens(tokens, positions, allowed, agreement - 0.05) == reference
        assert abs(float(other.float().mean()) - agreement) > tolerance


def test_null_logits_put_all_mass_on_the_prediction():
    tokens, positions = pairs(64)
    allowed = allowed_tokens(VOCAB, EOS)
    logits = null_logits(tokens, positions, allowed, 0.5, VOCAB)
    assert logits.shape == (64, VOCAB) and logits.dtype == torch.float32
    assert torch.equal(logits.argmax(-1), predicted_tokens(tokens, positions, allowed, 0.5))
    assert torch.equal(torch.softmax(logits, -1).max(-1).values, torch.ones(64))
    assert float(logits.min()) == OFF_LOGIT


@pytest.fixture(scope="module")
def null_engines():
    """The default pair's checkpoints with null forwards: target agreement 1, draft 0.75."""
    target = load_causal_lm(str(DEFAULT_PAIR / "target"), dtype="float32", device="cpu")
    draft = load_causal_lm(str(DEFAULT_PAIR / "draft"), dtype="float32", device="cpu")
    return (engine_for_model(target, null_forward_agreement=1.0, max_sequences=8),
            engine_for_model(draft, null_forward_agreement=0.75, max_sequences=8))


def test_the_engine_step_returns_the_rule_for_every_kept_row(null_engines):
    target, _ = null_engines
    runner = target.runner
    histories = {"a": [3, 900, 41, 7000, 12], "b": [8, 9]}
    logits = target.forward_batch([ForwardCall("a", histories["a"], 3), ForwardCall("b", histories["b"], 1)])
    allowed = allowed_tokens(runner.vocab_size, runner.eos_token_ids)
    for (seq_id, history), rows in zip(histories.items(), logits):
        positions = torch.arange(len(history) - rows.shape[0], len(history))
        expected = predicted_tokens(torch.tensor(history)[positions], positions, allowed, 1.0)
        assert torch.equal(rows.argmax(-1), expected), seq_id
    for seq_id in histories:
        target.release(seq_id)


def test_speculation_over_a_null_pair_is_the_reference_chain_at_the_drafts_agreement(null_engines):
    target, draft = null_engines
    prompt, length = [17, 250, 3001], 400
    state = RequestState(request_id="r", prompt_ids=prompt, params=SamplingParams(temperature=0, max_tokens=length),
                         eos_token_id=0, max_context=512)
    list(generate(target, state, DraftModelProposer(draft), num_draft_tokens=4))
    allowed = allowed_tokens(target.runner.vocab_size, target.runner.eos_token_ids)
    chain = list(prompt)
    for _ in range(length):
        chain.append(int(predicted_tokens(torch.tensor([chain[-1]]), torch.tensor([len(chain) - 1]), allowed, 1.0)))
    assert state.output_ids == chain[len(prompt):]
    # Per-token acceptance is 0.75; a round stops at its first rejection, so the accepted share of
    # drafted tokens is lower than that but far from 0 and 1.
    assert 0.3 < state.stats.acceptance_rate < 0.9
    assert state.stats.num_accepted / state.stats.rounds > 1.0
