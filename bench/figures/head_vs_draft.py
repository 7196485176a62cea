"""An EAGLE-3 head against the shipped draft model, drafting for the shipped target in process.

    python -m specserve.bench.figures.head_vs_draft --head HEAD_DIR [--head HEAD_DIR ...] [--prompts thirdparty] \\
        [--num-prompts 8] [--max-tokens 64] [--k 4] --out bench/results --name NAME

Per drafter and mode (greedy; sampled at temperature 0.8, seeded per prompt): per-token
acceptance, tokens per target pass, the drafter's cost per drafted token, and tokens/s at one
stream (each prompt alone, `decoding.generate`) and at eight (the prompts as one batch,
`generate_batch`: one propose_batch and one target forward a round, as the engines batch),
with target-only decoding beside them. The variants take turns prompt by prompt (one stream)
and batch by batch, so the box's drift falls on all of them alike. In process on purpose: what
decides whether a head beats the draft model is acceptance against drafting cost, not the
transport, which is the same for both (docs/eagle3.md). Greedy outputs of every variant must be
equal (they are the target's); a difference is reported, not hidden. Several heads (--head
repeated: say one drafting over the whole vocabulary and one over a reduced one) take turns too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from specserve.bench import DEFAULT_OUT_DIR
from specserve.decoding.eagle3_checkpoint import load_eagle3_head
from specserve.decoding.eagle3_proposer import Eagle3Proposer
from specserve.decoding.generate import generate, generate_batch
from specserve.decoding.model_runner import load_causal_lm
from specserve.decoding.proposers import DraftModelProposer
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.scheduler import engine_for_model
from specserve.decoding.sequence import RequestState
from specserve.training.prompts import load_prompt_set, select_prompts

MODES = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8)}
STREAMS = (1, 8)


class TimedProposer:
    """A proposer whose propose_batch calls are timed (the drafter's cost, outside the target's)."""

    def __init__(self, proposer) -> None:
        self.proposer = proposer
        self.seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.proposer, name)

    def propose(self, *args, **kwargs):
        return self._timed(self.proposer.propose, *args, **kwargs)

    def propose_batch(self, calls):
        return self._timed(self.proposer.propose_batch, calls)

    def _timed(self, method, *args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


def head_name(head_dir: str) -> str:
    return f"EAGLE-3 head {Path(head_dir).name}"


def variants(models: Path, head_dirs: list[str], compiled: bool = False) -> dict:
    """name -> (target engine, proposer or None), each target its own engine over one model;
    compiled: each drafter also as a variant of its own whose steps are compiled (the draft
    model's forward, the heads' dense parts: Eagle3Head.compile_steps), as enforce_eager false
    serves them on CPU."""
    target = load_causal_lm(str(models / "target"), dtype="float32", device="cpu")
    draft = load_causal_lm(str(models / "draft"), dtype="float32", device="cpu")
    found = {"target only": (engine_for_model(target), None),
             "draft model": (engine_for_model(target), DraftModelProposer(engine_for_model(draft)))}
    if compiled:
        found["draft model, compiled"] = (engine_for_model(target), DraftModelProposer(
            engine_for_model(draft, enforce_eager=False)))
    for head_dir in head_dirs:
        for compiling in (False, True) if compiled else (False,):
            loaded = load_eagle3_head(head_dir, target)
            if compiling:
                loaded.head.compile_steps(enforce_eager=False, name=head_dir)
            found[head_name(head_dir) + (", compiled" if compiling else "")] = (
                engine_for_model(target, aux_layers=loaded.aux_layers), Eagle3Proposer(loaded))
    return found


def states(prompts: list[list[int]], mode: str, max_tokens: int, tag: str) -> list[RequestState]:
    return [RequestState(request_id=f"{tag}-{i}", prompt_ids=ids, eos_token_id=None, max_context=512,
                         params=SamplingParams(max_tokens=max_tokens, seed=i, **MODES[mode]))
            for i, ids in enumerate(prompts)]


def measure(runs: dict, name: str, batch: list[RequestState], wall_s: float, draft_s: float) -> None:
    run = runs.setdefault(name, {"wall_s": [], "tokens": 0, "drafted": 0, "accepted": 0, "passes": 0,
                                 "draft_s": 0.0, "outputs": []})
    run["wall_s"].append(wall_s)
    run["draft_s"] += draft_s
    for state in batch:
        run["tokens"] += len(state.output_ids)
        run["drafted"] += state.stats.num_drafted
        run["accepted"] += state.stats.num_accepted
        run["passes"] += state.stats.target_passes
        run["outputs"].append(state.output_ids)


def run_case(engines: dict, prompts: list[list[int]], mode: str, streams: int, max_tokens: int, k: int) -> dict:
    """Every variant over every prompt (one at a time, or in batches of `streams`), taking turns."""
    runs: dict = {}
    for start in range(0, len(prompts), streams):
        group = prompts[start:start + streams]
        for name, (engine, proposer) in engines.items():
            timed = None if proposer is None else TimedProposer(proposer)
            batch = states(group, mode, max_tokens, f"{mode}{streams}-{start}")
            started = time.perf_counter()
            if streams == 1:
                list(generate(engine, batch[0], timed, k))
            else:
                generate_batch(engine, batch, timed, k)
            measure(runs, name, batch, time.perf_counter() - started, 0.0 if timed is None else timed.seconds)
    summary = {}
    for name, run in runs.items():
        summary[name] = {
            "per_token_acceptance": round(run["accepted"] / run["drafted"], 3) if run["drafted"] else None,
            "tokens_per_target_pass": round(run["tokens"] / run["passes"], 2),
            "draft_ms_per_token": round(1e3 * run["draft_s"] / run["drafted"], 3) if run["drafted"] else None,
            "tokens_per_s": round(run["tokens"] / sum(run["wall_s"]), 1),
            "median_wall_s": round(statistics.median(run["wall_s"]), 3)}
    if mode == "greedy":
        reference = runs["target only"]["outputs"]
        summary["greedy_outputs_differ"] = sorted(
            name for name, run in runs.items() if run["outputs"] != reference)
    return summary


def run_cases(engines: dict, prompts: list[list[int]], max_tokens: int, k: int) -> list[dict]:
    """run_case for every mode and stream count, each case printed as it ends."""
    cases = []
    for mode in MODES:
        for streams in STREAMS:
            cases.append({"mode": mode, "streams": streams,
                          "results": run_case(engines, prompts, mode, streams, max_tokens, k)})
            print(json.dumps(cases[-1]), flush=True)
    return cases


def table(report: dict) -> str:
    drafters = [name for name in report["cases"][0]["results"] if name not in ("target only", "greedy_outputs_differ")]
    return round_table(report["cases"], drafters)


def round_table(cases: list[dict], drafters: list[str]) -> str:
    """run_case's results per case (mode, streams) as one table: drafters, then target-only."""
    lines = ["| mode | streams | drafter | per-token acceptance | tokens per target pass | draft ms per drafted token "
             "| tok/s | × target-only |", "|---|---|---|---|---|---|---|---|"]
    for case in cases:
        base = case["results"]["target only"]["tokens_per_s"]
        for name in (*drafters, "target only"):
            row = case["results"][name]
            acceptance = "-" if row["per_token_acceptance"] is None else row["per_token_acceptance"]
            cost = "-" if row["draft_ms_per_token"] is None else row["draft_ms_per_token"]
            lines.append(f"| {case['mode']} | {case['streams']} | {name} | {acceptance} | "
                         f"{row['tokens_per_target_pass']} | {cost} | {row['tokens_per_s']} | "
                         f"{row['tokens_per_s'] / base:.2f} |")
    differ = [f"{case['mode']} x{case['streams']}: {', '.join(case['results']['greedy_outputs_differ'])}"
              for case in cases if case["results"].get("greedy_outputs_differ")]
    return "\n".join(lines) + "\n\n" + ("Greedy outputs differing from target-only: " + "; ".join(differ)
                                        if differ else "Greedy outputs: all equal on every prompt.") + "\n"


def drafter_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options this bench shares with head_agreement: heads, models, prompts, threads, output."""
    parser.add_argument("--head", action="append", required=True, help="an EAGLE-3 head's folder (repeatable)")
    parser.add_argument("--models", default="models/default", help="the folder holding target/ and draft/")
    parser.add_argument("--prompts", default="thirdparty")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=DEFAULT_OUT_DIR)
    parser.add_argument("--name", default=None, help="write <out>/<name>.json and .md")
    return parser


def write_report(args: argparse.Namespace, report: dict, text: str) -> None:
    """Print text; with --name, write it and the report to <out>/<name>.md and .json."""
    print(text)
    if args.name:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / f"{args.name}.md").write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = drafter_arguments(argparse.ArgumentParser(prog="python -m specserve.bench.figures.head_vs_draft",
                                                       description=__doc__.splitlines()[0]))
    parser.add_argument("--k", type=int, default=4, help="draft tokens a round (fixed: both drafters alike)")
    parser.add_argument("--compiled", action="store_true",
                        help="each drafter also with its steps compiled, as a variant of its own")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = Path(args.models)
    tokenizer = AutoTokenizer.from_pretrained(str(models / "target"))
    prompts = [tokenizer(p.text, add_special_tokens=False)["input_ids"]
               for p in select_prompts(load_prompt_set(args.prompts).prompts, args.num_prompts)]
    engines = variants(models, args.head, args.compiled)
    cases = run_cases(engines, prompts, args.max_tokens, args.k)
    report = {"command": "python -m specserve.bench.figures.head_vs_draft "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              "heads": args.head, "prompts": f"{args.prompts} ({len(prompts)})", "max_tokens": args.max_tokens,
              "k": args.k, "threads": args.threads, "machine": f"{platform.processor() or platform.machine()}, "
                                                            f"{os.cpu_count()} CPUs", "cases": cases}
    text = (f"# An EAGLE-3 head against the shipped draft model\n\n`{report['command']}`: the shipped target in "
            f"process, fp32, {args.threads} torch thread(s); {report['prompts']} prompts, {args.max_tokens} tokens "
            f"each, K = {args.k} every round; variants taking turns.\n\n" + table(report))
    write_report(args, report, text)


if __name__ == "__main__":
    main()
