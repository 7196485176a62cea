"""The CPU engines store Linear weights input-major (decoding.weight_layout): same shapes and
values, a layout the engine's forward and a weight swap keep."""

from __future__ import annotations

import copy

import torch

from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.scheduler import engine_for_model
from specserve.decoding.weight_layout import input_major_linears
from tests.tiny_pair import tiny_model


def linear_weights(model) -> dict[str, torch.Tensor]:
    return {name: module.weight for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def input_major(weight: torch.Tensor) -> bool:
    return weight.stride() == (1, weight.shape[0])


def test_weights_keep_shape_and_values_and_are_stored_in_out():
    model = tiny_model("llama", tie_word_embeddings=True)
    before = {name: weight.detach().clone() for name, weight in linear_weights(model).items()}
    assert not any(input_major(weight) for weight in linear_weights(model).values())
    restored = input_major_linears(model)
    after = linear_weights(model)
    assert restored == len(after)   # the tied LM head is the embedding's matrix: re-stored once, counted once
    for name, weight in after.items():
        assert input_major(weight), name
        assert torch.equal(weight, before[name]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert input_major_linears(model) == 0   # already input-major


def test_half_precision_weights_keep_their_layout():
    model = tiny_model("llama").to(torch.bfloat16)
    assert input_major_linears(model) == 0
    assert all(weight.is_contiguous() for weight in linear_weights(model).values())


def test_the_engine_stores_its_weights_input_major_and_computes_the_same_logits():
    model = tiny_model("llama")
    as_loaded = copy.deepcopy(model)
    engine = engine_for_model(model)
    assert all(input_major(weight) for weight in linear_weights(model).values())
    reference = engine_for_model(as_loaded)
    for module in as_loaded.modules():   # put the copy's weights back as loaded
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.contiguous()
    history = [(5 * i) % 90 + 2 for i in range(40)]
    for new_tokens in (1, 5):
        calls = [ForwardCall(f"s{new_tokens}", history, new_tokens)]
        got, expected = engine.forward_batch(calls), reference.forward_batch(calls)
        torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=0)


def test_a_weight_swap_copies_into_the_input_major_weights():
    model = tiny_model("llama")
    engine = engine_for_model(model)
    new_state = tiny_model("llama", seed=1).state_dict()
    engine.runner.load_weights(new_state)
    for name, weight in linear_weights(model).items():
        assert input_major(weight), name
        assert torch.equal(weight, new_state[f"{name}.weight"]), name
