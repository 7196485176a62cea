"""Evaluate the default draft/target pair on a versioned prompt set; write evaluation.json and the card.

    .venv/bin/specserve eval-pair --card        # full evaluation, refreshes models/default/README.md
    .venv/bin/specserve eval-pair --card-only   # re-render the card from the existing evaluation.json

Everything is deterministic (fixed prompts, seeded sampling) except the latencies. Measured:

1. greedy speculative decoding with the draft at each K (default 4 and 8) over all prompts:
   per-token acceptance = accepted / drafted draft tokens (``SpecStats.acceptance_rate``) and mean
   tokens committed per target pass (the prefill pass included, ``SpecStats.mean_tokens_per_pass``),
   the per-token alpha fitted to those totals (policies.acceptance, as bench reports it), plus
   whether the output equals plain target greedy decoding (it must: decoding is lossless);
2. greedy agreement: the fraction of positions of the target's own greedy continuation where the
   draft's argmax equals the target's token (one draft forward per prompt, no speculation);
3. sampled speculative decoding (T=0.8, seeded per prompt) at K=4: acceptance and tokens per pass;
4. per-step latency of each model through ``ModelRunner``: one decode step (1 new token) on top of
   a warm KV cache of ``--latency-context`` tokens, fp32, ``--threads`` threads, median of N steps;
5. held-out loss / perplexity, copied from training.json and recomputed here (same windows as
   training: consecutive ``seq_len`` windows from the start of the held-out token stream);
6. greedy sample completions of the target for three prompts.

Prompts: a versioned prompt set (training.prompts), the same the benchmark uses: `--prompts v2`
(default: code from held-out stdlib files + prose) or `--prompts thirdparty` (third-party-style
code unlike the training corpus), or a path. Modules: prompts (training.prompts), measurements
(training.pair_measurements, training.step_latency, training.held_out), the card (training.model_card).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch

from specserve.common.config import DEFAULT_MODELS_DIR
from specserve.training.held_out import corpus_info, held_out_stream
from specserve.training.model_card import (
    ACCEPTANCE_THRESHOLD,
    CARD_COMMAND,
    DEFAULT_MAX_TOKENS,
    DEFAULT_NUM_PROMPTS,
    render_card,
)
from specserve.training.pair_measurements import (
    greedy_agreement,
    load_runners,
    model_info,
    ratio,
    runtime_environment,
    speculative_run,
    target_greedy,
    window_loss,
)
from specserve.training.prompts import DEFAULT_PROMPT_SET, load_prompt_set, select_prompts
from specserve.training.step_latency import step_latency

__all__ = ["CARD_COMMAND", "evaluate_pair", "load_training", "main", "render_card"]

SAMPLE_PROMPTS = (
    ("fibonacci", "def fibonacci(n):"),
    ("stack", "class Stack:\n    def __init__(self):"),
)


def evaluate_pair(models: str | Path, num_prompts: int = DEFAULT_NUM_PROMPTS, prompts: str = DEFAULT_PROMPT_SET,
                  max_tokens: int = DEFAULT_MAX_TOKENS, threads: int = 1,
                  ks: Sequence[int] = (4, 8), sampled_k: int = 4, temperature: float = 0.8, seed: int = 0,
                  latency_context: int = 128, latency_steps: int = 50, loss_windows: int = 64,
                  sample_tokens: int = 80, log=print) -> dict:
    """Run every measurement on the pair under `models` ({target,draft}/); return the JSON dict."""
    models = Path(models)
    torch.set_num_threads(threads)
    started = time.perf_counter()
    training = load_training(models)
    target, draft, tokenizer = load_runners(models, threads)
    prompt_set = load_prompt_set(prompts)
    chosen = select_prompts(prompt_set.prompts, num_prompts)
    prompts_ids = [tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in chosen]
    result: dict = {
        "format": 1,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "models": str(models),
        "settings": {"num_prompts": len(chosen), "max_tokens": max_tokens, "threads": threads,
                     "dtype": "float32", "device": "cpu", "ks": list(ks), "sampled_k": sampled_k,
                     "temperature": temperature, "seed": seed, "latency_context": latency_context,
                     "latency_steps": latency_steps, "loss_windows": loss_windows,
                     "sample_tokens": sample_tokens, "prompt_set": prompt_set.describe()},
        "environment": runtime_environment(threads),
        "corpus": corpus_info(),
        "models_info": {"target": model_info(target.runner), "draft": model_info(draft.runner)},
        "prompts": [{**p.to_dict(), "tokens": len(ids)} for p, ids in zip(chosen, prompts_ids)],
    }

    log(f"target-only greedy on {len(chosen)} prompts of set {prompt_set.name} ...")
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
    latency["target_over_draft"] = ratio(latency["target"]["median_ms"], latency["draft"]["median_ms"])
    latency["draft_over_target"] = ratio(latency["draft"]["median_ms"], latency["target"]["median_ms"])
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
                              "target": window_loss(target.runner.model, stream, seq_len, loss_windows),
                              "draft": window_loss(draft.runner.model, stream, seq_len, loss_windows)}
        log(f"  target {held['recomputed']['target']['loss']}, draft {held['recomputed']['draft']['loss']}")
    result["held_out"] = held

    samples = [*SAMPLE_PROMPTS, ("held-out", chosen[0].text)]
    result["samples"] = []
    for name, text in samples:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        output = target_greedy(target, draft, tokenizer, ids, sample_tokens, f"sample-{name}")
        source = chosen[0].source if name == "held-out" else None
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="specserve eval-pair", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=str(DEFAULT_MODELS_DIR),
                        help="directory with target/ and draft/ (default: the repo's models/default)")
    parser.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS)
    parser.add_argument("--prompts", default=DEFAULT_PROMPT_SET,
                        help="prompt set: v2 (held-out stdlib code + prose), thirdparty, or a JSON path")
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
            models, num_prompts=args.num_prompts, prompts=args.prompts, max_tokens=args.max_tokens, threads=args.threads,
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
