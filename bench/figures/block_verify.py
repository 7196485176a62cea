"""Block verification against token-wise, in process on the shipped default pair.

    python -m specserve.bench.figures.block_verify [--max-tokens 64] [--runs 2] [--num-prompts 12] [--name block-verify]

The third-party prompts, sampled (temperatures 1.0 and 0.7, no top-k/top-p), K pinned at 4 and 8,
through decoding.generate (the reference loop the router shares accept_round with). For every
prompt and run the two verifiers decode the same request (same seed) back to back, their order
alternating, so both meet the same minutes of a shared machine. Reported per cell:

- measured: tokens per target pass (prefill included), tokens per verify round, acceptance, tok/s;
- paired, exact: on the rows of every verify round either variant ran, each verifier's expected
  accepted draft tokens (decoding.rejection.expected_num_accepted), so the gain is read on the same
  rows without the verifiers' own sampling noise (the robust figure);
- verify cost: block_verify and rejection_sample timed on the same recorded rows, one request's
  rows at a time as the router verifies them, against the mean wall time of a round.

The in-process loop pins K; the adaptive depth lives in the router (deployments/router.py), so it is
not measured here. Writes bench/results/<name>.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoTokenizer

import specserve.decoding.generate
from specserve import decoding
from specserve.bench.inprocess import load_pair, run_specserve
from specserve.common.config import load_config
from specserve.decoding.rejection import block_verify, expected_num_accepted, rejection_sample
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.speculation import as_tensor
from specserve.training.prompts import load_prompt_set, select_prompts

TEMPERATURES = (1.0, 0.7)
DEPTHS = (4, 8)
VERIFICATIONS = ("token", "block")
TIMED_ROUNDS = 100          # recorded rounds per K whose rows the two functions are timed on
TIMING_REPEATS = 5


class RoundRecorder:
    """Wraps verify_answer as generate() calls it (the target's processed rows and the proposal, in
    process): per verify round with draft rows, both verifiers' exact expected accepted counts on
    its rows, and the first TIMED_ROUNDS rows per K."""

    def __init__(self) -> None:
        self.expected: dict[tuple, list[tuple[float, float]]] = {}
        self.timed_rows: dict[int, list[tuple]] = {}
        self.cell: tuple | None = None

    def wrap(self, verify_answer):
        def recorded(rows, proposal, generator, verification="block"):
            if proposal.token_ids and proposal.support is not None:
                inputs = (torch.tensor([proposal.token_ids]),
                          proposal.support.tensors().dense(rows.shape[-1]).unsqueeze(0), as_tensor(rows).unsqueeze(0))
                token_wise, block = expected_num_accepted(*inputs)
                self.expected.setdefault(self.cell, []).append((token_wise.item(), block.item()))
                timed = self.timed_rows.setdefault(len(proposal.token_ids), [])
                if len(timed) < TIMED_ROUNDS:
                    timed.append(inputs)
            return verify_answer(rows, proposal, generator, verification)
        return recorded


@contextmanager
def recording(recorder: RoundRecorder):
    original = decoding.generate.verify_answer
    decoding.generate.verify_answer = recorder.wrap(original)
    try:
        yield recorder
    finally:
        decoding.generate.verify_answer = original


def verify_cost_us(rounds: list[tuple]) -> dict[str, float]:
    """Median microseconds per call of each verifier over the same rows, the two taking turns."""
    times = {"token": [], "block": []}
    generator = torch.Generator().manual_seed(0)
    for _ in range(TIMING_REPEATS):
        for inputs in rounds:
            for name, verifier in (("token", rejection_sample), ("block", block_verify)):
                started = time.perf_counter()
                verifier(*inputs, generator=generator)
                times[name].append(time.perf_counter() - started)
    return {name: 1e6 * statistics.median(values) for name, values in times.items()}


def summarize(records: list, expected: list[tuple[float, float]]) -> dict:
    output = sum(r.num_output_tokens for r in records)
    rounds = max(1, sum(r.rounds for r in records))
    return {"requests": len(records), "output_tokens": output, "rounds": rounds,
            "tokens_per_pass": output / max(1, sum(r.target_passes for r in records)),
            "tokens_per_round": (sum(r.num_accepted for r in records) + rounds) / rounds,
            "acceptance": sum(r.num_accepted for r in records) / max(1, sum(r.num_drafted for r in records)),
            "tokens_per_s": output / sum(r.wall_s for r in records),
            "round_ms": 1e3 * sum(r.wall_s for r in records) / rounds,
            "exact_rounds": len(expected)}


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    loadavg_start = list(os.getloadavg())
    config = load_config(args.config)
    pair = load_pair(config.target.path, config.draft.path)
    tokenizer = AutoTokenizer.from_pretrained(config.resolved_tokenizer_path, local_files_only=True)
    prompts = select_prompts(load_prompt_set("thirdparty").prompts, args.num_prompts)
    prompt_ids = {p.prompt_id: tokenizer.encode(p.text, add_special_tokens=False) for p in prompts}
    recorder = RoundRecorder()
    records: dict[tuple, list] = {}
    with recording(recorder):
        warm = SamplingParams(temperature=1.0, seed=0, max_tokens=16)
        for verification in VERIFICATIONS:
            run_specserve(pair, "warmup", 0, prompt_ids[prompts[0].prompt_id], warm, 4, verification)
        recorder.expected.clear()
        for temperature in TEMPERATURES:
            for depth in DEPTHS:
                started = time.perf_counter()
                for run_index in range(args.runs):
                    for index, prompt in enumerate(prompts):
                        order = VERIFICATIONS if (run_index + index) % 2 == 0 else VERIFICATIONS[::-1]
                        params = SamplingParams(temperature=temperature, seed=1000 * run_index + index,
                                                max_tokens=args.max_tokens)
                        for verification in order:
                            recorder.cell = (temperature, depth)
                            record = run_specserve(pair, prompt.prompt_id, run_index, prompt_ids[prompt.prompt_id],
                                                   params, depth, verification)
                            records.setdefault((temperature, depth, verification), []).append(record)
                print(f"T={temperature} K={depth}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    cells = []
    for temperature in TEMPERATURES:
        for depth in DEPTHS:
            expected = recorder.expected[(temperature, depth)]
            token_exact = statistics.fmean(e[0] for e in expected)
            block_exact = statistics.fmean(e[1] for e in expected)
            cells.append({"temperature": temperature, "K": depth,
                          "token": summarize(records[(temperature, depth, "token")], expected),
                          "block": summarize(records[(temperature, depth, "block")], expected),
                          "exact_accepted_per_round": {"token": token_exact, "block": block_exact,
                                                       "rounds": len(expected)},
                          "exact_tokens_per_round_gain": (1 + block_exact) / (1 + token_exact) - 1})
    costs = {depth: verify_cost_us(recorder.timed_rows[depth]) for depth in DEPTHS if depth in recorder.timed_rows}
    return {"name": args.name, "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "settings": {"prompt_set": "thirdparty", "num_prompts": len(prompts), "max_tokens": args.max_tokens,
                         "runs": args.runs, "threads": args.threads, "target": config.target.path,
                         "draft": config.draft.path, "loadavg_start": loadavg_start,
                         "loadavg_end": list(os.getloadavg())},
            "cells": cells, "verify_cost_us": {str(k): v for k, v in costs.items()}}


def render(result: dict) -> str:
    settings = result["settings"]
    lines = [f"# Block vs token-wise verification, in process ({result['created_utc']})", "",
             f"Default pair, {settings['num_prompts']} third-party prompts x {settings['runs']} runs, "
             f"{settings['max_tokens']} tokens each, sampled (no top-k/top-p), K pinned; the two verifiers take "
             f"turns on the same requests (same seeds). Load average {settings['loadavg_start']} -> "
             f"{settings['loadavg_end']} (a shared box: tok/s is noisy, tokens per pass is not). "
             "`python -m specserve.bench.figures.block_verify`", "",
             "| T | K | verifier | tok/pass | tok/round | accept | tok/s | exact accepted/round (same rows) |",
             "|---|---|---|---|---|---|---|---|"]
    for cell in result["cells"]:
        for name in ("token", "block"):
            row = cell[name]
            lines.append(f"| {cell['temperature']} | {cell['K']} | {name} | {row['tokens_per_pass']:.3f} | "
                         f"{row['tokens_per_round']:.3f} | {row['acceptance']:.3f} | {row['tokens_per_s']:.1f} | "
                         f"{cell['exact_accepted_per_round'][name]:.3f} |")
    lines += ["", "Paired exact gain in tokens per verify round (block over token-wise, expected values on the "
              "rows of every round both variants ran):", ""]
    for cell in result["cells"]:
        rounds = cell["exact_accepted_per_round"]["rounds"]
        tok_s = cell["block"]["tokens_per_s"] / cell["token"]["tokens_per_s"] - 1
        lines.append(f"- T={cell['temperature']}, K={cell['K']}: {100 * cell['exact_tokens_per_round_gain']:+.1f}% "
                     f"({rounds} rounds); measured tokens/pass {100 * (cell['block']['tokens_per_pass'] / cell['token']['tokens_per_pass'] - 1):+.1f}%, "
                     f"tok/s {100 * tok_s:+.1f}%")
    lines += ["", "Verify cost per round (median us per call on the same recorded rows, one request at a time):", ""]
    round_ms = statistics.fmean(cell["token"]["round_ms"] for cell in result["cells"])
    for depth, cost in result["verify_cost_us"].items():
        extra = cost["block"] - cost["token"]
        lines.append(f"- K={depth}: token-wise {cost['token']:.0f} us, block {cost['block']:.0f} us "
                     f"(+{extra:.0f} us, {100 * extra / (1e3 * round_ms):.2f}% of a mean {round_ms:.1f} ms round)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.figures.block_verify", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="specserve YAML (default: the shipped pair)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default="block-verify")
    args = parser.parse_args(argv)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    markdown = render(result)
    (out / f"{args.name}.md").write_text(markdown)
    print(markdown)
    return result


if __name__ == "__main__":
    main()
