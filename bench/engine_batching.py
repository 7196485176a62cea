"""What one batched forward costs: ms per forward for B rows x n new tokens over a slot KV cache,
next to the per-sequence DynamicCache runner (B=1, and B calls in a loop as today's engines run).

    python -m specserve.bench.engine_batching [--model PATH] [--device cpu] [--dtype float32] [--threads 1]

Each row holds `--cached` tokens (128) before the timed forward; the full-history protocol crops
every row back to them before each repetition, as a verify round does. Prints a table and writes
bench/results/engine-batching-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from specserve.decoding.scheduler import engine_for_model
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.model_runner import load_causal_lm
from specserve.decoding.proposers import DraftModelProposer, ProposeCall
from specserve.decoding.sampling import SamplingParams

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "default" / "target"
DEFAULT_DRAFT = DEFAULT_MODEL.parent / "draft"
ROWS = (1, 2, 4, 8, 16)
NEW_TOKENS = (1, 5)
DRAFT_ROWS = (1, 4, 8, 16)


def forward_ms(runners: dict, histories: dict[str, list[int]], num_new_tokens: int, reps: int,
               warmup: int) -> dict[str, list[float]]:
    """ms of each runner's forward_batch over every row's history + num_new_tokens tokens; the
    runners take turns every repetition, so a busy machine slows them alike."""
    calls = [ForwardCall(seq_id, history + history[:num_new_tokens], num_new_tokens)
             for seq_id, history in histories.items()]
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for runner in runners.values():
        runner.forward_batch([ForwardCall(seq_id, history) for seq_id, history in histories.items()])
    for i in range(warmup + reps):
        for name, runner in runners.items():
            started = time.perf_counter()
            rows = runner.forward_batch(calls)
            rows[-1].sum().item()  # wait for the device
            if i >= warmup:
                samples[name].append(1000 * (time.perf_counter() - started))
    for runner in runners.values():
        for seq_id in histories:
            runner.release(seq_id)
    return samples


def propose_ms(proposers: dict, histories: dict[str, list[int]], num_tokens: int, reps: int,
               warmup: int) -> dict[str, list[float]]:
    """ms of each proposer's greedy propose_batch of num_tokens tokens for every row (taking turns)."""
    greedy = SamplingParams(temperature=0)
    calls = [ProposeCall(seq_id, history, num_tokens, greedy) for seq_id, history in histories.items()]
    samples: dict[str, list[float]] = {name: [] for name in proposers}
    for i in range(warmup + reps):
        for name, proposer in proposers.items():
            started = time.perf_counter()
            proposer.propose_batch(calls)
            if i >= warmup:
                samples[name].append(1000 * (time.perf_counter() - started))
    for proposer in proposers.values():
        for seq_id in histories:
            proposer.release(seq_id)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT), help="'' skips the drafting table")
    parser.add_argument("--draft-tokens", type=int, default=4, help="K of the drafting table")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cached", type=int, default=128, help="tokens each row holds before the forward")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    load_at_start = list(os.getloadavg())

    model = load_causal_lm(args.model, dtype=args.dtype, device=args.device, num_threads=args.threads)
    batched = engine_for_model(model, max_sequences=max(ROWS))
    per_sequence = engine_for_model(model, max_sequences=max(ROWS))
    generator = torch.Generator().manual_seed(0)
    vocab_size = batched.vocab_size

    def histories(num_rows: int) -> dict[str, list[int]]:
        return {f"r{b}": torch.randint(1, vocab_size, (args.cached,), generator=generator).tolist()
                for b in range(num_rows)}

    runners = {"slot": batched, "per_sequence_loop": per_sequence}
    results = []
    for num_new_tokens in NEW_TOKENS:
        for num_rows in ROWS:
            samples = forward_ms(runners, histories(num_rows), num_new_tokens, args.reps, args.warmup)
            result = {"rows": num_rows, "new_tokens": num_new_tokens}
            for name, values in samples.items():
                result[f"{name}_ms"] = round(statistics.median(values), 2)
                result[f"{name}_min_ms"] = round(min(values), 2)
            results.append(result)
            print(f"{num_rows:>2} x {num_new_tokens}: slot {result['slot_ms']:7.1f} ms (min {result['slot_min_ms']:.1f})"
                  f"   per-sequence loop {result['per_sequence_loop_ms']:7.1f} ms "
                  f"(min {result['per_sequence_loop_min_ms']:.1f})", flush=True)

    base = {n: next(r["slot_ms"] for r in results if r["rows"] == 1 and r["new_tokens"] == n) for n in NEW_TOKENS}
    print("\n| rows x new tokens | slot ms/forward (min) | x one row | per-sequence DynamicCache, B calls ms (min) |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']}x{r['new_tokens']} | {r['slot_ms']:.1f} ({r['slot_min_ms']:.1f}) "
              f"| {r['slot_ms'] / base[r['new_tokens']]:.2f} "
              f"| {r['per_sequence_loop_ms']:.1f} ({r['per_sequence_loop_min_ms']:.1f}) |")
    drafting = []
    if args.draft:
        draft = load_causal_lm(args.draft, dtype=args.dtype, device=args.device)
        proposers = {"slot": DraftModelProposer(engine_for_model(draft, max_sequences=max(ROWS))),
                     "per_sequence_loop": DraftModelProposer(engine_for_model(draft, max_sequences=max(ROWS)))}
        print(f"\n| draft rows (K={args.draft_tokens}, greedy) | slot propose_batch ms (min) "
              "| per-sequence loop ms (min) |\n|---|---|---|")
        for num_rows in DRAFT_ROWS:
            samples = propose_ms(proposers, histories(num_rows), args.draft_tokens, args.reps, args.warmup)
            result = {"rows": num_rows, "draft_tokens": args.draft_tokens}
            for name, values in samples.items():
                result[f"{name}_ms"] = round(statistics.median(values), 2)
                result[f"{name}_min_ms"] = round(min(values), 2)
            drafting.append(result)
            print(f"| {num_rows} | {result['slot_ms']:.1f} ({result['slot_min_ms']:.1f}) "
                  f"| {result['per_sequence_loop_ms']:.1f} ({result['per_sequence_loop_min_ms']:.1f}) |", flush=True)

    record = {
        "model": args.model, "device": args.device, "dtype": args.dtype, "torch_threads": args.threads,
        "cached_tokens_per_row": args.cached, "reps": args.reps,
        "statistic": "median (and min) ms per forward; runners alternate every repetition",
        "machine": platform.machine(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "load_average_at_start": load_at_start, "load_average_at_end": list(os.getloadavg()),
        "results": results,
        "draft": args.draft or None, "drafting": drafting,
    }
    out = Path(args.out or Path(__file__).parent / "results" / f"engine-batching-{args.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
