"""The CPU engines store Linear weights input-major, with a oneDNN-packed copy for products of
several rows (decoding.weight_layout): same shapes, values and state dict, a layout the engine's
forward and a weight swap keep."""

from __future__ import annotations

import copy

import torch

from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.scheduler import engine_for_model
from specserve.decoding.weight_layout import (PACKED_MIN_ROWS, PackedCopies, PackedLinear, input_major_linears,
                                              pack_linears, repack_linears)
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


def test_a_packed_linear_takes_its_packed_copy_from_several_rows_and_the_plain_product_below():
    model = tiny_model("llama")
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    linears = linear_weights(model)
    assert pack_linears(model) == len(linears)
    assert all(type(module) is PackedLinear for name, module in model.named_modules() if name in linears)
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())
    module = model.model.layers[0].mlp.up_proj
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():   # as the engines run
        for rows in (1, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 8):
            x = torch.randn(rows, module.in_features, generator=generator)
            torch.testing.assert_close(module(x), torch.nn.functional.linear(x, module.weight), atol=1e-5, rtol=0)
    # The copy is what several rows read: weights changed behind it leave it stale (a swap
    # repacks, below), which one row, read from the weight itself, does not see.
    with torch.no_grad():
        module.weight.mul_(2.0)
        one, several = torch.randn(1, module.in_features), torch.randn(PACKED_MIN_ROWS, module.in_features)
        assert torch.equal(module(one), torch.nn.functional.linear(one, module.weight))
        assert not torch.allclose(module(several), torch.nn.functional.linear(several, module.weight), atol=1e-3)
        repack_linears(model)
        torch.testing.assert_close(module(several), torch.nn.functional.linear(several, module.weight),
                                   atol=1e-5, rtol=0)


def test_a_packed_linear_under_autograd_takes_the_plain_product_and_its_gradient():
    """Training a packed model (grad enabled) must reach the weights: the packed copy is left out."""
    model = tiny_model("llama")
    pack_linears(model)
    module = model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        module.weight.mul_(2.0)   # the copy is stale: a product that read it would show
    x = torch.randn(8, module.in_features)
    module(x).sum().backward()
    expected = x.sum(dim=0).expand_as(module.weight)
    torch.testing.assert_close(module.weight.grad, expected)
    assert torch.equal(module(x), torch.nn.functional.linear(x, module.weight))


def test_half_precision_weights_are_not_packed_and_a_copied_model_computes_plainly():
    assert pack_linears(tiny_model("llama").to(torch.bfloat16)) == 0
    model = tiny_model("llama")
    pack_linears(model)
    copied = copy.deepcopy(model)   # a packed copy has no storage to copy: the copy goes without
    module, its_copy = model.model.layers[0].self_attn.q_proj, copied.model.layers[0].self_attn.q_proj
    x = torch.randn(4, module.in_features)
    assert torch.equal(its_copy(x), torch.nn.functional.linear(x, its_copy.weight))
    torch.testing.assert_close(its_copy(x), module(x), atol=1e-5, rtol=0)


def test_a_weight_swap_reorders_the_packed_copies():
    """A verify's rows (several, so the packed copies) after a swap are the new weights' rows: the
    swapped engine's equal an engine built over the new weights."""
    model = tiny_model("llama")
    engine = engine_for_model(model)
    new_model = tiny_model("llama", seed=1)
    fresh = engine_for_model(copy.deepcopy(new_model))
    engine.load_weights(new_model.state_dict(), "swapped")
    history = [(7 * i) % 90 + 2 for i in range(30)]
    calls = [ForwardCall("s", history, PACKED_MIN_ROWS + 2)]
    torch.testing.assert_close(engine.forward_batch(calls)[0], fresh.forward_batch(calls)[0], atol=1e-5, rtol=0)


def test_packed_copies_are_found_by_their_weight_alone_and_dropped_with_it():
    """A copy is found for its own tensor, not for an equal one, and goes when its weight is
    collected; a tensor whose id an entry of another tensor holds (a collected weight's id taken
    by a new tensor) finds nothing."""
    import gc

    copies = PackedCopies()
    weight, equal = torch.ones(3, 3), torch.ones(3, 3)
    copies[weight] = torch.zeros(1)
    assert copies.get(weight) is not None and weight in copies
    assert copies.get(equal) is None and equal not in copies
    copies._entries[id(equal)] = copies._entries[id(weight)]   # equal's id, weight's entry
    assert copies.get(equal) is None
    del copies._entries[id(equal)]
    del weight
    gc.collect()
    assert len(copies) == 0
