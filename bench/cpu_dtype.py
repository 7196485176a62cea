"""bf16 against float32 on CPU for the default pair: the CPU resolution of `dtype: auto`.

Times one decode step (1 and 8 new tokens over a cached prompt) of each model in each dtype, the
dtypes taking turns, one torch thread. `python -m specserve.bench.cpu_dtype` (a few seconds); the figures
are in docs/real-checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specserve.cluster.config import DEFAULT_MODELS_DIR
from specserve.decoding.batched_runner import BatchedModelRunner
from specserve.decoding.scheduler import Scheduler


def step_ms(engine: Scheduler, prompt: list[int], new: int, repeats: int) -> float:
    engine.forward("s", prompt)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.forward("s", prompt + list(range(10, 10 + new)), num_rows=new)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cached", type=int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    prompt = list(range(100, 100 + args.cached))
    results = {}
    for model in ("draft", "target"):
        runners = {dtype: Scheduler(BatchedModelRunner(str(DEFAULT_MODELS_DIR / model), dtype=dtype, device="cpu"))
                   for dtype in ("float32", "bfloat16")}
        for new in (1, 8):
            samples = {dtype: [] for dtype in runners}
            for _ in range(3):  # turns
                for dtype, runner in runners.items():
                    samples[dtype].append(step_ms(runner, prompt, new, args.repeats))
            for dtype, values in samples.items():
                results[f"{model} {new} token(s) {dtype} ms"] = round(statistics.median(values), 3)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
