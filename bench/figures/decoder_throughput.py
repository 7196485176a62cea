"""Engine throughput per architecture, before and after a change, in one run: greedy speculative
decoding in process (decoding.generate.generate_batch: the engines' round path, batched drafting
and one target forward per round for every stream), at 1 and at N streams.

    python -m specserve.bench.figures.decoder_throughput --baseline-tree /tmp/specserve-before [--rounds 3] [--streams 8]

Pairs: the shipped default pair on the third-party prompts (bench/prompts_thirdparty_v1.json), and
tiny random look-alikes of the Qwen3, Qwen3-MoE + Qwen3, Gemma 3 and Phi-3 pairs
(tests/checkpoint_fixtures.py; random weights, so only their N-stream / 1-stream ratio means
anything: it shows whether an architecture is batched). Each measurement runs in its own process
with PYTHONPATH set to the tree under test; trees take turns within every round (this box drifts),
and medians over rounds are reported. Writes bench/results/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAIRS = ("default", "qwen3", "qwen3_moe", "gemma3", "phi3")


def worker(pair: str, streams: int, max_tokens: int, fixtures: str) -> dict:
    """tok/s of `streams` greedy requests decoded together (K = 4), in this process's tree."""
    import torch

    from specserve.decoding.batched_runner import load_runner
    from specserve.decoding.generate import generate_batch
    from specserve.decoding.proposers import DraftModelProposer
    from specserve.decoding.sampling import SamplingParams
    from specserve.decoding.scheduler import Scheduler
    from specserve.decoding.sequence import RequestState

    torch.set_num_threads(1)
    if pair == "default":
        target_path, draft_path = ROOT / "models/default/target", ROOT / "models/default/draft"
    else:
        target_path, draft_path = Path(fixtures) / f"{pair}-target", Path(fixtures) / f"{pair}-draft"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models/default/tokenizer" if pair == "default" else target_path)
    prompts = [p["text"] for p in json.loads((ROOT / "bench/prompts_thirdparty_v1.json").read_text())["prompts"]]
    spec = {"dtype": "float32", "device": "cpu", "torch_threads": 1, "max_sequences": 64}
    # Engines as generate_batch drives them: a scheduler over each runner.
    target, draft = (Scheduler(load_runner({**spec, "path": str(path)})) for path in (target_path, draft_path))
    proposer = DraftModelProposer(draft)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def states(count: int, offset: int) -> list:
        return [RequestState(f"s{offset}-{i}", tokenizer.encode(prompts[(offset + i) % len(prompts)]), params, None,
                             max_context=512) for i in range(count)]

    generate_batch(target, states(1, 99), proposer, num_draft_tokens=4)   # warm-up
    batch = states(streams, 0)
    start = time.perf_counter()
    generate_batch(target, batch, proposer, num_draft_tokens=4)
    elapsed = time.perf_counter() - start
    tokens = sum(len(state.output_ids) for state in batch)
    drafted = sum(state.stats.num_drafted for state in batch)
    accepted = sum(state.stats.num_accepted for state in batch)
    return {"tok_s": tokens / elapsed, "tokens": tokens, "acceptance": accepted / max(drafted, 1),
            "target_runner": type(target.runner).__name__}


def measure(tree: Path, pair: str, streams: int, max_tokens: int, fixtures: str) -> dict:
    # Imported here, not above: a worker runs this file under a tree that may predate the module.
    from specserve.bench.tree_turns import script_in_tree

    return json.loads(script_in_tree(Path(__file__).resolve(), tree, ["--worker", pair, "--streams", str(streams),
                                                                      "--max-tokens", str(max_tokens),
                                                                      "--fixtures", fixtures]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.figures.decoder_throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", help="a checkout of the code before the change (git worktree)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--pairs", default=",".join(PAIRS))
    parser.add_argument("--name", default="cpu-2core-decoder-throughput")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--fixtures", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.streams, args.max_tokens, args.fixtures)))
        return

    from specserve.bench.tree_turns import turn_order

    trees = {"after": ROOT} | ({"before": Path(args.baseline_tree).resolve()} if args.baseline_tree else {})
    fixtures = tempfile.mkdtemp(prefix="decoder-fixtures-")
    sys.path.insert(0, str(ROOT))
    from tests.checkpoint_fixtures import DECODER_BUILDERS

    for builder in DECODER_BUILDERS.values():
        builder(Path(fixtures))
    pairs = args.pairs.split(",")
    samples: dict[tuple, list[dict]] = {}
    for round_index in range(args.rounds):
        for pair in pairs:
            for streams in (1, args.streams):
                for tree_name in turn_order(list(trees), round_index):
                    result = measure(trees[tree_name], pair, streams, args.max_tokens, fixtures)
                    samples.setdefault((pair, streams, tree_name), []).append(result)
                    print(f"round {round_index} {pair:10s} {streams:2d} streams {tree_name:6s} "
                          f"{result['tok_s']:7.1f} tok/s ({result['target_runner']})", flush=True)
    rows = []
    for pair in pairs:
        for tree_name in trees:
            one = statistics.median(s["tok_s"] for s in samples[(pair, 1, tree_name)])
            many = statistics.median(s["tok_s"] for s in samples[(pair, args.streams, tree_name)])
            rows.append({"pair": pair, "tree": tree_name, "runner": samples[(pair, 1, tree_name)][0]["target_runner"],
                         "tok_s_1": round(one, 1), f"tok_s_{args.streams}": round(many, 1),
                         "ratio": round(many / one, 2),
                         "acceptance": round(statistics.median(s["acceptance"] for s in samples[(pair, 1, tree_name)]), 3)})
    command = "python -m specserve.bench.figures.decoder_throughput " + " ".join(argv if argv is not None else sys.argv[1:])
    out = ROOT / "bench/results" / args.name
    out.with_suffix(".json").write_text(json.dumps({"command": command, "rounds": args.rounds,
                                                    "max_tokens": args.max_tokens, "rows": rows}, indent=2))
    lines = [f"# Engine throughput per architecture ({args.rounds} rounds, medians, greedy, K = 4, "
             f"{args.max_tokens} tokens a request, in process, 1 thread)", "", f"`{command}`", "",
             f"| pair | code | target runner | 1 stream tok/s | {args.streams} streams tok/s | ratio | acceptance |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['pair']} | {r['tree']} | {r['runner']} | {r['tok_s_1']} | {r[f'tok_s_{args.streams}']} | "
              f"{r['ratio']} | {r['acceptance']} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
