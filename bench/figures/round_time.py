"""Per-round time of sampled vs greedy requests and of long vs short histories, on a 128k-vocabulary
look-alike pair at fixed K: a round's cost should follow K, not the sampling mode, the history or
the vocabulary (docs/sampling.md).

    python -m specserve.bench.figures.round_time [--rounds 40] [--warmup 2] [--threads 1] [--draft-top-k N] [--out bench/results/cpu-2core-round-time.md]
    python -m specserve.bench.figures.round_time --baseline-tree /tmp/tree-before [--turns 3] ... [--out FILE]

With --baseline-tree (a `git worktree` of the code before a change) the same measurement runs in
its own process under each tree, the trees taking turns --turns times (bench/tree_turns.py), and
the table gives each variant's medians (of the turns' medians) before and after side by side.

The pair is the shipped default pair's architecture (models/default: target and draft configs)
with Llama 3's vocabulary width (128,256) and a context of 4,096, random weights made peaked like a
trained model's (bench/look_alike.py); the table states the entropy measured. Six requests, one
per variant (greedy / sampled / sampled with top-p x 100 / 3,500 history tokens), are prefilled,
then take turns round by round, so the box's drift hits every variant alike. A round is one
`decoding.generate.generate` step: the draft drafts K tokens (sampled: temperature 0.8, and top-p
0.95 in the top-p variant; the draft's support cut to --draft-top-k, speculation.draft_top_k's
default unless given), the target runs one forward over the block, its rows are processed and
answered on the engine's path (`decoding.speculation.target_rows_batch`, `verify_answers`) and the
block is verified. The draft always drafts K tokens (ignore_eos, max_tokens past the run), so
every round does the same work whatever was accepted. Medians and p90 per variant, each variant's
median over greedy-short's, and the medians of the round's time in the draft's forwards, in the
target's forward (each runner's model calls, `_logits`, timed apart) and outside them (the
protocol: processing rows, drawing, verifying, bookkeeping), so a slower variant shows whether
attention or protocol costs it.

No Ray: transport is bench.round_bytes' and bench.transport's subject; this is the engines' work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specserve.bench.look_alike import ENTROPY_POSITIONS, VOCAB_SIZE, look_alike, timed_forwards
from specserve.common.config import SpeculationSpec
from specserve.decoding.scheduler import engine_for_model
from specserve.decoding.generate import generate
from specserve.decoding.proposers import DraftModelProposer
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.sequence import RequestState

MAX_CONTEXT = 4_096
NUM_DRAFT_TOKENS = 4
HISTORIES = {"short": 100, "long": 3_500}
MODES = {"greedy": SamplingParams(temperature=0, max_tokens=MAX_CONTEXT, ignore_eos=True),
         "sampled": SamplingParams(temperature=0.8, max_tokens=MAX_CONTEXT, ignore_eos=True, seed=7),
         # top-p (and top-k) cut each processed row (sampling.truncate_rows): a flat row sorts all 128k ids
         "sampled_top_p": SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_CONTEXT, ignore_eos=True,
                                         seed=7)}


def measure(num_rounds: int, num_warmup: int, draft_top_k: int) -> tuple[dict, dict]:
    """Seconds per round and seconds in the models' forwards per round, per variant, the variants
    taking turns after num_warmup untimed rounds each; and the look-alikes' mean entropies.
    draft_top_k: the candidates a sampled draft token is drawn from (speculation.draft_top_k)."""
    ids = torch.randint(0, VOCAB_SIZE, (max(HISTORIES.values()),), generator=torch.Generator().manual_seed(3))
    prompts = [ids[:length] for length in HISTORIES.values()]
    target_model, target_entropy = look_alike("target", 0, prompts, MAX_CONTEXT)
    draft_model, draft_entropy = look_alike("draft", 1, prompts, MAX_CONTEXT)
    in_forwards = {"target": [0.0], "draft": [0.0]}
    target = timed_forwards(engine_for_model(target_model, max_sequences=8, model_path="look-alike-target",
                                             max_model_len=MAX_CONTEXT), in_forwards["target"])
    proposer = DraftModelProposer(timed_forwards(engine_for_model(draft_model, max_sequences=8,
                                                                  model_path="look-alike-draft",
                                                                  max_model_len=MAX_CONTEXT), in_forwards["draft"]),
                                  max_candidates=draft_top_k)
    rounds, seconds = {}, {}
    for history, length in HISTORIES.items():
        for mode, params in MODES.items():
            name = f"{mode}-{history}"
            state = RequestState(name, ids[:length].tolist(), params, eos_token_id=None, max_context=MAX_CONTEXT)
            rounds[name] = generate(target, state, proposer, NUM_DRAFT_TOKENS)
            next(rounds[name])  # the prefill, untimed
            seconds[name] = {"round": [], "draft_forwards": [], "target_forwards": []}
    if (num_warmup + num_rounds) * (NUM_DRAFT_TOKENS + 1) + max(HISTORIES.values()) >= MAX_CONTEXT:
        raise ValueError(f"{num_warmup + num_rounds} rounds would run the long history past the {MAX_CONTEXT}-token "
                         "context")
    for _ in range(num_warmup):
        for round_iterator in rounds.values():
            next(round_iterator)
    for _ in range(num_rounds):
        for name, round_iterator in rounds.items():
            for counter in in_forwards.values():
                counter[0] = 0.0
            started = time.perf_counter()
            next(round_iterator)
            seconds[name]["round"].append(time.perf_counter() - started)
            for role, counter in in_forwards.items():
                seconds[name][f"{role}_forwards"].append(counter[0])
    for round_iterator in rounds.values():
        round_iterator.close()
    return seconds, {"target": target_entropy, "draft": draft_entropy}


def summary(seconds: dict) -> dict:
    baseline = statistics.median(seconds["greedy-short"]["round"])
    rows = {}
    for name, timings in seconds.items():
        values = timings["round"]
        outside = [total - draft - target
                   for total, draft, target in zip(values, timings["draft_forwards"], timings["target_forwards"])]
        rows[name] = {"median_ms": 1e3 * statistics.median(values),
                      "p90_ms": 1e3 * statistics.quantiles(values, n=10)[-1] if len(values) > 1 else 1e3 * values[0],
                      "vs_greedy_short": statistics.median(values) / baseline,
                      "draft_forwards_median_ms": 1e3 * statistics.median(timings["draft_forwards"]),
                      "target_forward_median_ms": 1e3 * statistics.median(timings["target_forwards"]),
                      "outside_forwards_median_ms": 1e3 * statistics.median(outside), "rounds": len(values)}
    return rows


def table(rows: dict, entropies: dict, command: str) -> str:
    lines = [f"Per-round time, K = {NUM_DRAFT_TOKENS}, V = {VOCAB_SIZE:,}, torch threads {torch.get_num_threads()}; "
             f"variants taking turns (`{command}`).", "",
             "The pair: the default pair's architecture (models/default) with random weights, lm_head untied from "
             "the embeddings (its own random weights), each model's final norm scaled so that its next-token distributions are peaked like a trained model's: mean entropy over "
             f"the last {ENTROPY_POSITIONS} positions of the two prompts (random token ids) "
             f"{entropies['target']:.2f} nats (target), {entropies['draft']:.2f} nats (draft), at temperature 1. "
             "It is not a trained pair: its draft and target disagree, and its attention and matmuls cost what "
             "the architecture costs, nothing more. Forwards: the draft's K model calls and the target's one, "
             "timed apart; outside: the rest of the round (row processing, drawing, verification, bookkeeping).", "",
             "| variant | history tokens | median ms per round | p90 ms | median / greedy-short's "
             "| median ms in draft forwards | median ms in target forward | median ms outside forwards |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {HISTORIES[name.rsplit('-', 1)[1]]:,} | {row['median_ms']:.1f} | {row['p90_ms']:.1f} "
                     f"| {row['vs_greedy_short']:.2f} | {row['draft_forwards_median_ms']:.1f} "
                     f"| {row['target_forward_median_ms']:.1f} "
                     f"| {row['outside_forwards_median_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def compared_table(runs: dict[str, list[dict]], command: str) -> tuple[str, dict]:
    """Per variant, the medians over each tree's turns of its per-run medians, trees side by side."""
    labels = list(runs)
    merged = {label: {name: {key: statistics.median(run["summary"][name][key] for run in tree_runs)
                             for key in ("median_ms", "vs_greedy_short", "outside_forwards_median_ms")}
                      for name in tree_runs[0]["summary"]} for label, tree_runs in runs.items()}
    header = " | ".join(f"{label}: ms, / greedy-short's, outside ms" for label in labels)
    lines = [f"Per-round time, K = {NUM_DRAFT_TOKENS}, V = {VOCAB_SIZE:,}, the trees taking turns, "
             f"{len(runs[labels[0]])} turns (`{command}`); medians of the turns' medians. The pair and the "
             "variants as in this bench's own table (bench/figures/round_time.py).", "",
             f"| variant | {header} |", "|---|" + "---|" * len(labels)]
    for name in merged[labels[0]]:
        cells = " | ".join(f"{merged[label][name]['median_ms']:.1f}, {merged[label][name]['vs_greedy_short']:.2f}, "
                           f"{merged[label][name]['outside_forwards_median_ms']:.1f}" for label in labels)
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines) + "\n", merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per variant before the timed ones")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--draft-top-k", type=int, default=SpeculationSpec().draft_top_k,
                        help="speculation.draft_top_k of the sampled drafts (default: its default)")
    parser.add_argument("--out", type=Path, help="write the table here (and its numbers beside it as .json)")
    parser.add_argument("--baseline-tree", type=Path, help="a checkout of the code before a change: both trees "
                        "measured, taking turns")
    parser.add_argument("--turns", type=int, default=3, help="with --baseline-tree: runs per tree")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    command = (f"python -m specserve.bench.figures.round_time --rounds {args.rounds} --warmup {args.warmup} "
               f"--threads {args.threads} --draft-top-k {args.draft_top_k}")
    if args.baseline_tree is not None:
        compare(args, command)
        return
    seconds, entropies = measure(args.rounds, args.warmup, args.draft_top_k)
    rows = summary(seconds)
    if args.worker:   # one tree's turn (compare): its numbers, on the last line
        print(json.dumps({"entropy_nats": entropies, "summary": rows}))
        return
    text = table(rows, entropies, command)
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"command": command, "entropy_nats": entropies,
                                                             "summary": rows}, indent=1))


def compare(args, command: str) -> None:
    """This bench under the baseline tree and this one, the trees taking turns."""
    # Imported here: a worker runs this file under a tree whose bench may predate the module.
    from specserve.bench.tree_turns import script_in_tree, turn_order

    trees = {"before": args.baseline_tree.resolve(), "after": Path(__file__).resolve().parents[2]}
    worker = ["--worker", "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--threads", str(args.threads),
              "--draft-top-k", str(args.draft_top_k)]
    runs: dict[str, list[dict]] = {label: [] for label in trees}
    for turn in range(args.turns):
        for label in turn_order(list(trees), turn):
            runs[label].append(json.loads(script_in_tree(Path(__file__).resolve(), trees[label], worker)))
            print(label, turn, {name: round(row["median_ms"], 1) for name, row in runs[label][-1]["summary"].items()},
                  flush=True)
    command += f" --baseline-tree {args.baseline_tree} --turns {args.turns}"
    text, merged = compared_table(runs, command)
    print(text)
    if args.out:
        args.out.write_text(text)
        trees = {label: str(tree) for label, tree in trees.items()}
        args.out.with_suffix(".json").write_text(json.dumps({"command": command, "trees": trees, "medians": merged,
                                                             "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
