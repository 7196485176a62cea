"""The held-out part of the training corpus, as the pair evaluation uses it: the split (cached),
its description for evaluation.json, and the start of its token stream (held-out loss, a realistic
context for latency)."""

from __future__ import annotations

import platform

import torch

from specserve.training.corpus import HELD_OUT_EVERY, SourceFile, iter_stdlib_files, split_corpus, stdlib_root

_CORPUS_CACHE: dict[str, tuple[list[SourceFile], list[SourceFile]]] = {}


def _split() -> tuple[list[SourceFile], list[SourceFile]]:
    key = str(stdlib_root())
    if key not in _CORPUS_CACHE:
        _CORPUS_CACHE[key] = split_corpus(iter_stdlib_files())
    return _CORPUS_CACHE[key]


def held_out_corpus() -> list[SourceFile]:
    return _split()[1]


def corpus_info() -> dict:
    train, held = _split()
    return {
        "source": "standard library .py files of the evaluating interpreter (no test suites, no "
                  "site-packages, files over 200 kB skipped)",
        "python": platform.python_version(),
        "stdlib_root": str(stdlib_root()),
        "files": len(train) + len(held),
        "train_files": len(train),
        "held_out_files": len(held),
        "held_out_chars": sum(len(f.text) for f in held),
        "held_out_rule": f"sha256(relative path)[:4] as little-endian int % {HELD_OUT_EVERY} == 0",
        "held_out_paths": [f.relative_path for f in held],
    }


def held_out_stream(tokenizer, min_tokens: int) -> torch.Tensor:
    """The start of training's held-out token stream (held-out files in order, each followed by
    EOS), at least min_tokens long if the corpus allows."""
    ids: list[int] = []
    for file in held_out_corpus():
        ids.extend(tokenizer(file.text, add_special_tokens=False, verbose=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
        if len(ids) >= min_tokens:
            break
    return torch.tensor(ids, dtype=torch.long)
