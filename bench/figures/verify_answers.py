"""What answering a verify step costs the target engine beyond its forward, before and after a
change, in one run: `decoding.speculation.answer_verifies` over one forward's logits split by call
(as the runner hands them over), at Llama 3's vocabulary width.

    python -m specserve.bench.figures.verify_answers --baseline-tree /tmp/specserve-before [--rounds 3]

Shapes: 1 and 8 calls of K + 1 = 5 rows each, greedy and sampled (temperature 0.8), V = 128,256,
random logits, one torch thread. Each measurement runs in its own process with PYTHONPATH set to
the tree under test, the trees taking turns every round (this box drifts); medians over rounds of
each process's median over its repetitions. Writes bench/results/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VOCAB_SIZE = 128_256
ROWS_PER_CALL = 5
SHAPES = [(calls, mode) for calls in (1, 8) for mode in ("greedy", "sampled")]


def worker(calls: int, mode: str, reps: int) -> float:
    """Median ms of answer_verifies over `calls` calls' split logits, in this process's tree."""
    import torch

    from specserve.decoding.compact_verify import DraftSupport
    from specserve.decoding.proposers import Proposal
    from specserve.decoding.sampling import SamplingParams
    from specserve.decoding.speculation import RowsCall, answer_verifies

    torch.set_num_threads(1)
    params = SamplingParams(temperature=0.0 if mode == "greedy" else 0.8, seed=None if mode == "greedy" else 7)
    row_calls = [RowsCall(ROWS_PER_CALL, params, 10, list(range(20)), None, [2]) for _ in range(calls)]
    # A sampled draft's q: each drafted token's probability 0.5, the rest of its support beside it.
    support = DraftSupport(torch.tensor([[token, token + 100] for token in (1, 2, 3, 4)]), torch.full((4, 2), 0.5))
    proposals = [Proposal([1, 2, 3, 4], None if mode == "greedy" else support) for _ in range(calls)]
    times = []
    for _ in range(reps):
        logits = torch.randn(calls * ROWS_PER_CALL, VOCAB_SIZE)
        rows = list(logits.split([ROWS_PER_CALL] * calls))
        generators = [torch.Generator().manual_seed(i) for i in range(calls)]
        started = time.perf_counter()
        answer_verifies(rows, row_calls, proposals, lambda i: generators[i], ["block"] * calls)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times[2:])


def measure(tree: Path, calls: int, mode: str, reps: int) -> float:
    # Imported here, not above: a worker runs this file under a tree that may predate the module.
    from specserve.bench.tree_turns import script_in_tree

    return float(script_in_tree(Path(__file__).resolve(), tree, ["--worker", f"{calls},{mode}", "--reps", str(reps)]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.figures.verify_answers",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", help="a checkout of the code before the change (git worktree)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20, help="timed steps per process")
    parser.add_argument("--name", default="cpu-2core-verify-answers")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        calls, mode = args.worker.split(",")
        print(worker(int(calls), mode, args.reps))
        return
    from specserve.bench.tree_turns import turn_order

    trees = {"after": ROOT} | ({"before": Path(args.baseline_tree).resolve()} if args.baseline_tree else {})
    samples: dict[tuple, list[float]] = {}
    for round_index in range(args.rounds):
        for calls, mode in SHAPES:
            for tree_name in turn_order(list(trees), round_index):
                samples.setdefault((calls, mode, tree_name), []).append(measure(trees[tree_name], calls, mode, args.reps))
    rows = [{"calls": calls, "mode": mode, "tree": tree_name,
             "median_ms": round(statistics.median(samples[(calls, mode, tree_name)]), 2),
             "per_round_ms": [round(value, 2) for value in samples[(calls, mode, tree_name)]]}
            for calls, mode in SHAPES for tree_name in trees]
    command = "python -m specserve.bench.figures.verify_answers " + " ".join(argv if argv is not None else sys.argv[1:])
    out = ROOT / "bench/results" / args.name
    out.with_suffix(".json").write_text(json.dumps({"command": command, "rounds": args.rounds, "reps": args.reps,
                                                    "vocab_size": VOCAB_SIZE, "rows": rows}, indent=2))
    lines = [f"# A verify step's answers beyond the forward (V = {VOCAB_SIZE:,}, {ROWS_PER_CALL} rows a call, "
             f"1 thread, {args.rounds} rounds, medians)", "", f"`{command}`", "",
             "| calls | mode | code | ms per step, median (per round) |", "|---|---|---|---|"]
    lines += [f"| {r['calls']} | {r['mode']} | {r['tree']} | {r['median_ms']} "
              f"({', '.join(str(v) for v in r['per_round_ms'])}) |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
