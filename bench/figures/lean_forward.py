"""What the lean decoder forward saves per step: ms per forward of the default pair through
decoding.lean_forward against transformers' own forward, over the same slot KV cache.

    python -m specserve.bench.figures.lean_forward [--device cpu] [--dtype float32] [--threads 1] [--reps 200]

With `--baseline-tree DIR` (a checkout of the code before a change to the lean forward, e.g. a
git worktree) a third runner serves the same model through DIR's lean forward (its
decoding/lean_forward.py, over this tree's runner and cache), so a change to the lean forward is
measured against the code before it in one process, taking turns step by step.

Shapes an engine sees: one sequence with `--cached` tokens (145) taking 1, 5 or 8 new tokens (a
draft step, a K=4 verify, a K=7 verify), and 4 sequences taking 5 each (batched verifies). The two
runners take turns every repetition, so a busy machine slows them alike; the largest difference
between their logits is reported too. Writes bench/results/lean-forward-<device>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from specserve.decoding.batched_runner import BatchedModelRunner
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.model_runner import load_causal_lm
from specserve.decoding.scheduler import Scheduler

MODELS = Path(__file__).resolve().parents[2] / "models" / "default"
SHAPES = ((1, 1), (1, 5), (1, 8), (4, 5))  # (sequences, new tokens each)


def engine(path: Path, dtype: str, device: str, lean: bool, lean_class=None) -> Scheduler:
    """An engine over the model at path: the lean forward (lean_class's where given: a baseline
    tree's LeanDecoder) or transformers' own."""
    built = BatchedModelRunner.__new__(BatchedModelRunner)
    built._init_from_model(load_causal_lm(str(path), dtype=dtype, device=device), max_sequences=8,
                           model_path=str(path), lean=lean)
    if lean_class is not None:
        built.lean = lean_class(built.model)
    return Scheduler(built)


def baseline_lean_class(tree: str):
    """The LeanDecoder class of another checkout's decoding/lean_forward.py, loaded under a module
    name of its own (its imports resolve to this tree's specserve)."""
    path = Path(tree) / "decoding" / "lean_forward.py"
    spec = importlib.util.spec_from_file_location("_baseline_lean_forward", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # where dataclasses look their module up
    spec.loader.exec_module(module)
    return module.LeanDecoder


def forwards_in_turns(runners: dict, histories: dict[str, list[int]], new_tokens: int, reps: int,
                      warmup: int = 5) -> tuple[dict[str, float], dict[str, list[torch.Tensor]]]:
    """Every runner holds histories, then runs the same forward of new_tokens more tokens a
    sequence, the runners taking turns every repetition (a busy machine slows them alike), each
    rolling back after each; -> (median ms per forward by runner, each runner's last logits)."""
    calls = [ForwardCall(seq_id, history + history[:new_tokens], new_tokens) for seq_id, history in histories.items()]
    times: dict[str, list[float]] = {name: [] for name in runners}
    logits = {}
    for each in runners.values():
        each.forward_batch([ForwardCall(seq_id, history, 1) for seq_id, history in histories.items()])
    for rep in range(reps + warmup):   # the order reversed every other repetition
        for name, each in (runners.items() if rep % 2 == 0 else reversed(runners.items())):
            started = time.perf_counter()
            logits[name] = each.forward_batch(calls)
            if rep >= warmup:
                times[name].append(time.perf_counter() - started)
            for seq_id, history in histories.items():
                each.blocks.rollback(seq_id, len(history))
    return {name: 1000 * statistics.median(values) for name, values in times.items()}, logits


def time_shape(runners: dict[str, Scheduler], rows: int, new_tokens: int, cached: int,
               reps: int) -> dict[str, float]:
    """Median ms per forward of each runner, and the largest logit difference between them."""
    histories = {f"s{row}": [(7 * row + 3 * i) % 500 + 2 for i in range(cached)] for row in range(rows)}
    medians, logits = forwards_in_turns(runners, histories, new_tokens, reps)
    lean, reference = logits["lean"], logits["transformers"]
    return {**{f"{name}_ms": round(ms, 3) for name, ms in medians.items()},
            "max_abs_logit_diff": max(float((a - b).abs().max()) for a, b in zip(lean, reference))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.figures.lean_forward", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cached", type=int, default=145)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--baseline-tree", help="a checkout whose lean forward runs as a third runner, lean_baseline")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    baseline = baseline_lean_class(args.baseline_tree) if args.baseline_tree else None
    results = []
    for model in ("target", "draft"):
        runners = {name: engine(MODELS / model, args.dtype, args.device, lean=name == "lean")
                   for name in ("lean", "transformers")}
        if baseline is not None:
            runners["lean_baseline"] = engine(MODELS / model, args.dtype, args.device, lean=True, lean_class=baseline)
        for rows, new_tokens in SHAPES:
            row = {"model": model, "sequences": rows, "new_tokens": new_tokens,
                   **time_shape(runners, rows, new_tokens, args.cached, args.reps)}
            row["speedup"] = round(row["transformers_ms"] / row["lean_ms"], 3)
            against = ""
            if baseline is not None:
                row["speedup_over_baseline"] = round(row["lean_baseline_ms"] / row["lean_ms"], 3)
                against = f", baseline lean {row['lean_baseline_ms']:7.3f} ms ({row['speedup_over_baseline']:.2f}x)"
            results.append(row)
            print(f"{model:6s} {rows} x {new_tokens}: transformers {row['transformers_ms']:7.3f} ms, "
                  f"lean {row['lean_ms']:7.3f} ms ({row['speedup']:.2f}x){against}, "
                  f"max |diff| {row['max_abs_logit_diff']:.2e}")
    out = Path(args.out) / f"lean-forward-{args.device}.json"
    given = sys.argv[1:] if argv is None else argv
    out.write_text(json.dumps({"command": " ".join(["python -m specserve.bench.figures.lean_forward", *given]),
                               "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
                               "dtype": args.dtype, "threads": args.threads, "cached_tokens": args.cached,
                               "baseline_tree": args.baseline_tree, "rows": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
