"""A lean decoder forward for Llama-shaped models, over the batched runner's KV cache.

Why: for small models a transformers forward spends a large share of its time in Python around the
kernels (module calls, keyword plumbing, output objects), and on this project's CPU engines that
time is paid every draft step and every verify. This forward runs the same arithmetic with the
model's own modules' weights in the fewest calls: each projection's own product, `F.rms_norm`,
the rotary embedding from the model's own module (so every rope type it knows is computed its
way), the same paged attention every model's attention interface calls (`PagedBatchView.attend`),
and the LM head only over the rows asked for. It is a faster implementation of the engine's one
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

import torch
import torch.nn.functional as F

from specserve.decoding.paged_cache import PagedBatchView
from specserve.decoding.weight_layout import PackedLinear

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

    def __init__(self, model, aux_layers: tuple[int, ...] = ()) -> None:
        """aux_layers: layers whose inputs `forward` also returns (an EAGLE-3 head's features)."""
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
        self.layers = list(decoder.layers)
        self.aux_layers = tuple(aux_layers)
        # Whether each layer's input is an aux feature, as flags read by layer index, so the
        # forward tests no aux layer number: where dynamo leaves ints unspecialised they are
        # symbols, which neither equal a dict's int keys nor test `in` as their values would.
        self.feeds_aux = tuple(index in self.aux_layers for index in range(len(self.layers)))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: PagedBatchView):
        """Logits [kept rows, V] of the positions cache.keep_index names (flat b * T + t, in
        that order). No host value is read, so the compiled forward is one graph. With
        aux_layers: (logits, those layers' inputs at every position [B * T, len(aux_layers) x hidden])."""
        batch, length = input_ids.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids)            # [B, T, D]
        cos, signed_sin = cos.unsqueeze(1), rope_signs(sin).unsqueeze(1)
        width = hidden.shape[-1]
        # Each layer's input where an aux layer reads it, in a list by layer (see __init__).
        layer_inputs = []
        for index, layer in enumerate(self.layers):
            layer_inputs.append(hidden if self.feeds_aux[index] else None)
            attention, mlp = layer.self_attn, layer.mlp
            x = F.rms_norm(hidden, (width,), layer.input_layernorm.weight, self.eps)
            q = _linear(x, attention.q_proj).view(batch, length, heads, head_dim).transpose(1, 2)
            k = _linear(x, attention.k_proj).view(batch, length, kv_heads, head_dim).transpose(1, 2)
            v = _linear(x, attention.v_proj).view(batch, length, kv_heads, head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)
            attended = cache.attend(index, q, k, v, scaling=self.scaling)
            attended = attended.transpose(1, 2).reshape(batch, length, heads * head_dim)
            hidden = hidden + _linear(attended, attention.o_proj)
            x = F.rms_norm(hidden, (width,), layer.post_attention_layernorm.weight, self.eps)
            hidden = hidden + _linear(mlp.act_fn(_linear(x, mlp.gate_proj)) * _linear(x, mlp.up_proj), mlp.down_proj)
        kept = hidden.reshape(batch * length, width).index_select(0, cache.keep_index)
        logits = _linear(F.rms_norm(kept, (width,), self.final_norm, self.eps), self.lm_head)
        if not self.aux_layers:
            return logits
        features = torch.cat([layer_inputs[layer] for layer in self.aux_layers], dim=-1)
        return logits, features.reshape(batch * length, -1)


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


def _linear(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """The Linear's arithmetic without its module call (hooks and all): its own forward, which on
    the CPU engines picks the weight's layout by the rows (decoding.weight_layout.PackedLinear)."""
    return linear.forward(x)
