"""The lean decoder forward computes what transformers' forward computes over the same KV cache:
ragged batches, rollbacks and released slots, on tiny random Llama, Qwen2 and Mistral with GQA,
biases, untied embeddings and scaled rope; architectures it does not know run transformers'.

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md)."""

import pytest
import torch

from specserve.decoding.batched_runner import BatchedModelRunner, load_runner, runner_for_model
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.scheduler import Scheduler
from specserve.decoding.lean_forward import LeanDecoder, lean_support
from specserve.decoding.model_runner import load_causal_lm
from tests.test_batched_runner import ATOL, ragged_rounds, random_ids
from tests.tiny_pair import tiny_model

SHIPPED_TARGET = "models/default/target"

VARIANTS = [
    ("llama", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    # rescaled by the sequence's length at run time: no rotary table, the module runs every forward
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    ("qwen2", {}),   # q/k/v biases
    ("mistral", {}),
]


def engine_pair(model) -> tuple[Scheduler, Scheduler]:
    """Engines over the same model: one runs the lean forward, the other transformers'."""
    lean, reference = (BatchedModelRunner.__new__(BatchedModelRunner) for _ in range(2))
    lean._init_from_model(model, max_sequences=8, model_path="tiny", lean=True)
    reference._init_from_model(model, max_sequences=8, model_path="tiny", lean=False)
    assert lean.lean is not None and reference.lean is None
    return Scheduler(lean), Scheduler(reference)


@pytest.mark.parametrize("architecture, overrides", VARIANTS)
def test_lean_rows_equal_the_transformers_forward_over_ragged_batches(architecture, overrides):
    lean, reference = engine_pair(tiny_model(architecture, **overrides))
    rope_type = overrides.get("rope_parameters", {}).get("rope_type", "default")
    assert (lean.runner.lean.rope_table is None) == (rope_type == "dynamic")
    rounds = ragged_rounds() + [[ForwardCall("e", random_ids(5, 9), 3), ForwardCall("a", random_ids(1, 40)[:36], 2)]]
    for index, calls in enumerate(rounds):
        if index == len(rounds) - 1:   # a released slot is reused: the old keys must stay hidden
            lean.release("b")
            reference.release("b")
        for call, got, expected in zip(calls, lean.forward_batch(calls), reference.forward_batch(calls)):
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=lambda m: f"{call.seq_id}: {m}")


def test_the_tolerance_catches_a_lean_forward_without_rotary_positions(monkeypatch):
    """The comparison above can fail: a lean forward that ignores positions is caught."""
    lean, reference = engine_pair(tiny_model("llama"))
    decoder = lean.runner.lean
    def no_rotation(hidden, positions):
        batch, length = positions.shape
        return torch.ones(batch, 1, length, decoder.head_dim), torch.zeros(batch, 1, length, decoder.head_dim)
    monkeypatch.setattr(decoder, "rope", no_rotation)
    calls = ragged_rounds()[0]
    differences = [(got - expected).abs().max().item()
                   for got, expected in zip(lean.forward_batch(calls), reference.forward_batch(calls))]
    assert max(differences) > 100 * ATOL


def test_greedy_steps_on_the_shipped_target_are_bit_identical():
    model = load_causal_lm(SHIPPED_TARGET)
    lean, reference = engine_pair(model)
    history = random_ids(7, 120, vocab_size=model.config.vocab_size)
    for _ in range(6):   # a prefill, then verifies of 5 rows and single steps, as an engine sees them
        rows = lean.forward("s", history, num_rows=5)
        assert torch.equal(rows, reference.forward("s", history, num_rows=5))
        history = history + [int(rows[-1].argmax())]


def test_architectures_without_a_lean_forward_run_transformers():
    gpt2 = tiny_model("gpt2")
    assert lean_support(gpt2)[0] is False
    assert runner_for_model(gpt2).lean is None
    with pytest.raises(ValueError, match="no lean forward"):
        LeanDecoder(gpt2)


def test_lean_forward_can_be_switched_off_in_the_model_spec(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    spec = {"path": str(tmp_path), "dtype": "float32", "device": "cpu", "torch_threads": 1, "max_sequences": 4}
    assert load_runner(spec).lean is not None
    assert load_runner({**spec, "lean_forward": False}).lean is None
