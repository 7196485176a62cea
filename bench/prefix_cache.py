"""Prefix caching's effect on time to first token: 16 requests sharing a long system prompt, each
with its own question, through the target engine in process (scheduler, chunked prefill, paged
cache; no Ray, no HTTP), with prefix caching on and off in one run.

    python -m bench.prefix_cache [--system-tokens 3000] [--context 4096] [--requests 16] [--out FILE.md]

The model is a look-alike of the shipped target (its architecture and tokenizer, random weights,
max_position_embeddings = --context): time to first token depends on the shapes, not the weights.
Two arrival patterns per setting, each on a fresh engine: one request at a time (each alone on the
engine: the first prefill is cold, the others find the system prompt cached) and all at once (a
burst the engine batches and chunks; its makespan gives the prompt throughput). TTFT here is the prefill verify's time in the engine, from submit to answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from cluster.config import SpecServeConfig
from decoding.sampling import SamplingParams
from deployments.target_worker import TargetEngine

DEFAULT_TARGET = Path(__file__).resolve().parents[1] / "models" / "default" / "target"
DOCS = Path(__file__).resolve().parents[1] / "docs"
GREEDY = SamplingParams(temperature=0, max_tokens=1)


def look_alike(directory: Path, context: int) -> Path:
    """The shipped target's architecture and tokenizer with random weights and a longer context."""
    config = AutoConfig.from_pretrained(DEFAULT_TARGET, local_files_only=True)
    config.max_position_embeddings = context
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_TARGET / name, directory / name)
    return directory


def prompts(tokenizer_dir: Path, system_tokens: int, num_requests: int) -> tuple[list[int], list[list[int]]]:
    """A system prompt of system_tokens tokens (the project's docs, as text) and num_requests
    distinct questions after it."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    text = "\n".join(path.read_text() for path in sorted(DOCS.glob("*.md")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < system_tokens:
        raise ValueError(f"docs/ hold {len(ids)} tokens, fewer than --system-tokens {system_tokens}")
    questions = [tokenizer.encode(f"\nQuestion {i}: what does section {i} say about the KV cache of "
                                  f"engine {i * 7 % 13}?\nAnswer:", add_special_tokens=False)
                 for i in range(num_requests)]
    return ids[:system_tokens], questions


async def one_at_a_time(engine: TargetEngine, histories: list[list[int]], tag: str) -> list[tuple[float, int]]:
    """(TTFT seconds, cached tokens) of each request, each alone on the engine."""
    results = []
    for i, history in enumerate(histories):
        started = time.perf_counter()
        _, span = await engine.verify(f"{tag}-{i}", history, 1, GREEDY)
        results.append((time.perf_counter() - started, span.cached_tokens))
        await engine.release(f"{tag}-{i}")
    return results


async def burst(engine: TargetEngine, histories: list[list[int]], tag: str) -> tuple[list[tuple[float, int]], float]:
    """Every request at once: (TTFT seconds, cached tokens) of each, and the makespan."""
    started = time.perf_counter()

    async def request(i: int, history: list[int]) -> tuple[float, int]:
        _, span = await engine.verify(f"{tag}-{i}", history, 1, GREEDY)
        return time.perf_counter() - started, span.cached_tokens

    results = await asyncio.gather(*(request(i, history) for i, history in enumerate(histories)))
    makespan = time.perf_counter() - started
    for i in range(len(histories)):
        await engine.release(f"{tag}-{i}")
    return list(results), makespan


def summary(results: list[tuple[float, int]]) -> dict:
    ttfts = sorted(seconds for seconds, _ in results)
    return {"ttft_p50_s": statistics.median(ttfts), "ttft_max_s": ttfts[-1],
            "first_request_ttft_s": results[0][0], "cached_tokens_mean": statistics.mean(c for _, c in results)}


def run(model_dir: Path, histories: list[list[int]], prefix_caching: bool) -> dict:
    spec = {"path": str(model_dir), "dtype": "float32", "device": "cpu", "torch_threads": 1, "max_sequences": 64,
            "prefix_caching": prefix_caching}
    options = SpecServeConfig().engine_options() | {"policy_actor": None}

    async def fresh_engine() -> TargetEngine:
        """An engine whose cache holds nothing of the prompts (one short warm-up request)."""
        engine = TargetEngine(spec, options)
        await engine.verify("warmup", [1] * 64, 1, GREEDY)
        await engine.release("warmup")
        return engine

    async def scenario():
        alone = await one_at_a_time(await fresh_engine(), histories, "alone")
        together, makespan = await burst(await fresh_engine(), histories, "burst")
        return alone, together, makespan

    alone, together, makespan = asyncio.run(scenario())
    prompt_tokens = sum(map(len, histories))
    return {"one_at_a_time": summary(alone),
            "burst": {**summary(together), "makespan_s": makespan, "requests_per_s": len(histories) / makespan,
                      "prompt_tokens_per_s": prompt_tokens / makespan}}


def markdown(record: dict) -> str:
    on, off = record["on"], record["off"]
    lines = [f"# Prefix caching: {record['requests']} requests sharing a {record['system_tokens']}-token system "
             "prompt", "",
             f"`{record['command']}`: target engine in process, look-alike of the shipped target "
             f"(random weights, context {record['context']}), fp32, 1 thread, prefill_token_budget "
             f"{record['prefill_token_budget']}; load average at start {record['load_at_start']}.", "",
             "| arrivals | TTFT p50 off (s) | TTFT p50 on (s) | on / off | first request on (s) | mean cached tokens on |",
             "|---|---|---|---|---|---|"]
    for pattern in ("one_at_a_time", "burst"):
        a, b = off[pattern], on[pattern]
        lines.append(f"| {pattern.replace('_', ' ')} | {a['ttft_p50_s']:.3f} | {b['ttft_p50_s']:.3f} "
                     f"| {b['ttft_p50_s'] / a['ttft_p50_s']:.3f} | {b['first_request_ttft_s']:.3f} "
                     f"| {b['cached_tokens_mean']:.0f} |")
    lines += ["", f"Burst throughput: {off['burst']['requests_per_s']:.2f} requests/s "
              f"({off['burst']['prompt_tokens_per_s']:.0f} prompt tokens/s) off, "
              f"{on['burst']['requests_per_s']:.2f} requests/s ({on['burst']['prompt_tokens_per_s']:.0f}) on."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-tokens", type=int, default=3000)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--out", default=None, help="write the markdown table here (and the JSON beside it)")
    args = parser.parse_args()
    load_at_start = [round(x, 1) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = look_alike(Path(tmp), args.context)
        system, questions = prompts(model_dir, args.system_tokens, args.requests)
        histories = [system + question for question in questions]
        record = {"command": "python -m bench.prefix_cache " + " ".join(
                      f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None),
                  "requests": args.requests, "system_tokens": args.system_tokens, "context": args.context,
                  "prefill_token_budget": SpecServeConfig().batching.prefill_token_budget,
                  "load_at_start": load_at_start}
        for name, prefix_caching in (("off", False), ("on", True)):
            record[name] = run(model_dir, histories, prefix_caching)
            print(name, json.dumps(record[name]), flush=True)
    text = markdown(record)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
