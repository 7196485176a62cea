"""What an EAGLE-3 head's drafting costs per drafted token, eager and with its steps compiled.

    python -m specserve.bench.figures.head_step --head HEAD_DIR [--rounds 80] [--turns 3] \\
        [--compare LABEL=TREE ...] --out bench/results --name NAME

Rounds as the draft engine drafts them (Eagle3Proposer.propose_batch: the entries of the positions
the last round committed, made from the target's features, then a one-row head step per further
draft token), over random target features after a 150-token history: what a round costs does
not depend on what the head proposes, so every round commits three of its four drafts and one
token more, a fixed shape, and no target runs. One sequence and eight, greedy and sampled
(temperature 0.8). Each run holds the head twice, eager and compiled (`Eagle3Head.compile_steps`,
enforce_eager false; a tree without it runs eager only), the two taking turns case by case.
--compare runs that under each tree given (a `git worktree` of the commit to compare, its code
imported), the trees taking turns, so a change to the eager head is measured against the code
before it in the same minutes (bench/tree_turns.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HISTORY_TOKENS = 150
CASES = [(mode, streams) for mode in ("greedy", "sampled") for streams in (1, 8)]
TEMPERATURES = {"greedy": 0.0, "sampled": 0.8}
K = 4


def measure_child(head_dir: str, target_dir: str, rounds: int, threads: int) -> dict:
    """In a tree's process: ms per drafted token, {variant: {case: median}} (variants: eager, and
    compiled where this tree's head compiles its steps)."""
    import torch

    from specserve.decoding.eagle3_checkpoint import load_eagle3_head
    from specserve.decoding.eagle3_proposer import Eagle3Proposer
    from specserve.decoding.model_runner import load_causal_lm
    from specserve.decoding.proposers import ProposeCall
    from specserve.decoding.sampling import SamplingParams
    from specserve.decoding.target_features import TargetFeatures

    torch.set_num_threads(threads)
    target = load_causal_lm(target_dir, dtype="float32", device="cpu")
    width = 3 * target.config.hidden_size
    vocab = target.config.vocab_size
    heads = {"eager": load_eagle3_head(head_dir, target)}
    compiled = load_eagle3_head(head_dir, target)
    if hasattr(compiled.head, "compile_steps"):
        compiled.head.compile_steps(enforce_eager=False, name=head_dir)
        heads["compiled"] = compiled

    def rounds_cost(loaded, mode: str, streams: int) -> float:
        proposer = Eagle3Proposer(loaded)
        generator = torch.Generator().manual_seed(0)
        histories = {f"s{i}": torch.randint(1, vocab, (HISTORY_TOKENS,), generator=generator).tolist()
                     for i in range(streams)}
        for seq_id, history in histories.items():
            proposer.observe(seq_id, TargetFeatures(0, torch.randn(len(history), width, generator=generator)))
        params = SamplingParams(temperature=TEMPERATURES[mode], max_tokens=rounds * K + 1)
        seconds = []
        for round_index in range(rounds):
            calls = [ProposeCall(seq_id, history, K, params, torch.Generator().manual_seed(round_index))
                     for seq_id, history in histories.items()]
            started = time.perf_counter()
            proposals = proposer.propose_batch(calls)
            seconds.append(time.perf_counter() - started)
            for (seq_id, history), proposal in zip(histories.items(), proposals):
                # the verify's features: the last committed position and the block's
                proposer.observe(seq_id, TargetFeatures(len(history) - 1, torch.randn(K + 1, width, generator=generator)))
                history.extend([*proposal.token_ids[:K - 1], int(torch.randint(1, vocab, (1,), generator=generator))])
        return 1e3 * statistics.median(seconds[rounds // 10:]) / (K * streams)

    results: dict = {name: {} for name in heads}
    for mode, streams in CASES:   # the variants alternate case by case
        for name, loaded in heads.items():
            results[name][f"{mode} x{streams}"] = round(rounds_cost(loaded, mode, streams), 4)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.figures.head_step",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--head", required=True, help="an EAGLE-3 head's folder")
    parser.add_argument("--target", default="models/default/target")
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--compare", action="append", default=[], help="LABEL=TREE (repeatable; default: this tree)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    head, target = str(Path(args.head).resolve()), str(Path(args.target).resolve())
    if args.child:
        print(json.dumps(measure_child(head, target, args.rounds, args.threads)))
        return
    from specserve.bench import DEFAULT_OUT_DIR
    from specserve.bench.figures.head_vs_draft import write_report
    from specserve.bench.tree_turns import parse_trees, script_in_tree, turn_order

    trees = dict(parse_trees(args.compare or ["this tree=."]))
    child = ["--child", "--head", head, "--target", target, "--rounds", str(args.rounds), "--threads", str(args.threads)]
    turns: dict[str, list[dict]] = {label: [] for label in trees}
    for turn in range(args.turns):
        for label in turn_order(list(trees), turn):
            turns[label].append(json.loads(script_in_tree(Path(__file__).resolve(), trees[label], child)))
    medians = {f"{label}, {variant}": {case: round(statistics.median(run[variant][case] for run in runs), 4)
                                       for case in runs[0][variant]}
               for label, runs in turns.items() for variant in runs[0]}
    command = "python -m specserve.bench.figures.head_step " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {"command": command, "head": args.head, "rounds": args.rounds, "turns": args.turns,
              "threads": args.threads, "trees": {label: str(tree) for label, tree in trees.items()},
              "ms_per_drafted_token": medians, "runs": turns}
    columns = list(medians)
    lines = [f"# An EAGLE-3 head's drafting cost: {Path(args.head).name}", "",
             f"`{command}`: ms per drafted token (a round's propose_batch over its {K} drafts), medians of "
             f"{args.turns} turns of {args.rounds} rounds each, {args.threads} torch thread(s), random target "
             f"features after a {HISTORY_TOKENS}-token history.", "",
             "| case | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for mode, streams in CASES:
        case = f"{mode} x{streams}"
        lines.append(f"| {case} | " + " | ".join(str(medians[column][case]) for column in columns) + " |")
    args.out = args.out or DEFAULT_OUT_DIR
    write_report(args, report, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
