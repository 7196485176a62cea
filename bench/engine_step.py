"""What an engine step costs, eager against compiled: the draft's step (1 new token a row, batch 1
and 8) and the target's (1 and 5 new tokens a row, batch 1 and 8), each split into the forward
(the runner's model call, `_logits`: the view, the model, the LM head) and what the runner does
around it (the batch's plan, tables, layout, bookkeeping, the logits' copy).

    python -m specserve.bench.engine_step [--reps 60] [--threads 1] [--out bench/results/cpu-2core-engine-step.md]

Two pairs: the shipped default pair (models/default) and its Llama-3-width look-alike (the same
architecture at bench.look_alike's 128,256-token vocabulary, random weights). For each model
an eager runner and a compiled one (decoding.compiled_forward) serve the same rows, taking turns
every repetition so the box's drift hits both alike; each row holds CACHED tokens and every step
is rolled back after, so each repetition does the same work. Medians (ms) and the eager/compiled
ratio of the same run. The compiled runner's start-up compile is timed twice: in a fresh process
against the on-disk cache as it was ("first"; cold when the cache directory is new), and again
after torch._dynamo.reset() ("warm": inductor's artifacts found on disk, as a restart finds them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specserve.bench.look_alike import DEFAULT_PAIR, VOCAB_SIZE, timed_forwards
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.compiled_forward import compile_cache_dir
from specserve.decoding.model_runner import load_causal_lm
from specserve.decoding.scheduler import engine_for_model

CACHED = 100
SHAPES = {"draft": [(1, 1), (8, 1)], "target": [(1, 1), (1, 5), (8, 1), (8, 5)]}   # (rows, new tokens a row)


def models(pairs: list[str]) -> dict[tuple[str, str], torch.nn.Module]:
    """(pair, role) -> model: the default pair's checkpoints ("default") and their 128k-vocabulary
    look-alikes ("llama3-width")."""
    built = {}
    for role in ("draft", "target"):
        if "default" in pairs:
            built[("default", role)] = load_causal_lm(str(DEFAULT_PAIR / role), dtype="float32", device="cpu")
        if "llama3-width" in pairs:
            config = AutoConfig.from_pretrained(DEFAULT_PAIR / role, local_files_only=True)
            config.vocab_size, config.tie_word_embeddings = VOCAB_SIZE, False
            torch.manual_seed(0)
            # float32, as a CPU engine serves it (from_config would take config.json's float16).
            built[("llama3-width", role)] = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return built


def compiled_runner(model) -> tuple[object, dict]:
    """The compiled runner, and its start-up compile seconds: first (as the disk cache stood) and warm."""
    first = engine_for_model(model, max_sequences=16, enforce_eager=False)
    torch._dynamo.reset()
    warm = engine_for_model(model, max_sequences=16, enforce_eager=False)
    return warm, {"first_s": round(first.runner.step_forward.compile_seconds, 1),
                  "warm_s": round(warm.runner.step_forward.compile_seconds, 1),
                  "forward": warm.runner.step_forward.describe()}


def step_times(runners: dict, rows: int, new_tokens: int, reps: int, warmup: int = 5) -> dict:
    """Median ms of a step, its forward and the rest, per runner (name -> (engine, its
    timed_forwards seconds)), over reps taking turns; and the largest logit difference between
    the first two runners."""
    histories = {f"s{row}": [(7 * row + 3 * i) % 500 + 2 for i in range(CACHED)] for row in range(rows)}
    calls = [ForwardCall(seq_id, history + history[:new_tokens], new_tokens) for seq_id, history in histories.items()]
    samples = {name: {"step": [], "forward": []} for name in runners}
    logits = {}
    for runner, _ in runners.values():
        runner.forward_batch([ForwardCall(seq_id, history, 1) for seq_id, history in histories.items()])
    for rep in range(reps + warmup):
        for name, (runner, seconds) in (runners.items() if rep % 2 == 0 else reversed(runners.items())):
            seconds[0] = 0.0
            started = time.perf_counter()
            logits[name] = runner.forward_batch(calls)
            elapsed = time.perf_counter() - started
            if rep >= warmup:
                samples[name]["step"].append(elapsed)
                samples[name]["forward"].append(seconds[0])
            for seq_id, history in histories.items():
                runner.blocks.rollback(seq_id, len(history))
    result = {}
    for name, each in samples.items():
        step, forward = statistics.median(each["step"]) * 1e3, statistics.median(each["forward"]) * 1e3
        outside = statistics.median(s - f for s, f in zip(each["step"], each["forward"])) * 1e3
        result[name] = {"step_ms": round(step, 3), "forward_ms": round(forward, 3), "outside_ms": round(outside, 3)}
    first, second = list(logits.values())[:2]
    result["max_abs_logit_diff"] = max(float((a - b).abs().max()) for a, b in zip(first, second))
    return result


def table(rows: list[dict], startup: dict, command: str) -> str:
    lines = [f"# Engine step, eager vs compiled (CPU, {torch.get_num_threads()} torch thread)", "",
             f"`{command}`; {CACHED} cached tokens a row; medians, eager and compiled taking turns in one run; "
             "forward = the runner's model call, outside = the rest of the step.", "",
             "| pair | model | rows x new | eager step ms (forward + outside) | compiled step ms (forward + outside) "
             "| eager / compiled | max abs logit diff |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        eager, compiled = row["eager"], row["compiled"]
        lines.append(f"| {row['pair']} | {row['role']} | {row['rows']} x {row['new_tokens']} | "
                     f"{eager['step_ms']:.3f} ({eager['forward_ms']:.3f} + {eager['outside_ms']:.3f}) | "
                     f"{compiled['step_ms']:.3f} ({compiled['forward_ms']:.3f} + {compiled['outside_ms']:.3f}) | "
                     f"{row['eager_over_compiled']:.2f} | {row['max_abs_logit_diff']:.1e} |")
    lines += ["", "## Start-up compile (seconds; first: as the disk cache stood when the run began, warm: "
              "after torch._dynamo.reset(), inductor's artifacts on disk)", "",
              "| pair | model | first | warm |", "|---|---|---|---|"]
    for key, each in startup.items():
        pair, role = key.split("/")
        lines.append(f"| {pair} | {role} | {each['first_s']} | {each['warm_s']} |")
    return "\n".join(lines) + "\n"


def step_bench_arguments(module: str, description: str, argv: list[str] | None) -> tuple[argparse.Namespace, str]:
    """The step benches' command line (reps, threads, pairs, out), torch's threads set from it:
    (args, the command that reproduces the run)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("--reps", type=int, default=60, help="timed steps per runner and shape")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--pairs", nargs="+", default=["default", "llama3-width"], help="which pairs to run")
    parser.add_argument("--out", type=Path, help="write the table here (and its numbers beside it as .json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return args, f"python -m {module} --reps {args.reps} --threads {args.threads} --pairs {' '.join(args.pairs)}"


def main(argv: list[str] | None = None) -> None:
    args, command = step_bench_arguments("specserve.bench.engine_step", __doc__.splitlines()[0], argv)
    print(f"compile cache: {compile_cache_dir()}", flush=True)
    rows, startup = [], {}
    for (pair, role), model in models(args.pairs).items():
        compiled, startup[f"{pair}/{role}"] = compiled_runner(model)
        print(pair, role, startup[f"{pair}/{role}"], flush=True)
        runners = {"eager": (engine_for_model(model, max_sequences=16, enforce_eager=True), [0.0]),
                   "compiled": (compiled, [0.0])}
        runners = {name: (timed_forwards(runner, seconds), seconds) for name, (runner, seconds) in runners.items()}
        for batch, new_tokens in SHAPES[role]:
            row = {"pair": pair, "role": role, "rows": batch, "new_tokens": new_tokens,
                   **step_times(runners, batch, new_tokens, args.reps)}
            row["eager_over_compiled"] = round(row["eager"]["step_ms"] / row["compiled"]["step_ms"], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
        text = table(rows, startup, command)   # written after each model: a long run keeps what it measured
        if args.out:
            args.out.write_text(text)
            args.out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows,
                                                                "startup": startup}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
