"""Bytes a round puts on the channels by sampling mode, before and after a change: greedy, sampled
(temperature 0.8, no cut), and sampled with top-p (0.95 at temperature 0.8; and 0.9 at 0.7, what
the shipped pair's generation_config.json gives a request that sets nothing).

A sampled round's draft block carries its q as (ids, probs) per drafted token to the router and on
to the target (docs/sampling.md, "How wide the draft's q is"), so its width is most of a sampled
round's bytes. The round is head_round_bytes' (one request of the shipped pair on the first
third-party prompt, K = 4, seeded, its second round), encoded as the channels encode it.

    python -m specserve.bench.figures.sampled_round_bytes --baseline-tree /tmp/tree-before --out bench/results --name NAME

With --baseline-tree the same round is measured under that tree's code too (this script run with
the tree's `specserve` on its path; bytes do not drift, so once each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from specserve.bench import DEFAULT_OUT_DIR
from specserve.bench.figures.head_round_bytes import frame_bytes, round_messages
from specserve.common.config import SpecServeConfig
from specserve.decoding.sampling import SamplingParams
from specserve.training.prompts import load_prompt_set

MODES = {"greedy": SamplingParams(temperature=0.0, max_tokens=64),
         "sampled, T 0.8": SamplingParams(temperature=0.8, max_tokens=64, seed=1),
         "top-p 0.95, T 0.8": SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=1),
         "top-p 0.9, T 0.7 (the shipped pair's defaults)": SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64,
                                                                        seed=1)}


def measure() -> dict[str, dict[str, int]]:
    """Each mode's round frames (bytes)."""
    torch.set_num_threads(1)
    config = SpecServeConfig()
    tokenizer = AutoTokenizer.from_pretrained(config.resolved_tokenizer_path, local_files_only=True)
    prompt_ids = tokenizer.encode(load_prompt_set("thirdparty").prompts[0].text, add_special_tokens=False)
    return {mode: frame_bytes(asyncio.run(round_messages(config, prompt_ids, params)), None)
            for mode, params in MODES.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.figures.sampled_round_bytes",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", type=Path, help="a checkout of the code before a change")
    parser.add_argument("--out", default=DEFAULT_OUT_DIR)
    parser.add_argument("--name", default="sampled-round-bytes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure()))
        return
    trees = {"after": measure()}
    command = "python -m specserve.bench.figures.sampled_round_bytes " + " ".join(
        argv if argv is not None else sys.argv[1:])
    if args.baseline_tree is not None:
        from specserve.bench.tree_turns import script_in_tree

        trees = {"before": json.loads(script_in_tree(Path(__file__).resolve(), args.baseline_tree.resolve(),
                                                     ["--worker"])), **trees}
    lines = ["# Bytes per round on the channels by sampling mode (K = 4)", "", f"`{command}`", "",
             "One round of the shipped pair on the first third-party prompt (bench/figures/head_round_bytes.py), "
             "each message's frame as the channels send it (8-byte length + pickle): propose, the proposal "
             "(its answer), verify, the verdict (its answer).", "",
             "| mode | code | propose | proposal | verify | verdict | total |", "|---|---|---|---|---|---|---|"]
    for mode in MODES:
        for label, rows in trees.items():
            s = rows[mode]
            lines.append(f"| {mode} | {label} | {s['propose']} B | {s['proposal']} B | {s['verify']} B "
                         f"| {s['verdict']} B | {s['total']} B |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{args.name}.json").write_text(json.dumps({"command": command, "trees": trees}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
