"""What answering a verify step costs the target engine beyond its forward, and (`--steps
verify,draft`) what drawing a draft step costs the draft engine beyond its forward, before and
after a change, in one run: `decoding.speculation.answer_verifies` over one forward's logits split
by call (as the runner hands them over), and `decoding.proposers.draft_step` over one draft
forward's last rows, at Llama 3's vocabulary width (`--vocab-size`: another).

    python -m specserve.bench.figures.verify_answers --baseline-tree /tmp/specserve-before [--rounds 3] [--steps verify,draft] [--draft-top-k N] [--logit-scale S]

Shapes: 1 and 8 calls, greedy and sampled (temperature 0.8), V = 128,256, random logits (standard
normal times --logit-scale: the larger, the more peaked a row), one torch thread; a verify call
holds K + 1 = 5 rows, a draft call one row (no fan-out candidates), whose sampled q is the whole
row or, with --draft-top-k, cut as speculation.draft_top_k cuts it.
Each measurement runs in its own process with PYTHONPATH set to the tree under test and malloc as
that tree's engine processes hold it, the trees taking turns every round (this box drifts);
medians over rounds of each process's median over its repetitions. Writes
bench/results/<name>.json and .md.
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


def verify_worker(calls: int, mode: str, reps: int, vocab_size: int, scale: float, draft_top_k: int | None) -> float:
    """Median ms of answer_verifies over `calls` calls' split logits, in this process's tree."""
    import torch

    from specserve.decoding.compact_verify import DraftSupport
    from specserve.decoding.proposers import Proposal
    from specserve.decoding.speculation import RowsCall, answer_verifies

    params = step_params(mode)
    row_calls = [RowsCall(ROWS_PER_CALL, params, 10, list(range(20)), None, [2]) for _ in range(calls)]
    # A sampled draft's q: each drafted token's probability 0.5, the rest of its support beside it.
    support = DraftSupport(torch.tensor([[token, token + 100] for token in (1, 2, 3, 4)]), torch.full((4, 2), 0.5))
    proposals = [Proposal([1, 2, 3, 4], None if mode == "greedy" else support) for _ in range(calls)]

    def prepared():
        rows = list((torch.randn(calls * ROWS_PER_CALL, vocab_size) * scale).split([ROWS_PER_CALL] * calls))
        generators = [torch.Generator().manual_seed(i) for i in range(calls)]
        return lambda: answer_verifies(rows, row_calls, proposals, lambda i: generators[i], ["block"] * calls)

    return median_ms(prepared, reps)


def draft_worker(calls: int, mode: str, reps: int, vocab_size: int, scale: float, draft_top_k: int | None) -> float:
    """Median ms of one draft_step over `calls` rows of logits, each row its own request's."""
    import torch

    from specserve.decoding.proposers import ProposeCall, draft_step

    params = step_params(mode)
    propose_calls = [ProposeCall(f"s{i}", list(range(20)), 4, params, torch.Generator().manual_seed(i))
                     for i in range(calls)]

    def prepared():
        logits = torch.randn(calls, vocab_size) * scale
        return lambda: draft_step(logits, propose_calls, [None] * calls, [False] * calls, draft_top_k)

    return median_ms(prepared, reps)


WORKERS = {"verify": verify_worker, "draft": draft_worker}


def step_params(mode: str):
    """One torch thread, malloc set as the tree's engine processes have it (decoding/host_memory.py,
    where the tree has it), and the sampling parameters of a `mode` ("greedy" or "sampled") request."""
    import torch

    from specserve.decoding.sampling import SamplingParams

    torch.set_num_threads(1)
    try:
        from specserve.decoding.host_memory import keep_freed_memory
    except ImportError:   # a tree from before the engines set it
        pass
    else:
        keep_freed_memory()
    return SamplingParams(temperature=0.0 if mode == "greedy" else 0.8, seed=None if mode == "greedy" else 7)


def median_ms(prepared, reps: int) -> float:
    """Median ms of reps calls, each of what prepared() returns (its inputs made outside the
    timing), the first two not counted."""
    times = []
    for _ in range(reps):
        run = prepared()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times[2:])


def measure(tree: Path, step: str, calls: int, mode: str, reps: int, vocab_size: int, scale: float,
            draft_top_k: int | None) -> float:
    # Imported here, not above: a worker runs this file under a tree that may predate the module.
    from specserve.bench.tree_turns import script_in_tree

    return float(script_in_tree(Path(__file__).resolve(), tree,
                                ["--worker", f"{step},{calls},{mode}", "--reps", str(reps),
                                 "--vocab-size", str(vocab_size), "--logit-scale", str(scale)]
                                + ([] if draft_top_k is None else ["--draft-top-k", str(draft_top_k)])))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.figures.verify_answers",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", help="a checkout of the code before the change (git worktree)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20, help="timed steps per process")
    parser.add_argument("--name", default="cpu-2core-verify-answers")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help="the logits' width")
    parser.add_argument("--steps", default="verify", help="which steps, comma-separated: verify, draft")
    parser.add_argument("--logit-scale", type=float, default=1.0, help="the random logits' standard deviation")
    parser.add_argument("--draft-top-k", type=int, help="a sampled draft step's q cut as speculation.draft_top_k "
                        "(default: the whole row)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        step, calls, mode = args.worker.split(",")
        print(WORKERS[step](int(calls), mode, args.reps, args.vocab_size, args.logit_scale, args.draft_top_k))
        return
    from specserve.bench.tree_turns import turn_order

    steps = [step for step in args.steps.split(",") if step]
    if not steps or set(steps) - set(WORKERS):
        parser.error(f"--steps: a comma-separated choice of {', '.join(WORKERS)}")
    shapes = [(step, calls, mode) for step in steps for calls, mode in SHAPES]
    trees = {"after": ROOT} | ({"before": Path(args.baseline_tree).resolve()} if args.baseline_tree else {})
    samples: dict[tuple, list[float]] = {}
    for round_index in range(args.rounds):
        for shape in shapes:
            for tree_name in turn_order(list(trees), round_index):
                samples.setdefault((*shape, tree_name), []).append(
                    measure(trees[tree_name], *shape, args.reps, args.vocab_size, args.logit_scale, args.draft_top_k))
    rows = [{"step": step, "calls": calls, "mode": mode, "tree": tree_name,
             "median_ms": round(statistics.median(samples[(step, calls, mode, tree_name)]), 2),
             "per_round_ms": [round(value, 2) for value in samples[(step, calls, mode, tree_name)]]}
            for step, calls, mode in shapes for tree_name in trees]
    command = "python -m specserve.bench.figures.verify_answers " + " ".join(argv if argv is not None else sys.argv[1:])
    out = ROOT / "bench/results" / args.name
    out.with_suffix(".json").write_text(json.dumps({"command": command, "rounds": args.rounds, "reps": args.reps,
                                                    "vocab_size": args.vocab_size, "logit_scale": args.logit_scale,
                                                    "draft_top_k": args.draft_top_k, "rows": rows}, indent=2))
    q = "the whole row" if args.draft_top_k is None else f"cut as draft_top_k {args.draft_top_k} cuts it"
    lines = [f"# A step's sampling work beyond the forward (V = {args.vocab_size:,}; a verify call {ROWS_PER_CALL} rows, "
             f"a draft call one; logits standard normal times {args.logit_scale}; a sampled draft's q {q}; "
             f"1 thread, {args.rounds} rounds, medians)", "", f"`{command}`", "",
             "| step | calls | mode | code | ms per step, median (per round) |", "|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['calls']} | {r['mode']} | {r['tree']} | {r['median_ms']} "
              f"({', '.join(str(v) for v in r['per_round_ms'])}) |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
