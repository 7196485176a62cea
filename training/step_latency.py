"""Model step latency on a warm KV cache: the measurement the pair evaluation (model card) and the
benchmark (bench.inprocess) both report, so their milliseconds mean the same thing. A step is a
real forward over n new tokens after the cache was cropped back to the context, i.e. a decode step
plus the rollback a speculative round does."""

from __future__ import annotations

import statistics
import time

from specserve.decoding.scheduler import Scheduler


def step_latency_samples(engine: Scheduler, context_ids: list[int], num_new_tokens: int, reps: int = 15,
                         warmup: int = 3) -> list[float]:
    """Seconds of each of `reps` forwards over num_new_tokens new tokens on a warm cache holding
    context_ids (the engine crops back to the context before every repetition)."""
    seq_id = f"step-latency-{num_new_tokens}"
    new_tokens = [context_ids[i % len(context_ids)] for i in range(num_new_tokens)]
    engine.forward(seq_id, context_ids)
    samples = []
    try:
        for i in range(warmup + reps):
            started = time.perf_counter()
            logits = engine.forward(seq_id, context_ids + new_tokens, num_rows=num_new_tokens)
            logits.sum().item()  # wait for the device
            if i >= warmup:
                samples.append(time.perf_counter() - started)
    finally:
        engine.release(seq_id)
    return samples


def step_latency_s(engine: Scheduler, context_ids: list[int], num_new_tokens: int, reps: int = 15,
                   warmup: int = 3) -> float:
    """Median of step_latency_samples."""
    return statistics.median(step_latency_samples(engine, context_ids, num_new_tokens, reps, warmup))


def step_latency(engine: Scheduler, token_ids: list[int], context: int, steps: int, warmup: int = 3) -> dict:
    """Milliseconds of one single-token forward on top of a warm cache of `context` tokens
    (step_latency_samples: a real decode step plus a rollback each time)."""
    if len(token_ids) < context + 1:
        raise ValueError(f"need {context + 1} tokens to time a step at context {context}, got {len(token_ids)}")
    times = sorted(1000 * s for s in step_latency_samples(engine, list(token_ids[:context]), 1, steps, warmup))
    return {"median_ms": statistics.median(times), "p10_ms": times[len(times) // 10],
            "p90_ms": times[min(len(times) - 1, (9 * len(times)) // 10)], "mean_ms": statistics.fmean(times)}
