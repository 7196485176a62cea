"""Micro-benchmark: what penalties add to a verify's row processing (decoding.speculation.target_rows),
by vocabulary size and history length, at K = 8 (9 rows), sampled, one torch thread.

    python -m specserve.bench.penalty_cost [--out bench/results/cpu-2core-penalty-cost.md]

Penalties touch only the columns of tokens in the history (decoding.row_processors.Penalties), so
their cost follows the history length; without penalties nothing is added.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from specserve.decoding.sampling import SamplingParams
from specserve.decoding.speculation import target_rows

NUM_DRAFT_TOKENS = 8
REPS = 40
PLAIN = SamplingParams(temperature=0.8)
PENALIZED = SamplingParams(temperature=0.8, repetition_penalty=1.05, presence_penalty=0.5,
                           frequency_penalty=0.5)


def min_ms(logits: torch.Tensor, params: SamplingParams, token_ids: list[int], first_output_index: int) -> float:
    best = float("inf")
    for _ in range(REPS):
        started = time.perf_counter()
        target_rows(logits, params, None, first_output_index, token_ids)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lines = ["| vocabulary | history tokens | target_rows ms, no penalties | with penalties | added |",
             "|---|---|---|---|---|"]
    for vocab_size in (32_000, 152_064):
        for history_len in (256, 4096):
            token_ids = torch.randint(0, vocab_size, (history_len + NUM_DRAFT_TOKENS,)).tolist()
            logits = torch.randn(NUM_DRAFT_TOKENS + 1, vocab_size)
            first_output_index = history_len // 2
            plain = min_ms(logits, PLAIN, token_ids, first_output_index)
            penalized = min_ms(logits, PENALIZED, token_ids, first_output_index)
            lines.append(f"| {vocab_size} | {history_len} | {plain:.2f} | {penalized:.2f} | {penalized - plain:.2f} |")
    load = os.getloadavg()[0]
    report = "\n".join([f"Row processing of one verify (K={NUM_DRAFT_TOKENS}, 9 rows, temperature only), min of {REPS}, "
                        f"1 torch thread, `python -m specserve.bench.penalty_cost`; 1-minute load average {load:.1f} "
                        "on 2 cores when it ended", "", *lines, ""])
    print(report)
    if args.out is not None:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
