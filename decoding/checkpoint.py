"""What a Hugging Face checkpoint folder says about serving it, read once from its files: the EOS
ids, the generation defaults, the context length, the dtype and device to load it in, and whether
its weights are in a format we load. docs/real-checkpoints.md has the published values.

Why its own module: these facts come from three files (config.json, generation_config.json,
tokenizer_config.json) that disagree on real checkpoints (Llama-3's chat turns end with an EOS only
generation_config.json lists), and the ingress, the router and the engines must agree on them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# dtype "auto" on CPU: float32, measured faster than bf16 on this box (docs/real-checkpoints.md).
CPU_AUTO_DTYPE = "float32"
# generation_config.json fields that become defaults of the request fields of the same name, as
# vLLM's `--generation-config auto` (a new sampling field is one more name here).
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _text_config(folder: str | Path) -> dict[str, Any]:
    config = _json(Path(folder) / "config.json")
    return config.get("text_config") or config


def quantization_method(model_path: str | Path) -> str | None:
    """config.json's quantization_config.quant_method, or None for an unquantized checkpoint."""
    return (_json(Path(model_path) / "config.json").get("quantization_config") or {}).get("quant_method")


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, Iterable) and not isinstance(value, str):
        return {int(v) for v in value}
    return {int(value)}


def eos_token_ids(model_path: str | Path, tokenizer=None) -> frozenset[int]:
    """Every id that ends a request: generation_config.json's EOS list, config.json's EOS and the
    tokenizer's EOS, united (vLLM and HF `generate` stop on generation_config's list)."""
    folder = Path(model_path)
    ids = _ids(_json(folder / "generation_config.json").get("eos_token_id"))
    ids |= _ids(_text_config(folder).get("eos_token_id"))
    if tokenizer is not None:
        ids |= _ids(getattr(tokenizer, "eos_token_id", None))
    return frozenset(ids)


def generation_defaults(model_path: str | Path) -> dict[str, Any]:
    """The sampling defaults generation_config.json sets (GENERATION_DEFAULT_FIELDS only), for the
    fields a request leaves out. As vLLM, `do_sample` is not read: a temperature is a temperature."""
    generation = _json(Path(model_path) / "generation_config.json")
    return {name: generation[name] for name in GENERATION_DEFAULT_FIELDS if generation.get(name) is not None}


def context_length(model_path: str | Path) -> int:
    """The model's context: max_position_embeddings (vLLM's default max_model_len)."""
    config = _text_config(model_path)
    if "max_position_embeddings" not in config:
        raise ValueError(f"{model_path}: config.json has no max_position_embeddings; set max_model_len")
    return int(config["max_position_embeddings"])


def max_model_len(model_path: str | Path, configured: int | None = None) -> int:
    """The longest prompt + completion served: `configured` (ModelSpec.max_model_len), at most the
    model's context, which is the default."""
    context = context_length(model_path)
    if configured is not None and configured > context:
        raise ValueError(f"max_model_len {configured} exceeds the context of {model_path} ({context}, "
                         "max_position_embeddings)")
    return configured or context


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when this process sees a GPU, else 'cpu'; anything else as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def checkpoint_dtype(model_path: str | Path) -> torch.dtype:
    """The dtype a checkpoint's weights were saved in (its config's dtype; float32 if unnamed)."""
    config = _text_config(model_path)
    named = str(config.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
    return DTYPES.get(named, torch.float32)


def resolve_dtype(dtype: str, model_path: str | Path, device: str) -> torch.dtype:
    """'auto' -> the checkpoint's torch_dtype on a GPU, CPU_AUTO_DTYPE on CPU (float16 and bf16
    matrix products are slower there); a named dtype as given."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if not str(device).startswith("cuda"):
        return DTYPES[CPU_AUTO_DTYPE]
    return checkpoint_dtype(model_path)


def check_weight_files(model_path: str | Path) -> None:
    """Refuse a folder whose only weights are Mistral-native (`consolidated*.safetensors`): those
    names are not Hugging Face's, so the model would load with random weights. Beside HF shards
    and their index the file is ignored: transformers reads the index (or model.safetensors) and
    nothing else (tests/test_checkpoints.py checks the loaded weights are the shards')."""
    folder = Path(model_path)
    if not folder.is_dir():
        return
    hf_weights = [p for p in folder.iterdir() if p.name.startswith(("model", "pytorch_model"))
                  and p.suffix in (".safetensors", ".bin", ".json") and p.name != "model_card.json"]
    native = sorted(p.name for p in folder.glob("consolidated*.safetensors"))
    if native and not hf_weights:
        raise ValueError(f"{folder}: only Mistral-native weights ({', '.join(native)}); specserve loads the "
                         "Hugging Face format (model*.safetensors with model.safetensors.index.json)")
