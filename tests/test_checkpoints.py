"""Serving real checkpoint formats, in-process (no Ray): loading, EOS sets, generation defaults,
dtype and device, padded vocabularies (with a statistical test), chat templates and the launch
flags, on the look-alike fixtures of tests/checkpoint_fixtures.py.

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md)."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specserve.cluster.builder import build_app, served_model_specs
from specserve.cluster.cli import add_model_args, config_from_args
from specserve.common.config import SpecServeConfig
from specserve.decoding.batched_runner import load_runner
from specserve.decoding.scheduler import Scheduler, engine_for_model
from specserve.decoding.checkpoint import (check_weight_files, eos_token_ids, generation_defaults, max_model_len,
                                 resolve_dtype)
from specserve.decoding.model_runner import IncompatibleModelsError, load_causal_lm
from specserve.decoding.rejection import rejection_sample
from specserve.decoding.sampling import SamplingParams, logits_to_probs, make_generator
from specserve.deployments.ingress import Ingress
from specserve.deployments.openai_protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from tests.checkpoint_fixtures import EOS_AFTER, EOS_PROMPT

MESSAGES = [{"role": "system", "content": "Answer in code."}, {"role": "user", "content": "Add two numbers."},
            {"role": "assistant", "content": "def add(a, b):"}, {"role": "user", "content": "Now subtract."}]


def spec(path, **extra) -> dict:
    return {"path": str(path), "dtype": "auto", "device": "auto", "torch_threads": 1, "max_sequences": 4,
            "lean_forward": True, **extra}


# -- loading -------------------------------------------------------------------------------------

def test_sharded_targets_load_from_their_index_and_drafts_from_one_file(checkpoint_families):
    for family in checkpoint_families.values():
        assert (family.target / "model.safetensors.index.json").is_file()
        assert len(list(family.target.glob("model-0000*-of-*.safetensors"))) > 1
        model = load_causal_lm(str(family.target))
        assert model.dtype == torch.float32 and model.device.type == "cpu"   # auto on CPU
        index = json.loads((family.target / "model.safetensors.index.json").read_text())["weight_map"]
        shard = load_file(str(family.target / index["model.norm.weight"]))
        torch.testing.assert_close(model.model.norm.weight, shard["model.norm.weight"].float())
        if family.draft is not None:
            assert (family.draft / "model.safetensors").is_file()


def test_heads_tied_and_untied_as_published(checkpoint_families):
    llama, qwen = checkpoint_families["llama3"], checkpoint_families["qwen25"]
    for draft in (llama.draft, qwen.draft):
        model = load_causal_lm(str(draft))
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert "lm_head.weight" not in load_file(str(draft / "model.safetensors"))
    for target in (llama.target, qwen.target):
        model = load_causal_lm(str(target))
        assert not torch.equal(model.lm_head.weight[:100], model.model.embed_tokens.weight[:100])
    assert load_causal_lm(str(qwen.target)).model.layers[0].self_attn.q_proj.bias is not None


def test_mistral_consolidated_decoy_is_never_loaded_and_alone_is_refused(checkpoint_families, tmp_path):
    """transformers reads the index only; the decoy (zeros, Mistral-native names) must not leak in."""
    mistral = checkpoint_families["mistral"].target
    assert (mistral / "consolidated.safetensors").is_file()
    model = load_causal_lm(str(mistral))
    assert model.model.embed_tokens.weight.abs().sum() > 0 and model.lm_head.weight.abs().sum() > 0
    native_only = tmp_path / "native"
    native_only.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "consolidated.safetensors"):
        shutil.copy(mistral / name, native_only / name)
    with pytest.raises(ValueError, match="Mistral-native"):
        check_weight_files(native_only)
    with pytest.raises(ValueError, match="Mistral-native"):
        load_causal_lm(str(native_only))


@pytest.mark.parametrize("rope", ["llama3", "yarn"])
def test_lean_forward_equals_transformers_with_scaled_rope(checkpoint_families, rope):
    """Positions past original_max_position_embeddings, where llama3 / yarn scaling changes the
    frequencies (yarn also scales the attention): lean forward == transformers' forward."""
    if rope == "llama3":
        model = load_causal_lm(str(checkpoint_families["llama3"].target))
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})).eval()
    engine = engine_for_model(model, max_sequences=2)
    assert engine.runner.lean is not None
    history = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    served = engine.forward("s", history, num_rows=40)
    with torch.no_grad():
        reference = model(torch.tensor([history])).logits[0, -40:].float()
    torch.testing.assert_close(served, reference, atol=1e-4, rtol=1e-4)


def test_dtype_and_device_auto(checkpoint_families):
    target = checkpoint_families["llama3"].target
    assert resolve_dtype("auto", target, "cpu") == torch.float32
    assert resolve_dtype("auto", target, "cuda") == torch.bfloat16     # the checkpoint's torch_dtype
    assert resolve_dtype("float16", target, "cpu") == torch.float16
    assert SpecServeConfig(target={"path": "t"}, draft=None, speculation={"proposer": "none"}).target.device == "auto"


@pytest.mark.parametrize("overrides, message", [
    ({"target": {"path": "t", "device": "cuda"}}, "target_workers.num_gpus is 0"),
    ({"target": {"path": "t", "device": "cpu"}, "target_workers": {"num_gpus": 1}}, "GPU would sit idle"),
    ({"draft": {"path": "d", "device": "cuda:0"}, "speculation": {"proposer": "draft"}}, "draft_workers.num_gpus"),
    ({"target": {"path": "t", "device": "tpu"}}, "device"),
])
def test_device_and_gpu_contradictions_fail_validation(overrides, message):
    with pytest.raises(ValidationError, match=message):
        SpecServeConfig.model_validate(overrides)


def test_gpu_settings_validate():
    config = SpecServeConfig.model_validate({"target": {"path": "t", "device": "cuda"}, "draft": {"path": "d"},
                                             "target_workers": {"num_gpus": 1}, "draft_workers": {"num_gpus": 1}})
    assert config.draft.device == "auto"


# -- EOS, defaults, lengths ----------------------------------------------------------------------

def test_eos_set_unites_generation_config_config_and_tokenizer(checkpoint_families):
    for family in checkpoint_families.values():
        tokenizer = AutoTokenizer.from_pretrained(family.target)
        assert eos_token_ids(family.target, tokenizer) == frozenset(family.eos_ids)
    qwen = checkpoint_families["qwen25"]
    tokenizer = AutoTokenizer.from_pretrained(qwen.target)
    assert qwen.list_only_eos != tokenizer.eos_token_id   # only generation_config.json lists it


def test_generation_defaults_are_the_targets(checkpoint_families):
    assert generation_defaults(checkpoint_families["llama3"].target) == {"temperature": 0.6, "top_p": 0.9}
    assert generation_defaults(checkpoint_families["qwen25"].target) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                                        "repetition_penalty": 1.05}
    assert generation_defaults(checkpoint_families["mistral"].target) == {}
    assert max_model_len(checkpoint_families["qwen25"].target) == 1024
    assert max_model_len(checkpoint_families["qwen25"].target, 300) == 300
    with pytest.raises(ValueError, match="exceeds"):
        max_model_len(checkpoint_families["qwen25"].target, 5000)


# -- a pair: what the engines are told at start ---------------------------------------------------

def pair_config(target, draft, **extra) -> SpecServeConfig:
    return SpecServeConfig.model_validate({"target": {"path": str(target)},
                                           "draft": None if draft is None else {"path": str(draft)},
                                           "speculation": {"proposer": "draft" if draft else "none"}, **extra})


def test_padded_pair_is_accepted_and_both_runners_score_the_tokenizers_ids(checkpoint_families):
    qwen = checkpoint_families["qwen25"]
    target_spec, draft_spec = served_model_specs(pair_config(qwen.target, qwen.draft))
    assert target_spec["vocab_size"] == draft_spec["vocab_size"] == qwen.tokenizer_size
    assert target_spec["eos_token_ids"] == sorted(qwen.eos_ids)
    target, draft = Scheduler(load_runner(target_spec)), Scheduler(load_runner(draft_spec))
    history = [5, 6, 7]
    assert target.forward("s", history).shape[-1] == draft.forward("s", history).shape[-1] == qwen.tokenizer_size
    assert target.eos_token_ids == frozenset(qwen.eos_ids)


def test_a_draft_with_another_tokenizer_fails_at_start_naming_the_difference(checkpoint_families):
    llama, qwen = checkpoint_families["llama3"], checkpoint_families["qwen25"]
    with pytest.raises(IncompatibleModelsError, match="do not share a tokenizer: .*8198.*8194.*proposer: none"):
        served_model_specs(pair_config(qwen.target, llama.draft))
    served_model_specs(pair_config(qwen.target, None))   # target-only serves
    with pytest.raises(IncompatibleModelsError):          # the app is never built, so nothing starts
        build_app(pair_config(qwen.target, llama.draft))


# -- padded vocabularies stay lossless ------------------------------------------------------------

def _padded_model(vocab: int, width: int, seed: int) -> LlamaForCausalLM:
    """A tiny model of `width` output rows whose padding rows (>= vocab) score highest: a server
    that did not cut them would sample them most of the time."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=width, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         initializer_range=0.2, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight[vocab:] = 3 * model.lm_head.weight[:width - vocab]
    return model


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected >= 5
    observed = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    expected = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    if expected[-1] == 0:     # no rare cell: drop the empty pool (an emitted zero-mass id fails)
        if observed[-1] > 0:
            return 0.0
        observed, expected = observed[:-1], expected[:-1]
    expected *= observed.sum() / expected.sum()
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


PADDED_SAMPLES = 20_000


def test_speculation_over_a_padded_pair_samples_the_targets_distribution_over_the_tokenizer_ids():
    """Target 48 rows, draft 40, tokenizer 32 ids (Qwen2.5's shape of problem). 20,000 seeded
    rounds of K=1 rejection sampling on the runners' rows: the emitted token follows the target's
    processed distribution over the 32 ids (chi-square p > 1e-3, TV < 0.02), never a padding id;
    the uncut rows (a broken server) are rejected by the same test."""
    vocab, history = 32, [3, 1, 4, 1, 5]
    target = engine_for_model(_padded_model(vocab, 48, seed=0))
    draft = engine_for_model(_padded_model(vocab, 40, seed=1))
    uncut_target_logits = target.forward("s", history)[0]
    for engine in (target, draft):
        engine.runner.serve_as(vocab_size=vocab)
    params = SamplingParams(temperature=1.0)
    p = logits_to_probs(target.forward("s", history)[0], params).double()
    q = logits_to_probs(draft.forward("s", history)[0], params)
    generator = make_generator(7)
    draft_ids = torch.multinomial(q, PADDED_SAMPLES, replacement=True, generator=generator).unsqueeze(1)
    emitted = rejection_sample(draft_ids, q.expand(PADDED_SAMPLES, 1, vocab),
                               p.float().expand(PADDED_SAMPLES, 2, vocab), generator)[:, 0]
    assert int(emitted.max()) < vocab
    counts = torch.bincount(emitted, minlength=vocab).double()
    assert chi_square_p(counts, p) > 1e-3
    assert 0.5 * float((counts / counts.sum() - p).abs().sum()) < 0.02
    # A broken variant: rows not cut, so padding ids keep their (large) mass.
    uncut = logits_to_probs(uncut_target_logits, params)
    broken = torch.multinomial(uncut, PADDED_SAMPLES, replacement=True, generator=generator)
    assert int(broken.max()) >= vocab
    assert chi_square_p(torch.bincount(broken.clamp(max=vocab - 1), minlength=vocab).double(), p) < 1e-3


# -- tokenization and chat templates -------------------------------------------------------------

class IngressBody:
    """The Ingress class's request-preparing methods without Serve (its wrapper's finaliser needs
    an event loop), run in-process on the same code."""


for _name in ("_encode", "_encode_plain", "_chat_prompt", "_sampling_fields", "_max_tokens", "_sampling_params"):
    setattr(IngressBody, _name, getattr(Ingress.func_or_class, _name))


def ingress_for(target, **config) -> IngressBody:
    ingress = IngressBody()
    ingress.config = SpecServeConfig.model_validate({"target": {"path": str(target)}, "draft": None,
                                                     "speculation": {"proposer": "none"}, **config})
    ingress.tokenizer = AutoTokenizer.from_pretrained(target)
    ingress.max_context = max_model_len(target)
    ingress.generation_defaults = generation_defaults(target)
    ingress.chat_template = ingress.config.resolved_chat_template
    return ingress


def chat_ids(ingress: IngressBody, messages, template=None, **kwargs) -> list[int]:
    return ingress._encode(ingress._chat_prompt(messages, template, kwargs), add_special_tokens=False)


@pytest.mark.parametrize("name", ["llama3", "qwen25", "mistral"])
def test_chat_prompt_ids_are_apply_chat_template_ids_with_one_bos(checkpoint_families, name):
    family = checkpoint_families[name]
    ingress = ingress_for(family.target)
    messages = MESSAGES if name != "mistral" else MESSAGES[1:]
    expected = ingress.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                     return_dict=False)
    ids = chat_ids(ingress, messages)
    assert ids == list(expected)
    bos = ingress.tokenizer.bos_token_id
    if bos is not None:
        assert ids[0] == bos and ids.count(bos) == 1
    completion = ingress._encode(EOS_PROMPT, add_special_tokens=True)   # the tokenizer decides BOS
    assert (completion[0] == bos) == (bos is not None)


def test_qwen_template_injects_its_default_system_message_and_mistral_refuses_bad_roles(checkpoint_families):
    qwen = ingress_for(checkpoint_families["qwen25"].target)
    assert "You are Qwen" in qwen._chat_prompt([{"role": "user", "content": "hi"}])
    mistral = ingress_for(checkpoint_families["mistral"].target)
    with pytest.raises(OpenAIError, match="alternate") as info:
        mistral._chat_prompt([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert info.value.param == "messages"


def test_chat_template_override_and_kwargs(checkpoint_families, tmp_path):
    llama = checkpoint_families["llama3"].target
    ingress = ingress_for(llama)
    assert "Today Date: 26 Jul 2024" in ingress._chat_prompt(MESSAGES)
    assert "Today Date: 01 Jan 2025" in ingress._chat_prompt(MESSAGES, None, {"date_string": "01 Jan 2025"})
    assert ingress._chat_prompt(MESSAGES, "{{ messages[-1]['content'] }}!") == "Now subtract.!"
    template_file = tmp_path / "template.jinja"
    template_file.write_text("{% for m in messages %}<{{ m['role'] }}>{% endfor %}")
    configured = ingress_for(llama, chat_template=str(template_file))
    assert configured._chat_prompt(MESSAGES[:2]) == "<system><user>"
    with pytest.raises(OpenAIError) as info:
        ingress._chat_prompt(MESSAGES, None, {"add_generation_prompt": False})
    assert info.value.param == "chat_template_kwargs"


def test_default_pair_has_a_chat_template():
    ingress = ingress_for(SpecServeConfig().target.path)
    assert ingress.tokenizer.chat_template
    assert ingress._chat_prompt([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


def test_generation_defaults_fill_only_what_a_request_leaves_out(checkpoint_families):
    ingress = ingress_for(checkpoint_families["qwen25"].target, model_name="m")
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "temperature": None, "top_k": 5})
    params = ingress._sampling_params(body, num_prompt_tokens=3)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.7, 0.8, 5, 1.05)
    assert params.max_tokens == 16                                 # completions: OpenAI's default
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "temperature": 0})
    params = ingress._sampling_params(chat, num_prompt_tokens=3)
    assert params.temperature == 0 and params.max_tokens == 1024 - 3  # chat: the rest of the context


def test_lengths_follow_max_model_len_with_vllms_message(checkpoint_families):
    ingress = ingress_for(checkpoint_families["llama3"].target, model_name="m")
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": 2000})
    with pytest.raises(OpenAIError, match=r"maximum context length is 1024 tokens. However, you requested "
                                          r"2010 tokens \(10 in the messages, 2000 in the completion\)") as info:
        ingress._sampling_params(body, num_prompt_tokens=10)
    assert info.value.param == "max_tokens"
    ok = CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": 1014})
    assert ingress._sampling_params(ok, num_prompt_tokens=10).max_tokens == 1014   # all the context leaves: 1024 - 10
    stop = CompletionRequest.model_validate({"model": "m", "prompt": "x", "stop_token_ids": [99999]})
    with pytest.raises(OpenAIError) as info:
        ingress._sampling_params(stop, num_prompt_tokens=10)
    assert info.value.param == "stop_token_ids"


# -- launch flags ---------------------------------------------------------------------------------

def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_model_args(parser)
    return parser.parse_args(argv)


def test_launch_flags_point_the_config_at_a_pair(checkpoint_families):
    llama = checkpoint_families["llama3"]
    config = config_from_args(parse(["--target", str(llama.target), "--draft", str(llama.draft),
                                     "--max-model-len", "512", "--dtype", "bfloat16"]))
    assert (config.target.path, config.draft.path) == (str(llama.target), str(llama.draft))
    assert config.target.max_model_len == 512 and config.draft.dtype == config.target.dtype == "bfloat16"
    assert config.speculation.proposer == "draft" and config.resolved_tokenizer_path == str(llama.target)
    alone = config_from_args(parse(["--target", str(llama.target), "--tokenizer", str(llama.draft)]))
    assert alone.draft is None and alone.speculation.proposer == "none"
    assert alone.resolved_tokenizer_path == str(llama.draft)


def test_fixture_target_emits_the_list_only_eos(checkpoint_families):
    """The fixture's construction (what the served EOS test relies on): HF generate with the
    folder's generation config stops on the list-only EOS after EOS_AFTER tokens."""
    for name in ("llama3", "qwen25"):
        family = checkpoint_families[name]
        tokenizer = AutoTokenizer.from_pretrained(family.target)
        model = AutoModelForCausalLM.from_pretrained(family.target, dtype=torch.float32)
        ids = tokenizer(EOS_PROMPT, return_tensors="pt").input_ids
        out = model.generate(ids, do_sample=False, max_new_tokens=10)[0, ids.shape[1]:].tolist()
        assert out[EOS_AFTER] == family.list_only_eos and len(out) == EOS_AFTER + 1


@pytest.mark.parametrize("lean_forward", [True, False])
def test_a_torchao_int8_checkpoint_is_served_through_its_own_quantized_weights(tmp_path, lean_forward):
    """An int8 weight-only torchao checkpoint (saved as safetensors, reloaded from disk) runs on
    CPU through transformers' quantized weights on both forwards: its rows equal the quantized
    model's own forward, not the float model's."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    from tests.tiny_pair import tiny_model

    float_model = tiny_model("llama")
    float_model.save_pretrained(tmp_path / "float")
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.float32,
                                                     quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    quantized.save_pretrained(tmp_path / "int8")
    runner = load_runner({"path": str(tmp_path / "int8"), "dtype": "float32", "device": "cpu", "torch_threads": 1,
                          "max_sequences": 4, "lean_forward": lean_forward})
    assert (runner.lean is not None) == lean_forward
    history = list(range(3, 40))
    rows = Scheduler(runner).forward("s", history, num_rows=3)
    with torch.no_grad():
        own = AutoModelForCausalLM.from_pretrained(tmp_path / "int8")(torch.tensor([history])).logits[0, -3:]
        unquantized = float_model(torch.tensor([history])).logits[0, -3:]
    torch.testing.assert_close(rows, own, atol=1e-4, rtol=0)
    assert float((rows - unquantized).abs().max()) > 1e-3      # the int8 weights were used


def test_a_quantization_method_the_device_cannot_run_is_refused_naming_it(tmp_path):
    from tests.tiny_pair import tiny_model

    tiny_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
                                     "zero_point": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='awq' cannot be served on cpu"):
        load_causal_lm(str(tmp_path), dtype="float32", device="cpu")
