"""A lean decoder forward for Llama-shaped models, over the batched runner's KV cache.

Why: for small models a transformers forward spends a large share of its time in Python around the
kernels (module calls, keyword plumbing, output objects), and on this project's CPU engines that
time is paid every draft step and every verify. This forward runs the same arithmetic with the
model's own modules' weights in the fewest calls: each projection's own product, `F.rms_norm`,
the rotary embedding from the model's own module (so every rope type it knows is computed its
way; where the type fixes each position's values, computed once for every position and looked
up, as vLLM's rotary cache is), the same paged attention every model's attention interface calls
(`PagedBatchView.attend`), and the LM head only over the rows asked for. It is a faster implementation of the engine's one
path, not a second engine: it is kept only while it measures faster (docs/performance.md).
vLLM and gpt-fast likewise run their own model code rather than the reference implementation.

On the default pair its logits are bit-identical to the transformers forward over the same slot
cache, and a step costs less (`python -m specserve.bench.figures.lean_forward`; figures in docs/performance.md).
Fusing q/k/v and gate/up into one product each was tried and was slower on a CPU (MKL picks a
worse kernel for the wider matrix), so the projections stay separate.

Supported when the decoder is Llama-shaped (`lean_support`): llama, mistral and qwen2 layers of
pre-norm attention plus a gated MLP, biases allowed, no per-head q/k norms, full attention on every
layer; anything else runs the model's own forward over the same attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specserve.decoding.paged_cache import PagedBatchView
from specserve.decoding.weight_layout import PackedLinear, linear

LEAN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


def lean_support(model) -> tuple[bool, str]:
    """(True, why) when LeanDecoder computes what the model's own forward computes, else (False, why not)."""
    config = model.config.get_text_config(decoder=True)
    model_type = getattr(config, "model_type", None)
    if model_type not in LEAN_MODEL_TYPES:
        return False, f"model type {model_type!r} has no lean forward ({', '.join(sorted(LEAN_MODEL_TYPES))} do)"
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or getattr(model, "lm_head", None) is None:
        return False, "no model.layers / lm_head"
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        if any(hasattr(attention, name) for name in ("q_norm", "k_norm")):
            return False, "per-head q/k norms"
        if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return False, "MLP is not gated (gate/up/down)"
    if (getattr(model, "tp_size", None) or 1) > 1:
        return False, "tensor-parallel shards (the model's own forward runs the plan's collectives)"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return False, "pretraining_tp > 1"
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings and (
            model_type == "mistral" or any(getattr(layer.self_attn, "sliding_window", None) for layer in layers)):
        return False, f"sliding window {window} (the model's own forward passes it per layer)"
    weight_types = {type(getattr(layer.self_attn, name)) for layer in layers for name in ("q_proj", "o_proj")}
    if not weight_types <= {torch.nn.Linear, PackedLinear}:
        return False, "projections are not plain nn.Linear (quantized?)"
    return True, f"{model_type}: lean decoder forward"


class LeanDecoder:
    """`forward(input_ids, position_ids, cache) -> logits [kept rows, V]`, taking the arguments
    BatchedModelRunner builds for the model's forward (cache: the paged cache's view, whose
    `attend(layer, q, k, v)` stores the new keys and attends, and whose keep_index names the rows
    that reach the LM head). It holds references to the model's modules, no copies."""

    def __init__(self, model, aux_layers: tuple[int, ...] = (), max_positions: int | None = None) -> None:
        """aux_layers: layers whose inputs `forward` also returns (an EAGLE-3 head's features).
        max_positions: the longest context served (default: the model's max_position_embeddings),
        the length of the rotary table (`rope_table`)."""
        supported, reason = lean_support(model)
        if not supported:
            raise ValueError(f"no lean forward for this model: {reason}")
        config = model.config.get_text_config(decoder=True)
        decoder = model.model
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.final_norm = decoder.norm.weight
        self.lm_head = model.lm_head
        self.eps = float(config.rms_norm_eps)
        first = decoder.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.scaling = float(first.scaling)
        # Each layer's tensors read once here rather than through its modules every step: a
        # module attribute lookup costs about what a small kernel does, and a step makes a dozen
        # a layer. They are the modules' own parameters (no copies), so an in-place weight swap
        # and the packed copies keyed by the weight (decoding.weight_layout) are what a step reads.
        self.layer_weights = tuple(LayerWeights.of(layer) for layer in decoder.layers)
        self.rope_table = rope_table(self.rotary, max_positions or config.max_position_embeddings, self.embed.weight)
        self.aux_layers = tuple(aux_layers)
        # Whether each layer's input is an aux feature, as flags read by layer index, so the
        # forward tests no aux layer number: where dynamo leaves ints unspecialised they are
        # symbols, which neither equal a dict's int keys nor test `in` as their values would.
        self.feeds_aux = tuple(index in self.aux_layers for index in range(len(self.layer_weights)))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: PagedBatchView):
        """Logits [kept rows, V] of the positions cache.keep_index names (flat b * T + t, in
        that order). No host value is read, so the compiled forward is one graph. With
        aux_layers: (logits, those layers' inputs at every position [B * T, len(aux_layers) x hidden])."""
        batch, length = input_ids.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        hidden = self.embed(input_ids)
        cos, signed_sin = self.rope(hidden, position_ids)        # each [B, 1, T, D]
        width, eps = hidden.shape[-1], self.eps
        # Each layer's input where an aux layer reads it, in a list by layer (see __init__).
        layer_inputs = []
        for index, weights in enumerate(self.layer_weights):
            layer_inputs.append(hidden if self.feeds_aux[index] else None)
            x = F.rms_norm(hidden, (width,), weights.input_norm, eps)
            q = linear(x, weights.q, weights.q_bias).view(batch, length, heads, head_dim).transpose(1, 2)
            k = linear(x, weights.k, weights.k_bias).view(batch, length, kv_heads, head_dim).transpose(1, 2)
            v = linear(x, weights.v, weights.v_bias).view(batch, length, kv_heads, head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)
            attended = cache.attend(index, q, k, v, scaling=self.scaling)
            attended = attended.transpose(1, 2).reshape(batch, length, heads * head_dim)
            hidden = hidden + linear(attended, weights.o, weights.o_bias)
            x = F.rms_norm(hidden, (width,), weights.post_norm, eps)
            gated = weights.act_fn(linear(x, weights.gate, weights.gate_bias)) * linear(x, weights.up, weights.up_bias)
            hidden = hidden + linear(gated, weights.down, weights.down_bias)
        kept = hidden.reshape(batch * length, width).index_select(0, cache.keep_index)
        logits = self.lm_head.forward(F.rms_norm(kept, (width,), self.final_norm, eps))   # no module hooks
        if not self.aux_layers:
            return logits
        features = torch.cat([layer_inputs[layer] for layer in self.aux_layers], dim=-1)
        return logits, features.reshape(batch * length, -1)

    def rope(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) of position_ids [B, T] for `apply_rope`, each [B, 1, T, D]: rows of
        the rotary table where there is one, else the model's rotary module computing them."""
        if self.rope_table is not None:
            batch, length = position_ids.shape
            cos, signed_sin = self.rope_table.index_select(1, position_ids.reshape(-1)).view(2, batch, 1, length, -1)
            return cos, signed_sin
        cos, sin = self.rotary(hidden, position_ids)
        return cos.unsqueeze(1), rope_signs(sin).unsqueeze(1)


class LayerWeights(NamedTuple):
    """One decoder layer's tensors as the lean forward reads them (the modules' own; biases None
    where the model has none)."""

    input_norm: torch.Tensor
    q: torch.Tensor
    q_bias: torch.Tensor | None
    k: torch.Tensor
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor
    gate_bias: torch.Tensor | None
    up: torch.Tensor
    up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    act_fn: Callable[[torch.Tensor], torch.Tensor]

    @staticmethod
    def of(layer) -> "LayerWeights":
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
        gate, up, down = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        q, k, v, o = ((module.weight, module.bias) for module in projections)
        return LayerWeights(layer.input_layernorm.weight, *q, *k, *v, *o, layer.post_attention_layernorm.weight,
                            gate.weight, gate.bias, up.weight, up.bias, down.weight, down.bias, mlp.act_fn)


# Rope types whose cos/sin depend on the position alone (no rescaling by the sequence's length,
# as transformers' dynamic and longrope types do at run time).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def rope_table(rotary, max_positions: int, like: torch.Tensor) -> torch.Tensor | None:
    """[2, positions, D]: each position's cos and signed sin (`rope_signs`) as the model's rotary
    module computes them, in like's dtype on its device, for a rotary whose values depend on the
    position alone; None for any other (it then runs every forward). Why: a step then looks its
    positions up in one gather instead of a dozen small ops, and the values are the module's
    own, bit for bit (transformers computes each position's angles elementwise)."""
    rope_type = getattr(rotary, "rope_type", None)
    if not isinstance(rope_type, str) or rope_type not in STATIC_ROPE_TYPES:
        return None
    positions = torch.arange(int(max_positions), device=like.device).unsqueeze(0)
    with torch.no_grad():
        cos, sin = rotary(like.new_empty(0), positions)
    table = torch.stack((cos[0], rope_signs(sin)[0]))
    # Read in place by CUDA graphs, as the weights are, rather than copied in at every replay; and
    # its shape the engine's constant in a compiled forward, as a weight's is.
    import torch._dynamo as dynamo

    dynamo.mark_static_address(table)
    dynamo.mark_static(table)
    return table


def rope_signs(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., D] with its first half negated, for `apply_rope`: computed once per forward."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., D] as transformers' Llama computes it, x * cos + rotate_half(x)
    * sin with rotate_half([x1, x2]) = [-x2, x1], in fewer ops: rotate_half(x) * sin is
    [-x2 * s1, x1 * s2], and x rolled by half ([x2, x1]) times [-s1, s2] (rope_signs) is the same
    numbers bit for bit (a product's sign does not depend on which factor carries it)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
