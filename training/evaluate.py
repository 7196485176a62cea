"""Evaluate the default draft/target pair on held-out stdlib prompts; write evaluation.json and the card.

    .venv/bin/specserve eval-pair --card        # full evaluation, refreshes models/default/README.md
    .venv/bin/specserve eval-pair --card-only   # re-render the card from the existing evaluation.json

Everything is deterministic (fixed prompts, seeded sampling) except the latencies. Measured:

1. greedy speculative decoding with the draft at each K (default 4 and 8) over all prompts:
   per-token acceptance = accepted / drafted draft tokens (``SpecStats.acceptance_rate``) and mean
   tokens committed per target pass (the prefill pass included, ``SpecStats.mean_tokens_per_pass``),
   plus whether the output equals plain target greedy decoding (it must: decoding is lossless);
2. greedy agreement: the fraction of positions of the target's own greedy continuation where the
   draft's argmax equals the target's token (one draft forward per prompt, no speculation);
3. sampled speculative decoding (T=0.8, seeded per prompt) at K=4: acceptance and tokens per pass;
4. per-step latency of each model through ``ModelRunner``: one decode step (1 new token) on top of
   a warm KV cache of ``--latency-context`` tokens, fp32, ``--threads`` threads, median of N steps;
5. held-out loss / perplexity, copied from training.json and recomputed here (same windows as
   training: consecutive ``seq_len`` windows from the start of the held-out token stream);
6. greedy sample completions of the target for three prompts.

Held-out prompts: every held-out file (``training.corpus.split_corpus``, by a hash of its path) is
cut at line starts into chunks of ``MIN_PROMPT_CHARS``..``MAX_PROMPT_CHARS`` characters that start
on a non-blank line and end at a line boundary (its newline dropped: the BPE merges it with the next indentation); all chunks of all held-out files are ordered by a
SHA-256 of ``path:first_line`` (a fixed pseudo-random order, so the first N are a uniform sample of
held-out code and the first N are a prefix of the first N+1) and the first N are taken.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.inprocess import step_latency_samples
from cluster.config import DEFAULT_MODELS_DIR
from training.corpus import HELD_OUT_EVERY, SourceFile, iter_stdlib_files, split_corpus, stdlib_root
from training.default_pair import held_out_loss

MIN_PROMPT_CHARS = 200
MAX_PROMPT_CHARS = 300
DEFAULT_NUM_PROMPTS = 16
DEFAULT_MAX_TOKENS = 96
ACCEPTANCE_THRESHOLD = 0.6  # the bar: greedy per-token acceptance at K=4 on held-out prompts
CARD_COMMAND = ".venv/bin/specserve eval-pair --card"
SAMPLE_PROMPTS = (
    ("fibonacci", "def fibonacci(n):"),
    ("stack", "class Stack:\n    def __init__(self):"),
)


# ----------------------------------------------------------------------------------------------
# Held-out prompts


@dataclass(frozen=True)
class Prompt:
    source: str   # relative path of the held-out stdlib file
    line: int     # 1-based line the prompt starts at
    text: str

    def to_dict(self) -> dict:
        return {"source": self.source, "line": self.line, "chars": len(self.text), "text": self.text}


def file_chunks(file: SourceFile, min_chars: int = MIN_PROMPT_CHARS,
                max_chars: int = MAX_PROMPT_CHARS) -> list[Prompt]:
    """Non-overlapping chunks of whole lines, min_chars..max_chars long, each starting on a
    non-blank line and ending with a newline; scanned greedily from the top of the file."""
    lines = file.text.splitlines(keepends=True)
    chunks: list[Prompt] = []
    i = 0
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        j, size = i, 0
        while j < len(lines) and size < min_chars:
            size += len(lines[j])
            j += 1
        text = "".join(lines[i:j])
        # Drop the final newline: the BPE merges it with the next line's indentation.
        if text.endswith("\n") and min_chars <= len(text) - 1 <= max_chars:
            chunks.append(Prompt(file.relative_path, i + 1, text[:-1]))
            i = j
        else:
            i += 1
    return chunks


def _order_key(prompt: Prompt) -> bytes:
    return hashlib.sha256(f"{prompt.source}:{prompt.line}".encode()).digest()


def build_prompts(num_prompts: int, held_out_files: Sequence[SourceFile] | None = None) -> list[Prompt]:
    """The first num_prompts held-out chunks in the fixed hash order (see the module docstring)."""
    if held_out_files is None:
        held_out_files = held_out_corpus()
    chunks = [chunk for file in held_out_files for chunk in file_chunks(file)]
    chunks.sort(key=_order_key)
    if len(chunks) < num_prompts:
        raise ValueError(f"only {len(chunks)} held-out prompts are available, {num_prompts} requested")
    return chunks[:num_prompts]


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


# ----------------------------------------------------------------------------------------------
# Measurements


def _load(models: Path, threads: int):
    from transformers import AutoTokenizer

    from decoding.model_runner import ModelRunner, check_compatible

    target = ModelRunner(str(models / "target"), dtype="float32", device="cpu", num_threads=threads)
    draft = ModelRunner(str(models / "draft"), dtype="float32", device="cpu", num_threads=threads)
    tokenizer = AutoTokenizer.from_pretrained(str(models / "target"))
    draft_tokenizer = AutoTokenizer.from_pretrained(str(models / "draft"))
    check_compatible(draft, target, draft_tokenizer, tokenizer)
    return target, draft, tokenizer


def model_info(runner) -> dict:
    config = runner.config
    return {
        "architecture": type(runner.model).__name__,
        "params": sum(p.numel() for p in runner.model.parameters()),
        "hidden_size": config.hidden_size,
        "num_layers": config.num_hidden_layers,
        "num_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": runner.vocab_size,
        "max_context": runner.max_context,
        "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
    }


def _new_state(request_id: str, prompt_ids: list[int], params, target, draft, tokenizer):
    from decoding.sequence import RequestState

    return RequestState(request_id=request_id, prompt_ids=prompt_ids, params=params,
                        eos_token_id=target.eos_token_id,
                        max_context=min(target.max_context, draft.max_context),
                        detokenize=lambda ids: tokenizer.decode(ids))


def target_greedy(target, draft, tokenizer, prompt_ids: list[int], max_tokens: int, request_id: str) -> list[int]:
    """Plain (target-only) greedy continuation."""
    from decoding.generate import generate
    from decoding.sampling import SamplingParams

    state = _new_state(request_id, prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                       target, draft, tokenizer)
    for _ in generate(target, state):
        pass
    return state.output_ids


def speculative_run(target, draft, tokenizer, prompts_ids: list[list[int]], k: int, max_tokens: int,
                    temperature: float, seed: int, tag: str,
                    reference: list[list[int]] | None = None) -> dict:
    """Speculative decoding of every prompt with the draft at depth k; aggregated SpecStats, the
    accepted-length histogram of the verification rounds, and (greedy) how many outputs equal
    the target-only greedy outputs in `reference`."""
    from decoding.generate import generate
    from decoding.proposers import DraftModelProposer
    from decoding.sampling import SamplingParams

    proposer = DraftModelProposer(draft)
    totals = {"rounds": 0, "num_drafted": 0, "num_accepted": 0, "num_emitted": 0, "target_passes": 0}
    histogram = [0] * (k + 1)   # rounds by number of accepted draft tokens (full-depth rounds only)
    rejections = 0              # rounds that stopped at a rejected draft token
    identical = 0
    started = time.perf_counter()
    for index, prompt_ids in enumerate(prompts_ids):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                seed=None if temperature == 0 else seed + index)
        state = _new_state(f"{tag}-{index}", prompt_ids, params, target, draft, tokenizer)
        stats = state.stats
        seen = (0, 0)

        def account() -> None:
            nonlocal seen, rejections
            drafted, accepted = stats.num_drafted - seen[0], stats.num_accepted - seen[1]
            seen = (stats.num_drafted, stats.num_accepted)
            if drafted:
                rejections += accepted < drafted
                if drafted == k:
                    histogram[accepted] += 1

        for _ in generate(target, state, proposer, num_draft_tokens=k):
            account()
        account()  # a last pass that committed nothing (EOS) is not yielded
        for key in totals:
            totals[key] += getattr(stats, key)
        if reference is not None and state.output_ids == reference[index]:
            identical += 1
    result = {
        "k": k,
        "temperature": temperature,
        **totals,
        "acceptance_rate": _ratio(totals["num_accepted"], totals["num_drafted"]),
        "mean_tokens_per_pass": _ratio(totals["num_emitted"], totals["target_passes"]),
        # P(draft token accepted | every earlier draft token of its round was): the per-position rate.
        "conditional_acceptance": _ratio(totals["num_accepted"], totals["num_accepted"] + rejections),
        "accepted_length_histogram": histogram,
        "wall_s": round(time.perf_counter() - started, 2),
    }
    if reference is not None:
        result["outputs_identical_to_target_greedy"] = identical
        result["num_prompts"] = len(prompts_ids)
    return result


def greedy_agreement(draft, prompts_ids: list[list[int]], continuations: list[list[int]]) -> dict:
    """Fraction of positions of the target's greedy continuation where the draft's argmax (given
    the same prefix) is the target's token."""
    positions = agreed = 0
    for index, (prompt_ids, continuation) in enumerate(zip(prompts_ids, continuations)):
        if not continuation:
            continue
        seq_id = f"agreement-{index}"
        logits = draft.forward(seq_id, prompt_ids + continuation[:-1], num_rows=len(continuation))
        draft.release(seq_id)
        predicted = torch.argmax(logits, dim=-1).tolist()
        positions += len(continuation)
        agreed += sum(int(a == b) for a, b in zip(predicted, continuation))
    return {"positions": positions, "agreed": agreed, "rate": _ratio(agreed, positions)}


def step_latency(runner, token_ids: list[int], context: int, steps: int, warmup: int = 3) -> dict:
    """Milliseconds of one single-token forward on top of a warm cache of `context` tokens
    (bench.inprocess.step_latency_samples: a real decode step plus a rollback each time)."""
    if len(token_ids) < context + 1:
        raise ValueError(f"need {context + 1} tokens to time a step at context {context}, got {len(token_ids)}")
    times = sorted(1000 * s for s in step_latency_samples(runner, list(token_ids[:context]), 1, steps, warmup))
    return {"median_ms": statistics.median(times), "p10_ms": times[len(times) // 10],
            "p90_ms": times[min(len(times) - 1, (9 * len(times)) // 10)], "mean_ms": statistics.fmean(times)}


def window_loss(model, stream: torch.Tensor, seq_len: int, max_windows: int) -> dict:
    """training.default_pair.held_out_loss, as the evaluation JSON records it."""
    loss, windows = held_out_loss(model, stream, seq_len, max_windows)
    return {"windows": windows, "loss": loss, "perplexity": None if loss is None else math.exp(loss)}


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def _environment(threads: int) -> dict:
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(),
            "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": threads}


def evaluate_pair(models: str | Path, num_prompts: int = DEFAULT_NUM_PROMPTS,
                  max_tokens: int = DEFAULT_MAX_TOKENS, threads: int = 1,
                  ks: Sequence[int] = (4, 8), sampled_k: int = 4, temperature: float = 0.8, seed: int = 0,
                  latency_context: int = 128, latency_steps: int = 50, loss_windows: int = 64,
                  sample_tokens: int = 80, log=print) -> dict:
    """Run every measurement on the pair under `models` ({target,draft}/); return the JSON dict."""
    models = Path(models)
    torch.set_num_threads(threads)
    started = time.perf_counter()
    training = load_training(models)
    target, draft, tokenizer = _load(models, threads)
    prompts = build_prompts(num_prompts)
    prompts_ids = [tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
    result: dict = {
        "format": 1,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "models": str(models),
        "settings": {"num_prompts": num_prompts, "max_tokens": max_tokens, "threads": threads,
                     "dtype": "float32", "device": "cpu", "ks": list(ks), "sampled_k": sampled_k,
                     "temperature": temperature, "seed": seed, "latency_context": latency_context,
                     "latency_steps": latency_steps, "loss_windows": loss_windows,
                     "sample_tokens": sample_tokens, "min_prompt_chars": MIN_PROMPT_CHARS,
                     "max_prompt_chars": MAX_PROMPT_CHARS},
        "environment": _environment(threads),
        "corpus": corpus_info(),
        "models_info": {"target": model_info(target), "draft": model_info(draft)},
        "prompts": [{**p.to_dict(), "tokens": len(ids)} for p, ids in zip(prompts, prompts_ids)],
    }

    log(f"target-only greedy on {len(prompts)} held-out prompts ...")
    reference = [target_greedy(target, draft, tokenizer, ids, max_tokens, f"reference-{i}")
                 for i, ids in enumerate(prompts_ids)]
    result["greedy_agreement"] = greedy_agreement(draft, prompts_ids, reference)
    log(f"  greedy agreement {result['greedy_agreement']['rate']:.3f}")

    result["greedy"] = {}
    for k in ks:
        run = speculative_run(target, draft, tokenizer, prompts_ids, k, max_tokens, 0.0, seed,
                              f"greedy-k{k}", reference=reference)
        result["greedy"][f"k{k}"] = run
        log(f"  greedy K={k}: acceptance {run['acceptance_rate']:.3f}, "
            f"{run['mean_tokens_per_pass']:.2f} tokens/pass ({run['wall_s']} s)")

    run = speculative_run(target, draft, tokenizer, prompts_ids, sampled_k, max_tokens, temperature, seed,
                          f"sampled-k{sampled_k}")
    result["sampled"] = run
    log(f"  sampled T={temperature} K={sampled_k}: acceptance {run['acceptance_rate']:.3f}, "
        f"{run['mean_tokens_per_pass']:.2f} tokens/pass ({run['wall_s']} s)")

    seq_len = int(training.get("config", {}).get("seq_len", 256)) if training else 256
    seq_len = min(seq_len, target.max_context, draft.max_context)
    need = max(latency_context + 1, (loss_windows + 1) * seq_len + 1)
    stream = held_out_stream(tokenizer, need)
    log(f"per-step latency at context {latency_context} ({latency_steps} steps) ...")
    latency = {"context": latency_context, "threads": threads, "dtype": "float32", "steps": latency_steps,
               "target": step_latency(target, stream.tolist(), latency_context, latency_steps),
               "draft": step_latency(draft, stream.tolist(), latency_context, latency_steps)}
    latency["target_over_draft"] = _ratio(latency["target"]["median_ms"], latency["draft"]["median_ms"])
    latency["draft_over_target"] = _ratio(latency["draft"]["median_ms"], latency["target"]["median_ms"])
    result["latency"] = latency
    log(f"  target {latency['target']['median_ms']:.2f} ms, draft {latency['draft']['median_ms']:.2f} ms "
        f"(ratio {latency['target_over_draft']:.1f})")

    held = {"from_training": None, "recomputed": None}
    if training and "held_out_loss" in training:
        held["from_training"] = {name: {"loss": training["held_out_loss"][name],
                                        "perplexity": training.get("held_out_perplexity", {}).get(name)}
                                 for name in ("target", "draft") if name in training["held_out_loss"]}
    if loss_windows > 0:
        log(f"held-out loss over {loss_windows} windows of {seq_len} tokens ...")
        held["recomputed"] = {"seq_len": seq_len, "dtype": "float32",
                              "target": window_loss(target.model, stream, seq_len, loss_windows),
                              "draft": window_loss(draft.model, stream, seq_len, loss_windows)}
        log(f"  target {held['recomputed']['target']['loss']}, draft {held['recomputed']['draft']['loss']}")
    result["held_out"] = held

    samples = [*SAMPLE_PROMPTS, ("held-out", prompts[0].text)]
    result["samples"] = []
    for name, text in samples:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        output = target_greedy(target, draft, tokenizer, ids, sample_tokens, f"sample-{name}")
        source = prompts[0].source if name == "held-out" else None
        result["samples"].append({"name": name, "source": source, "prompt": text,
                                  "completion": tokenizer.decode(output), "tokens": len(output)})

    k4 = result["greedy"].get("k4")
    result["criterion"] = {"metric": "greedy per-token acceptance at K=4", "threshold": ACCEPTANCE_THRESHOLD,
                           "value": None if k4 is None else k4["acceptance_rate"],
                           "met": None if k4 is None else k4["acceptance_rate"] >= ACCEPTANCE_THRESHOLD}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def load_training(models: Path) -> dict | None:
    path = Path(models) / "training.json"
    return json.loads(path.read_text()) if path.exists() else None


# ----------------------------------------------------------------------------------------------
# Model card

CARD_TEMPLATE = """\
# specserve default pair: `target` + `draft`

A tiny Python-code **target** language model and a much smaller **draft** distilled from it, the
default pair of specserve's lossless speculative decoding. The draft only proposes tokens; every
token served is verified by the target, so outputs follow the target's distribution exactly
(greedy outputs are identical to plain target decoding). What the draft buys is speed: the
fraction of its guesses the target accepts.

> The numbers below are filled in by `training/evaluate.py` from `evaluation.json` and
> `training.json`. Rerun the evaluation and refresh this card with
> `{command}` (it took {eval_time} last time, {eval_threads} CPU thread(s)); `--card-only` re-renders it
> from the existing `evaluation.json`. Last evaluated {created} on {eval_cpu}.
{status_note}
## Summary

| | value |
|---|---|
| greedy per-token acceptance, K=4 (bar: >= {threshold:.2f}) | **{k4_acceptance}** ({criterion}) |
| greedy mean tokens per target pass, K=4 / K=8 | {k4_tpp} / {k8_tpp} |
| greedy per-token acceptance, K=8 | {k8_acceptance} |
| sampled (T={temperature}) per-token acceptance, K={sampled_k} | {sampled_acceptance} |
| greedy agreement (draft argmax = target greedy token) | {agreement} |
| held-out loss / perplexity, target | {target_loss} / {target_ppl} |
| held-out loss / perplexity, draft | {draft_loss} / {draft_ppl} |
| per-step CPU latency, target / draft (1 token, context {latency_context}) | {target_ms} ms / {draft_ms} ms (ratio {latency_ratio}) |

## Files

- `target/`, `draft/`: Hugging Face `LlamaForCausalLM` checkpoints (fp16 safetensors), each with
  the shared tokenizer beside it; load them with `AutoModelForCausalLM.from_pretrained(path)`.
- `tokenizer/`: the tokenizer alone. `training.json`: training config, parameter counts, tokens,
  held-out loss, loss log. `evaluation.json`: everything measured below, with the prompts.

## Training data

The `.py` files of the Python {python} standard library that the training interpreter ships
(`{stdlib_root}`): {files} files after skipping `test`/`tests` packages, `site-packages` and files
over 200 kB, nothing downloaded. A file is **held out** when {held_out_rule} (one in
{held_out_every}): {train_files} training files ({train_tokens} tokens), {held_out_files} held-out
files ({held_out_tokens} tokens), never seen in training. Files are joined into one stream,
separated by `<|endoftext|>`.

## Tokenizer

Byte-level BPE (Hugging Face `tokenizers`) trained on the training files only, vocabulary
{vocab_size} including the single special token `<|endoftext|>` (id 0: BOS, EOS and padding).
Byte-level, so any text round-trips.

## Architecture

Both are Llama decoders (RMSNorm, SwiGLU MLP, rotary positions, tied input/output embeddings),
sharing the tokenizer so draft tokens are target tokens.

| | target | draft |
|---|---|---|
| parameters | {target_params} | {draft_params} |
| hidden size | {target_hidden} | {draft_hidden} |
| layers | {target_layers} | {draft_layers} |
| attention heads | {target_heads} | {draft_heads} |
| MLP size | {target_intermediate} | {draft_intermediate} |
| context (positions) | {target_context} | {draft_context} |

## Training recipe

`.venv/bin/specserve train-default` (`training/default_pair.py`), deterministic given the seed
({seed}), resumable from `.train-work/`:

1. **Joint phase**, {joint_steps} steps: each step the target takes an AdamW step on next-token
   cross-entropy (peak lr {target_lr}), and the draft, in the same step and on the same batch, an
   AdamW step on the forward KL(p_target || q_draft) against the target's *detached* logits
   (peak lr {draft_lr}): online distillation that reuses the target forward training already pays for.
2. **Distillation phase**, {distill_steps} steps: the target is frozen and the draft keeps
   distilling from it, so it matches the *final* target rather than its earlier selves.
{distillation_step}

Batches of {batch_size} random windows of {seq_len} tokens; warmup {warmup_steps} steps then cosine
decay to 10 %; weight decay 0.1, gradient clipping 1.0. Tokens seen: {tokens_seen} per model.
Final logged training loss: target {final_target_loss}, draft KL {final_draft_kl}.
Training wall time: {train_wall}. Hardware: {train_hardware}.

## Evaluation

On the first {num_prompts} held-out prompts: held-out files cut at line starts into chunks of
{min_chars}-{max_chars} characters that start on a non-blank line and end at a line boundary (newline dropped), in a
fixed pseudo-random order (SHA-256 of `path:line`), i.e. a uniform sample of held-out code. Each
prompt is continued for up to {max_tokens} tokens, fp32 on CPU, {threads} torch thread(s).

| decoding | K | per-token acceptance | mean tokens / target pass | P(accept \\| earlier accepted) | output = target greedy |
|---|---|---|---|---|---|
{spec_rows}

- *per-token acceptance* = accepted draft tokens / drafted tokens (the issue's metric);
  *tokens per target pass* counts the prefill pass too; *P(accept | earlier accepted)* is
  accepted / (accepted + rejections), the per-position acceptance. Greedy agreement along the
  target's own greedy continuations: {agreement} ({agreement_positions} positions).
- Sampled: T={temperature}, no top-k/top-p, seed {eval_seed} + prompt index. The speculative
  output still follows the target's T={temperature} distribution exactly (rejection sampling).
- Held-out loss (nats/token) over {loss_windows} consecutive {loss_seq_len}-token windows from
  the start of the held-out stream. {held_out_detail}
- Per-step latency: one single-token forward through `decoding.model_runner.ModelRunner` on top of a
  warm KV cache of {latency_context} tokens (including the cache rollback a speculative step does),
  fp32, {latency_threads} thread, median of {latency_steps} steps: target {target_ms} ms
  (p10-p90 {target_p10}-{target_p90}), draft {draft_ms} ms (p10-p90 {draft_p10}-{draft_p90});
  draft/target cost ratio {cost_ratio}. Measured on {eval_cpu} ({eval_cpus} cores, shared);
  wall-clock numbers move with machine load.

## Sample completions

Target alone, greedy, up to {sample_tokens} tokens (speculative decoding gives the same text):

{samples}

## License

Trained on the source code of the Python standard library, distributed under the Python Software
Foundation License; the weights are a derivative of that code and are shipped for testing and
demonstrating specserve. The models can reproduce fragments of that PSF-licensed code.

## Limitations

- Tiny ({target_params_short} / {draft_params_short} parameters) and trained on CPU for minutes to hours: expect
  plausible-looking but frequently wrong Python, repetition and invented names. Not for any real use.
- Code only: trained on the standard library, nothing else; prose, other languages and chat
  prompts are out of distribution.
- Context {target_context} positions but trained on {seq_len}-token windows: quality beyond ~{seq_len}
  tokens of context is untested.
- Acceptance depends on the text: repetitive code (tables, boilerplate) is accepted far more
  often than novel logic, so the per-prompt spread is large. The target's greedy output often
  falls into loops (see the samples), which a draft trained on its continuations predicts well:
  greedy acceptance here is higher than a stronger, less repetitive target would see with a
  draft this small; the sampled row is the more conservative figure.
"""


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return "n/a"
        return f"{value:.{digits}f}"
    return str(value)


def _count(value) -> str:
    return "n/a" if value is None else f"{int(value):,}"


def _short(params) -> str:
    if params is None:
        return "n/a"
    return f"{params / 1e6:.1f}M"


def _duration(seconds) -> str | None:
    if seconds is None:
        return None
    seconds = float(seconds)
    hours, rest = divmod(int(round(seconds)), 3600)
    minutes = rest // 60
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _fence(text: str) -> str:
    return "````" if "```" in text else "```"


def _samples_markdown(samples: list[dict]) -> str:
    blocks = []
    for sample in samples:
        prompt_lines = sample["prompt"].count("\n") or 1
        source = f" (from `{sample['source']}`)" if sample.get("source") else ""
        body = sample["prompt"] + sample["completion"]
        fence = _fence(body)
        blocks.append(f"**{sample['name']}**{source}: the first {prompt_lines} line(s) are the prompt, "
                      f"then {sample['tokens']} generated tokens.\n\n{fence}python\n{body.rstrip()}\n{fence}")
    return "\n\n".join(blocks)


def _distillation_step(training: dict) -> str:
    """The card's third recipe step, from training.json's ``draft_distillation`` (written by
    training/distill.py); empty when the draft was never distilled on target generations."""
    run = training.get("draft_distillation")
    if not run:
        return ""
    cfg, agreement = run["config"], run["held_out_greedy_agreement"]
    return (
        f"3. **On-policy distillation**, {_count(cfg['steps'])} steps (`.venv/bin/specserve distill-draft`, "
        f"`training/distill.py`, resumable from `.distill-work/`): the target writes its own continuations "
        f"of {cfg['prompt_tokens']}-token prompts cut from the training files, "
        f"{_count(cfg['greedy_sequences'])} greedy and {_count(cfg['sampled_sequences'])} sampled at "
        f"T={cfg['temperature']}, {cfg['new_tokens']} tokens each, and the draft learns the forward KL to the "
        f"target's distributions along them (one batch in {cfg['corpus_every']} is a plain corpus window"
        f"; batch {cfg['batch_size']}, peak lr {cfg['lr']}, cosine). Speculative decoding asks the "
        f"draft to predict the target *while the target generates*, so that is the text it trains on "
        f"(DistillSpec's teacher-generated data). Greedy agreement on held-out target continuations: "
        f"{_fmt(agreement['before'])} before, {_fmt(agreement['after'])} after. "
        f"{_count(run['tokens_seen'])} tokens, {_duration(run['train_seconds'])} on {run['hardware']} "
        f"({run['torch_threads']} torch threads).")


def card_fields(evaluation: dict, training: dict | None) -> dict:
    """The template's fields from evaluation.json and training.json (None: not trained yet)."""
    training = training or {}
    config = training.get("config", {})
    settings = evaluation["settings"]
    corpus = evaluation["corpus"]
    target_info, draft_info = evaluation["models_info"]["target"], evaluation["models_info"]["draft"]
    greedy, sampled, latency = evaluation["greedy"], evaluation["sampled"], evaluation["latency"]
    k4, k8 = greedy.get("k4", {}), greedy.get("k8", {})
    criterion = evaluation.get("criterion", {})
    held = evaluation.get("held_out", {})
    recomputed = held.get("recomputed") or {}
    from_training = held.get("from_training") or {}

    def loss_of(name: str) -> tuple[float | None, float | None]:
        if name in from_training:
            return from_training[name]["loss"], from_training[name].get("perplexity")
        if recomputed.get(name):
            return recomputed[name]["loss"], recomputed[name]["perplexity"]
        return None, None

    detail = []
    if from_training:
        detail.append("Summary values are training's own (fp32 weights before the fp16 export).")
    if recomputed:
        detail.append("Recomputed here from the fp16 checkpoints in fp32: target "
                      f"{_fmt(recomputed['target']['loss'])} (ppl {_fmt(recomputed['target']['perplexity'], 2)}), "
                      f"draft {_fmt(recomputed['draft']['loss'])} (ppl {_fmt(recomputed['draft']['perplexity'], 2)}) "
                      f"over {recomputed['target']['windows']} windows.")
    if not detail:
        detail.append("Not available.")

    spec_rows = []
    for run in list(greedy.values()) + [sampled]:
        mode = "greedy" if run["temperature"] == 0 else f"sampled T={run['temperature']}"
        identical = (f"{run['outputs_identical_to_target_greedy']}/{run['num_prompts']}"
                     if "outputs_identical_to_target_greedy" in run else "n/a")
        spec_rows.append(f"| {mode} | {run['k']} | {_fmt(run['acceptance_rate'])} | "
                         f"{_fmt(run['mean_tokens_per_pass'], 2)} | {_fmt(run['conditional_acceptance'])} | {identical} |")

    log = training.get("log") or []
    last = log[-1] if log else {}
    # The last logged target loss of the joint phase (the distillation phase logs NaN for it).
    target_losses = [r["target_loss"] for r in log if isinstance(r.get("target_loss"), float)
                     and not math.isnan(r["target_loss"])]
    wall = _duration(training.get("train_seconds"))  # written by training/default_pair.py
    if wall and training.get("train_seconds_note"):
        wall += f" ({training['train_seconds_note']})"
    hardware = training.get("hardware")
    if hardware is None and training:
        hardware = f"device `{training.get('device', '?')}`, {training.get('torch_threads', '?')} torch thread(s)"
    target_loss, target_ppl = loss_of("target")
    draft_loss, draft_ppl = loss_of("draft")
    met = criterion.get("met")
    notes = []
    if not training:
        notes.append("there was no `training.json` beside the models when this card was rendered: the "
                     "pair was evaluated from an unfinished training checkpoint, and the training details "
                     "below are missing")
    if settings["num_prompts"] < DEFAULT_NUM_PROMPTS or settings["max_tokens"] < DEFAULT_MAX_TOKENS:
        notes.append(f"this is a reduced evaluation ({settings['num_prompts']} prompts, up to "
                     f"{settings['max_tokens']} tokens each; the defaults are {DEFAULT_NUM_PROMPTS} and "
                     f"{DEFAULT_MAX_TOKENS})")
    status_note = ""
    if notes:
        status_note = ("\n> **Preliminary numbers**: " + "; ".join(notes)
                       + f". Rerun `{CARD_COMMAND}` on the finished pair.\n")
    return {
        "status_note": status_note,
        "distillation_step": _distillation_step(training),
        "command": CARD_COMMAND,
        "eval_time": _duration(evaluation.get("wall_s")) or "n/a",
        "eval_threads": settings["threads"],
        "created": evaluation.get("created", "n/a"),
        "eval_cpu": evaluation["environment"].get("cpu", "n/a"),
        "eval_cpus": evaluation["environment"].get("cpu_count", "n/a"),
        "threshold": criterion.get("threshold", ACCEPTANCE_THRESHOLD),
        "criterion": "met" if met else ("not met" if met is False else "n/a"),
        "k4_acceptance": _fmt(k4.get("acceptance_rate")),
        "k8_acceptance": _fmt(k8.get("acceptance_rate")),
        "k4_tpp": _fmt(k4.get("mean_tokens_per_pass"), 2),
        "k8_tpp": _fmt(k8.get("mean_tokens_per_pass"), 2),
        "temperature": sampled["temperature"],
        "sampled_k": sampled["k"],
        "sampled_acceptance": _fmt(sampled["acceptance_rate"]),
        "agreement": _fmt(evaluation["greedy_agreement"]["rate"]),
        "agreement_positions": _count(evaluation["greedy_agreement"]["positions"]),
        "target_loss": _fmt(target_loss), "target_ppl": _fmt(target_ppl, 2),
        "draft_loss": _fmt(draft_loss), "draft_ppl": _fmt(draft_ppl, 2),
        "latency_context": latency["context"],
        "latency_threads": latency["threads"],
        "latency_steps": latency["steps"],
        "target_ms": _fmt(latency["target"]["median_ms"], 2),
        "draft_ms": _fmt(latency["draft"]["median_ms"], 2),
        "target_p10": _fmt(latency["target"]["p10_ms"], 2), "target_p90": _fmt(latency["target"]["p90_ms"], 2),
        "draft_p10": _fmt(latency["draft"]["p10_ms"], 2), "draft_p90": _fmt(latency["draft"]["p90_ms"], 2),
        "latency_ratio": _fmt(latency["target_over_draft"], 1),
        "cost_ratio": _fmt(latency["draft_over_target"], 3),
        "python": corpus["python"],
        "stdlib_root": corpus["stdlib_root"],
        "files": _count(corpus["files"]),
        "train_files": _count(corpus["train_files"]),
        "held_out_files": _count(corpus["held_out_files"]),
        "held_out_rule": f"`{corpus['held_out_rule']}`",
        "held_out_every": HELD_OUT_EVERY,
        "train_tokens": _count(training.get("train_tokens")),
        "held_out_tokens": _count(training.get("held_out_tokens")),
        "vocab_size": _count(target_info["vocab_size"]),
        "target_params": _count(target_info["params"]), "draft_params": _count(draft_info["params"]),
        "target_params_short": _short(target_info["params"]), "draft_params_short": _short(draft_info["params"]),
        "target_hidden": target_info["hidden_size"], "draft_hidden": draft_info["hidden_size"],
        "target_layers": target_info["num_layers"], "draft_layers": draft_info["num_layers"],
        "target_heads": target_info["num_heads"], "draft_heads": draft_info["num_heads"],
        "target_intermediate": target_info["intermediate_size"],
        "draft_intermediate": draft_info["intermediate_size"],
        "target_context": target_info["max_context"], "draft_context": draft_info["max_context"],
        "seed": config.get("seed", "n/a"),
        "eval_seed": settings.get("seed", "n/a"),
        "joint_steps": _count(config.get("joint_steps")),
        "distill_steps": _count(config.get("distill_steps")),
        "target_lr": config.get("target_lr", "n/a"),
        "draft_lr": config.get("draft_lr", "n/a"),
        "batch_size": config.get("batch_size", "n/a"),
        "seq_len": config.get("seq_len", "n/a"),
        "warmup_steps": config.get("warmup_steps", "n/a"),
        "tokens_seen": _count(training.get("tokens_seen")),
        "final_target_loss": _fmt(target_losses[-1] if target_losses else None),
        "final_draft_kl": _fmt(last.get("draft_kl")),
        "train_wall": wall or "not recorded in training.json",
        "train_hardware": hardware or "not recorded (no training.json)",
        "num_prompts": settings["num_prompts"],
        "min_chars": settings.get("min_prompt_chars", MIN_PROMPT_CHARS),
        "max_chars": settings.get("max_prompt_chars", MAX_PROMPT_CHARS),
        "max_tokens": settings["max_tokens"],
        "threads": settings["threads"],
        "spec_rows": "\n".join(spec_rows),
        "loss_windows": recomputed.get("target", {}).get("windows", settings.get("loss_windows", "n/a")),
        "loss_seq_len": recomputed.get("seq_len", config.get("seq_len", "n/a")),
        "held_out_detail": " ".join(detail),
        "sample_tokens": settings.get("sample_tokens", "n/a"),
        "samples": _samples_markdown(evaluation.get("samples", [])),
    }


def render_card(evaluation: dict, training: dict | None) -> str:
    return CARD_TEMPLATE.format(**card_fields(evaluation, training))


# ----------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="specserve eval-pair", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=str(DEFAULT_MODELS_DIR),
                        help="directory with target/ and draft/ (default: the repo's models/default)")
    parser.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS)
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json-out", help="default: <models>/evaluation.json")
    parser.add_argument("--card", action="store_true", help="also write/refresh <models>/README.md")
    parser.add_argument("--card-only", action="store_true",
                        help="only re-render <models>/README.md from the existing evaluation JSON")
    parser.add_argument("--ks", default="4,8", help="greedy draft depths, comma-separated")
    parser.add_argument("--sampled-k", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency-context", type=int, default=128)
    parser.add_argument("--latency-steps", type=int, default=50)
    parser.add_argument("--loss-windows", type=int, default=64, help="0 skips recomputing held-out loss")
    parser.add_argument("--sample-tokens", type=int, default=80)
    args = parser.parse_args(argv)

    models = Path(args.models)
    json_out = Path(args.json_out) if args.json_out else models / "evaluation.json"
    if args.card_only:
        evaluation = json.loads(json_out.read_text())
    else:
        evaluation = evaluate_pair(
            models, num_prompts=args.num_prompts, max_tokens=args.max_tokens, threads=args.threads,
            ks=[int(k) for k in args.ks.split(",") if k.strip()], sampled_k=args.sampled_k,
            temperature=args.temperature, seed=args.seed, latency_context=args.latency_context,
            latency_steps=args.latency_steps, loss_windows=args.loss_windows, sample_tokens=args.sample_tokens,
            log=lambda message: print(message, flush=True))
        evaluation["command"] = " ".join(["specserve", "eval-pair", *(argv if argv is not None else sys.argv[1:])])
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(evaluation, indent=1) + "\n")
        print(f"wrote {json_out}", flush=True)
    if args.card or args.card_only:
        card_path = models / "README.md"
        card_path.write_text(render_card(evaluation, load_training(models)))
        print(f"wrote {card_path}", flush=True)
    criterion = evaluation.get("criterion", {})
    print(json.dumps({"greedy": {k: {m: v[m] for m in ("acceptance_rate", "mean_tokens_per_pass")}
                                 for k, v in evaluation["greedy"].items()},
                      "sampled_acceptance": evaluation["sampled"]["acceptance_rate"],
                      "greedy_agreement": evaluation["greedy_agreement"]["rate"],
                      "latency_ms": {m: evaluation["latency"][m]["median_ms"] for m in ("target", "draft")},
                      "criterion_met": criterion.get("met")}, indent=1), flush=True)
    return evaluation


if __name__ == "__main__":
    main()
