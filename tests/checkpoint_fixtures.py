"""Tiny look-alikes of the Hugging Face checkpoints users pair (Llama-3.x, Qwen2.5, Mistral), built in
a tmp dir in about a second: random weights and small shapes, but each family's quirks as published
(../shared/CHECKPOINTS.md, summarised in docs/real-checkpoints.md):

- config.json written in the published form (``rope_theta`` + ``rope_scaling``, ``torch_dtype``,
  ``head_dim`` only where the real file has it), bf16 weights, the targets as safetensors shards
  with ``model.safetensors.index.json`` and the drafts as one ``model.safetensors``;
- Llama-3: untied target, tied draft with a ``head_dim`` key, llama3 rope scaling, EOS lists,
  generation defaults (temperature 0.6, top_p 0.9), a tokenizer whose post-processor prepends
  ``<|begin_of_text|>`` and a chat template that writes ``bos_token`` too (the double-BOS trap);
- Qwen2.5: one tokenizer, two embedding widths, both wider than ``len(tokenizer)``; q/k/v
  biases; tied draft; ChatML with its default system message; EOS [im_end, endoftext];
  generation defaults with a repetition penalty;
- Mistral: HF shards + index AND a ``consolidated.safetensors`` decoy in Mistral-native names,
  ``<s>``/``</s>``, the [INST] template.

Tokenizers are the shipped BPE (models/default/tokenizer) with each family's special tokens added.
For the EOS tests, each target's lm_head swaps the rows of one token and of an EOS id only
generation_config.json lists (Qwen's ``<|endoftext|>``, Llama's ``<|eom_id|>``), chosen so the
target's greedy answer to EOS_PROMPT emits that EOS after a few tokens: a server that ignores
generation_config's EOS list runs on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Phi3Config, Phi3ForCausalLM, PreTrainedModel, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from specserve.common.config import DEFAULT_MODELS_DIR

SHIPPED_TOKENIZER = DEFAULT_MODELS_DIR / "tokenizer" / "tokenizer.json"
EOS_PROMPT = "def add(a, b):"
EOS_AFTER = 4            # the list-only EOS is the greedy answer's token at this output position
SHARD_SIZE = "400KB"     # several shards for every target

# Faithful shortened copies of the published templates (tools and multimodal branches left out).
LLAMA31_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = \"\" %}\n"
    "{%- endif %}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{{- system_message }}\n"
    "{{- \"<|eot_id|>\" }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n")
# Llama-3.2-1B's template takes today's date (strftime_now): the draft renders other prompts.
LLAMA32_TEMPLATE = LLAMA31_TEMPLATE.replace(
    "{%- set date_string = \"26 Jul 2024\" %}",
    "{%- if strftime_now is defined %}{%- set date_string = strftime_now(\"%d %b %Y\") %}"
    "{%- else %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}")
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) "
    "or (message.role == \"assistant\") %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")
MISTRAL_V03_TEMPLATE = (
    "{%- if messages[0][\"role\"] == \"system\" %}\n"
    "    {%- set system_message = messages[0][\"content\"] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message[\"role\"] == \"user\" %}\n"
    "        {%- if loop.last and system_message is defined %}\n"
    "            {{- \"[INST] \" + system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\" }}\n"
    "        {%- else %}\n"
    "            {{- \"[INST] \" + message[\"content\"] + \"[/INST]\" }}\n"
    "        {%- endif %}\n"
    "    {%- elif message[\"role\"] == \"assistant\" %}\n"
    "        {{- \" \" + message[\"content\"] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an "
    "initial optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n")


@dataclass(frozen=True)
class Family:
    """One fixture pair: folders, and the ids the tests check against."""

    name: str
    target: Path
    draft: Path | None
    eos_ids: tuple[int, ...]          # the union a server must stop on
    list_only_eos: int | None         # an EOS id only generation_config.json (and config) list
    tokenizer_size: int


def _tokenizer(folder: Path, specials: list[str], config: dict, bos: str | None, template: str) -> dict[str, int]:
    """The shipped BPE plus `specials`, saved as tokenizer.json + tokenizer_config.json (template
    inside, as published); with `bos`, a post-processor that prepends it. Returns token -> id."""
    tokenizer = Tokenizer.from_file(str(SHIPPED_TOKENIZER))
    tokenizer.add_special_tokens(specials)
    ids = {token: tokenizer.token_to_id(token) for token in specials}
    ids["<|endoftext|>"] = tokenizer.token_to_id("<|endoftext|>")
    if bos is not None:
        tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                      special_tokens=[(bos, ids[bos])])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072,
              "clean_up_tokenization_spaces": True, **config, "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids


def _save(model: PreTrainedModel, folder: Path, published: dict, generation: dict, sharded: bool) -> None:
    """bf16 safetensors (sharded with an index, or one file), config.json rewritten in the
    published key names, and generation_config.json as published."""
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size=SHARD_SIZE if sharded else "1GB")
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters", {}) or {}
    config.pop("dtype", None)
    config["rope_theta"] = rope.pop("rope_theta", 10000.0)
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    config.update(published, torch_dtype="bfloat16")
    config = {key: value for key, value in config.items() if value is not None or key in published}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({**generation, "transformers_version": "4.45.0"},
                                                              indent=2))


def _perturbed(model: PreTrainedModel, seed: int, scale: float = 0.3) -> PreTrainedModel:
    """Weights near another model's, so drafts agree with their target part of the time."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * parameter.std() * torch.randn(parameter.shape, generator=generator))
    return model


def _make_list_eos_emitted(target: PreTrainedModel, prompt_ids: list[int], eos_id: int) -> None:
    """Swap the lm_head rows of eos_id and the token the target's greedy answer to prompt_ids holds
    at EOS_AFTER, so that answer ends with eos_id there (positions before it are unchanged)."""
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt_ids]), max_new_tokens=EOS_AFTER + 1, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    answer = out[0, len(prompt_ids):].tolist()
    token = answer[EOS_AFTER]
    if token in answer[:EOS_AFTER] or eos_id in answer[:EOS_AFTER]:
        raise AssertionError(f"fixture seed gives a greedy answer {answer} unusable for the EOS swap")
    with torch.no_grad():
        weight = target.lm_head.weight
        weight[[token, eos_id]] = weight[[eos_id, token]]


def _random(cls, config, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    return cls(config).eval()


def build_llama3(root: Path) -> Family:
    """Llama-3.1-8B-Instruct (target) + Llama-3.2-1B-Instruct (draft) look-alikes."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eom_id|>", "<|eot_id|>"]
    target_dir, draft_dir = root / "llama3-target", root / "llama3-draft"
    tokenizer_config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    ids = _tokenizer(target_dir, specials, tokenizer_config, "<|begin_of_text|>", LLAMA31_TEMPLATE)
    _tokenizer(draft_dir, specials, tokenizer_config, "<|begin_of_text|>", LLAMA32_TEMPLATE)
    vocab = len(specials) + 8192
    bos, eos_list = ids["<|begin_of_text|>"], [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    common = dict(vocab_size=vocab, max_position_embeddings=1024, rope_theta=500000.0, bos_token_id=bos,
                  eos_token_id=eos_list, rms_norm_eps=1e-5, initializer_range=0.2)
    rope = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128, "rope_type": "llama3"}
    target = _random(LlamaForCausalLM, LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2,
                                                   rope_scaling=rope, tie_word_embeddings=False, **common), 0)
    draft = _random(LlamaForCausalLM, LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                                  rope_scaling={**rope, "factor": 32.0}, tie_word_embeddings=True,
                                                  **common), 1)
    prompt = [bos] + Tokenizer.from_file(str(target_dir / "tokenizer.json")).encode(
        EOS_PROMPT, add_special_tokens=False).ids
    _make_list_eos_emitted(target, prompt, ids["<|eom_id|>"])
    generation = {"bos_token_id": bos, "do_sample": True, "eos_token_id": eos_list, "temperature": 0.6,
                  "top_p": 0.9}
    _save(target, target_dir, {}, generation, sharded=True)
    _save(draft, draft_dir, {"head_dim": 16}, generation, sharded=False)
    _drop_key(target_dir / "config.json", "head_dim")   # L8's config has no head_dim key
    return Family("llama3", target_dir, draft_dir, tuple(sorted(set(eos_list))), ids["<|eom_id|>"], vocab)


def build_qwen25(root: Path) -> Family:
    """Qwen2.5-7B-Instruct (target) + Qwen2.5-0.5B-Instruct (draft) look-alikes: one tokenizer,
    two padded embedding widths."""
    specials = ["<|im_start|>", "<|im_end|>"]
    target_dir, draft_dir = root / "qwen25-target", root / "qwen25-draft"
    tokenizer_config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                        "errors": "replace", "split_special_tokens": False}
    ids = _tokenizer(target_dir, specials, tokenizer_config, None, QWEN25_TEMPLATE)
    _tokenizer(draft_dir, specials, tokenizer_config, None, QWEN25_TEMPLATE)
    size = 8192 + len(specials)
    im_end, endoftext = ids["<|im_end|>"], ids["<|endoftext|>"]
    common = dict(max_position_embeddings=1024, rope_theta=1e6, bos_token_id=endoftext, eos_token_id=im_end,
                  use_sliding_window=False, rms_norm_eps=1e-6, initializer_range=0.2)
    target = _random(Qwen2ForCausalLM, Qwen2Config(vocab_size=size + 62, hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=2, num_attention_heads=4,
                                                   num_key_value_heads=2, tie_word_embeddings=False,
                                                   sliding_window=1024, max_window_layers=2, **common), 2)
    draft = _random(Qwen2ForCausalLM, Qwen2Config(vocab_size=size + 30, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=1, num_attention_heads=2,
                                                  num_key_value_heads=1, tie_word_embeddings=True,
                                                  sliding_window=1024, max_window_layers=1, **common), 3)
    prompt = Tokenizer.from_file(str(target_dir / "tokenizer.json")).encode(EOS_PROMPT, add_special_tokens=False).ids
    _make_list_eos_emitted(target, prompt, endoftext)
    generation = {"bos_token_id": endoftext, "pad_token_id": endoftext, "do_sample": True,
                  "eos_token_id": [im_end, endoftext], "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    _save(target, target_dir, {}, {**generation, "repetition_penalty": 1.05}, sharded=True)
    _save(draft, draft_dir, {}, {**generation, "repetition_penalty": 1.1}, sharded=False)
    return Family("qwen25", target_dir, draft_dir, (im_end, endoftext), endoftext, size)


def build_mistral(root: Path) -> Family:
    """Mistral-7B-Instruct-v0.3 look-alike (no usual draft: it serves target-only), with the
    Mistral-native consolidated.safetensors beside the HF shards."""
    specials = ["<s>", "</s>", "[INST]", "[/INST]"]
    folder = root / "mistral"
    ids = _tokenizer(folder, specials, {"bos_token": "<s>", "eos_token": "</s>"},
                     "<s>", MISTRAL_V03_TEMPLATE)
    vocab = 8192 + len(specials)
    model = _random(MistralForCausalLM, MistralConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rope_theta=1e6, sliding_window=None,
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], tie_word_embeddings=False, initializer_range=0.2), 4)
    _save(model, folder, {"sliding_window": None}, {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"]},
          sharded=True)
    _drop_key(folder / "config.json", "head_dim")
    _write_consolidated_decoy(model, folder / "consolidated.safetensors")
    return Family("mistral", folder, None, (ids["</s>"],), None, vocab)


def _write_consolidated_decoy(model: PreTrainedModel, path: Path) -> None:
    """Mistral-native names (tok_embeddings, layers.N.attention.wq, ...) with other values: a
    loader that read it beside the shards would load the wrong, or twice the, weights."""
    from safetensors.torch import save_file

    tensors = {"tok_embeddings.weight": torch.zeros_like(model.model.embed_tokens.weight),
               "norm.weight": torch.zeros_like(model.model.norm.weight),
               "output.weight": torch.zeros_like(model.lm_head.weight)}
    for index, layer in enumerate(model.model.layers):
        tensors[f"layers.{index}.attention.wq.weight"] = torch.zeros_like(layer.self_attn.q_proj.weight)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path))


def _drop_key(path: Path, key: str) -> None:
    config = json.loads(path.read_text())
    config.pop(key, None)
    path.write_text(json.dumps(config, indent=2))


QWEN3_TEMPLATE = QWEN25_TEMPLATE.replace(
    "{%- else %}\n    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n", "")
GEMMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}\n"
    "    {{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}\n")
PHI3_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- else %}{{- eos_token }}{%- endif %}\n")
# The any-decoder families' windows are shorter than the test prompts (tests/test_conformance.py).
FIXTURE_WINDOW = 8


def _decoder_pair(root: Path, name: str, specials: list[str], tokenizer_config: dict, bos: str | None,
                  template: str, target: tuple, draft: tuple, eos: list[str], generation: dict) -> Family:
    """A target (sharded) and draft (one file) of any architecture, saved as transformers writes
    them (config.json in today's key names), sharing one tokenizer; generation_config.json lists
    the eos tokens named."""
    target_dir, draft_dir = root / f"{name}-target", root / f"{name}-draft"
    for folder in (target_dir, draft_dir):
        ids = _tokenizer(folder, specials, tokenizer_config, bos, template)
    eos_ids = [ids[token] for token in eos]
    size = 8192 + len(specials)
    common = dict(vocab_size=size, max_position_embeddings=1024, eos_token_id=eos_ids, initializer_range=0.2,
                  bos_token_id=ids[bos] if bos else None, pad_token_id=None)
    for folder, (cls, config_cls, shape, seed), sharded in ((target_dir, target, True), (draft_dir, draft, False)):
        model = _random(cls, config_cls(**common, **shape), seed)
        model.to(torch.bfloat16).save_pretrained(folder, max_shard_size=SHARD_SIZE if sharded else "1GB")
        (folder / "generation_config.json").write_text(json.dumps(
            {**generation, "eos_token_id": eos_ids, "transformers_version": "4.51.0"}, indent=2))
    return Family(name, target_dir, draft_dir, tuple(sorted(set(eos_ids))), None, size)


QWEN3_SPECIALS = ["<|im_start|>", "<|im_end|>"]
QWEN3_TOKENIZER = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
QWEN3_GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
QWEN3_DRAFT = (Qwen3ForCausalLM, Qwen3Config, dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                                   tie_word_embeddings=True), 6)


def build_qwen3(root: Path) -> Family:
    """Qwen3-32B + Qwen3-0.6B look-alikes: per-head q/k norms, explicit head_dim, tied draft."""
    target = (Qwen3ForCausalLM, Qwen3Config, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                  tie_word_embeddings=False), 5)
    return _decoder_pair(root, "qwen3", QWEN3_SPECIALS, QWEN3_TOKENIZER, None, QWEN3_TEMPLATE, target, QWEN3_DRAFT,
                         ["<|im_end|>", "<|endoftext|>"], QWEN3_GENERATION)


def build_qwen3_moe(root: Path) -> Family:
    """Qwen3-30B-A3B + Qwen3-0.6B look-alikes: a routed-experts target, a dense draft."""
    target = (Qwen3MoeForCausalLM, Qwen3MoeConfig,
              dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False), 7)
    return _decoder_pair(root, "qwen3_moe", QWEN3_SPECIALS, QWEN3_TOKENIZER, None, QWEN3_TEMPLATE, target,
                         QWEN3_DRAFT, ["<|im_end|>", "<|endoftext|>"], QWEN3_GENERATION)


def build_gemma3(root: Path) -> Family:
    """Gemma 3 text look-alikes (target + draft): sliding-window layers (shorter than the test
    prompts) beside global ones, scaled embeddings, query_pre_attn_scalar, <bos> prepended."""
    layers = dict(sliding_window=FIXTURE_WINDOW, query_pre_attn_scalar=16, head_dim=16)
    target = (Gemma3ForCausalLM, Gemma3TextConfig,
              dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   **layers), 8)
    draft = (Gemma3ForCausalLM, Gemma3TextConfig,
             dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, layer_types=["sliding_attention", "full_attention"], **layers), 9)
    return _decoder_pair(root, "gemma3", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
                         {"bos_token": "<bos>", "eos_token": "<eos>"}, "<bos>", GEMMA3_TEMPLATE, target, draft,
                         ["<eos>", "<end_of_turn>"], {"top_k": 64, "top_p": 0.95})


def build_phi3(root: Path) -> Family:
    """Phi-3 look-alikes (target + draft): fused qkv and gate_up projections, a window on every
    layer (Phi-3-mini-4k's is 2047 of 4096; here shorter than the test prompts)."""
    target = (Phi3ForCausalLM, Phi3Config, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=4,
                                                sliding_window=FIXTURE_WINDOW, tie_word_embeddings=False), 10)
    draft = (Phi3ForCausalLM, Phi3Config, dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=2,
                                               sliding_window=FIXTURE_WINDOW, tie_word_embeddings=False), 11)
    return _decoder_pair(root, "phi3", ["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
                         {"bos_token": "<s>", "eos_token": "<|endoftext|>"}, "<s>", PHI3_TEMPLATE, target, draft,
                         ["<|endoftext|>", "<|end|>"], {})


BUILDERS = {"llama3": build_llama3, "qwen25": build_qwen25, "mistral": build_mistral}
# Architectures beyond the Llama family, served through the same engine (issue: any decoder).
DECODER_BUILDERS = {"qwen3": build_qwen3, "qwen3_moe": build_qwen3_moe, "gemma3": build_gemma3, "phi3": build_phi3}


def build_all(root: Path) -> dict[str, Family]:
    """Every family under root (a few seconds on this box)."""
    return {name: build(root) for name, build in {**BUILDERS, **DECODER_BUILDERS}.items()}
