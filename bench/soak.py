"""`make soak`: a long mixed workload against the default pair; zero errors, bounded memory.

Four (`--streams`) closed-loop clients send, at random, greedy and sampled completions, streamed
or not, chat completions, and streams they drop on purpose (after the first chunk or mid-stream).
Every few seconds the resident memory (RSS) of each of the app's Ray processes is sampled (router,
ingress, proxy, worker replicas, engine actors, policy actor, Serve controller). After the run:
errors (an HTTP status other than 200, or a failed request that was not dropped on purpose),
requests per kind, each process's RSS when warm-up ended and at the end, and its growth. It passes
with zero errors, every process growing at most `--max-growth` (10%) after warm-up, and no request
or KV sequence left held once the clients stop; the JSON goes to --out.

Why after warm-up: the first minute allocates for good (model weights, torch's allocator pools,
the KV block pool growing to the tokens it holds, compiled regex caches). A leak keeps growing.
An engine's KV pool grows into its budget as prefix-cached blocks accumulate (docs/kv-memory.md),
by design, so with the default budget (gigabytes) an engine's RSS would rise for the whole run
without leaking anything: the soak gives each engine a budget of --kv-tokens tokens, which the
run's requests fill within the warm-up, after which the pool evicts and holds its size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import torch
from transformers import AutoConfig

from specserve.bench import DEFAULT_OUT_DIR
from specserve.bench.http_rows import free_port
from specserve.common.config import ModelSpec, load_config
from specserve.decoding.paged_cache import kv_bytes_per_token
from specserve.training.prompts import load_prompt_set

KINDS = ("greedy", "sampled_stream", "greedy_stream", "chat", "dropped")
APP_PROCESS = re.compile(r"^ray::(?:ServeReplica:specserve:)?(\w+)")
# EngineProcess: a worker replica's engine actor (deployments/engine_process.py), the model's process.
APP_ACTORS = {"Ingress", "Router", "TargetWorker", "DraftWorker", "EngineProcess",
              "PolicyActor", "ProxyActor", "ServeController"}


def kv_budget(spec: ModelSpec, tokens: int) -> ModelSpec:
    """spec with a KV budget of `tokens` tokens (float32 keys and values, as a CPU engine holds them)."""
    config = AutoConfig.from_pretrained(spec.path, local_files_only=True).get_text_config(decoder=True)
    return spec.model_copy(update={"kv_cache_memory_gb": tokens * kv_bytes_per_token(config, torch.float32) / 2**30})


def app_processes() -> dict[int, str]:
    """pid -> a stable name for each of the app's Ray processes (from the process title)."""
    found = {}
    for process in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(process.info["cmdline"] or [])
        match = APP_PROCESS.match(title)
        if match and match.group(1) in APP_ACTORS:
            found[process.info["pid"]] = match.group(1)
    return found


@dataclass
class MemoryTrace:
    """RSS samples per process: {pid: [(seconds since start, bytes)]}."""

    names: dict[int, str] = field(default_factory=dict)
    samples: dict[int, list[tuple[float, int]]] = field(default_factory=dict)

    def sample(self, at_s: float) -> None:
        for pid, name in app_processes().items():
            try:
                rss = psutil.Process(pid).memory_info().rss
            except psutil.Error:  # gone between the listing and the read
                continue
            self.names.setdefault(pid, name)
            self.samples.setdefault(pid, []).append((at_s, rss))

    def growth(self, warmup_s: float) -> list[dict]:
        """Per process alive through the run: RSS at the end of warm-up, at the end, growth."""
        rows = []
        for pid, points in self.samples.items():
            after = [rss for at_s, rss in points if at_s >= warmup_s]
            if len(after) < 2:
                continue
            rows.append({"process": self.names[pid], "pid": pid, "rss_after_warmup_mb": round(after[0] / 2**20, 1),
                         "rss_end_mb": round(after[-1] / 2**20, 1), "rss_peak_mb": round(max(after) / 2**20, 1),
                         "growth": round(after[-1] / after[0] - 1.0, 4),
                         "growth_percent": round(100 * (after[-1] / after[0] - 1.0), 2)})
        return sorted(rows, key=lambda row: row["process"])


@dataclass
class Tally:
    done: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    errors: list[str] = field(default_factory=list)
    tokens: int = 0


def completion_body(model: str, prompt: str, kind: str, rng: random.Random) -> tuple[str, dict]:
    """(route, body) for one request of the given kind."""
    greedy = kind in ("greedy", "greedy_stream", "dropped")
    body: dict = {"model": model, "max_tokens": rng.choice([16, 48, 96]),
                  "temperature": 0.0 if greedy else 0.8, "stream": kind != "greedy"}
    if not greedy:
        body["seed"] = rng.randrange(1 << 30)
    if kind == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def one_request(client: httpx.AsyncClient, url: str, route: str, body: dict, kind: str,
                      rng: random.Random, tally: Tally) -> None:
    drop_after = rng.choice([1, 4]) if kind == "dropped" else None
    try:
        if not body["stream"]:
            response = await client.post(url + route, json=body)
            if response.status_code != 200:
                tally.errors.append(f"{kind}: HTTP {response.status_code} {response.text[:200]}")
                return
            tally.tokens += response.json()["usage"]["completion_tokens"]
        else:
            async with client.stream("POST", url + route, json=body) as response:
                if response.status_code != 200:
                    tally.errors.append(f"{kind}: HTTP {response.status_code}")
                    return
                chunks = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks += 1
                        if "error" in line[:20]:
                            tally.errors.append(f"{kind}: {line[:200]}")
                            return
                    if drop_after is not None and chunks >= drop_after:
                        break  # leaving the block drops the connection: a deliberate cancel
        tally.done[kind] += 1
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        tally.errors.append(f"{kind}: {exc!r}")


async def clients(url: str, model: str, prompts: list[str], streams: int, duration_s: float,
                  tally: Tally, seed: int) -> None:
    deadline = time.monotonic() + duration_s

    async def client_loop(index: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(seed + index)
        while time.monotonic() < deadline:
            kind = rng.choice(KINDS)
            route, body = completion_body(model, rng.choice(prompts), kind, rng)
            await one_request(client, url, route, body, kind, rng, tally)

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(client_loop(i, client) for i in range(streams)))


def held_after(timeout_s: float = 30.0) -> dict:
    """Router requests and engine sequences still held once the clients stopped (should be 0)."""
    from specserve.cluster.status import read_engine_stats, router_status

    deadline = time.monotonic() + timeout_s
    while True:
        router = router_status(timeout_s=5) or {}
        sequences = sum(getattr(stats, "sequences", 0) for stats in read_engine_stats(timeout_s=5))
        held = {"active_requests": router.get("active_requests"), "sequences": sequences}
        if held == {"active_requests": 0, "sequences": 0} or time.monotonic() > deadline:
            return held
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--config")
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--sample-every-s", type=float, default=5.0)
    parser.add_argument("--max-growth", type=float, default=0.10)
    parser.add_argument("--kv-tokens", type=int, default=8192,
                        help="each engine's KV budget in tokens: few enough for the warm-up to fill it")
    parser.add_argument("--prompts", default="thirdparty")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=f"{DEFAULT_OUT_DIR}/soak.json", help="the JSON (published: bench/results/soak-cpu-2core.json)")
    args = parser.parse_args(argv)

    from specserve.cluster.local import start_local, stop_local

    base = load_config(args.config)
    config = base.model_copy(update={
        "http": base.http.model_copy(update={"host": "127.0.0.1", "port": free_port()}),
        "target": kv_budget(base.target, args.kv_tokens),
        "draft": base.draft and kv_budget(base.draft, args.kv_tokens)})
    prompts = [p.text for p in load_prompt_set(args.prompts).prompts]
    url = start_local(config)
    memory, tally, stop = MemoryTrace(), Tally(), threading.Event()
    started = time.monotonic()

    def sampler() -> None:
        while not stop.is_set():
            memory.sample(time.monotonic() - started)
            stop.wait(args.sample_every_s)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        asyncio.run(clients(url, config.model_name, prompts, args.streams, args.duration_s, tally, args.seed))
        held = held_after()
        memory.sample(time.monotonic() - started)
    finally:
        stop.set()
        thread.join(timeout=10)
        stop_local()
    growth = memory.growth(args.warmup_s)
    worst = max((row["growth"] for row in growth), default=0.0)
    passed = not tally.errors and worst <= args.max_growth and held == {"active_requests": 0, "sequences": 0}
    result = {"command": "python -m specserve.bench.soak " + " ".join(argv if argv is not None else sys.argv[1:]),
              "duration_s": args.duration_s, "warmup_s": args.warmup_s, "streams": args.streams,
              "kv_tokens": args.kv_tokens,
              "requests": tally.done, "requests_total": sum(tally.done.values()), "completion_tokens": tally.tokens,
              "errors": len(tally.errors), "error_samples": tally.errors[:10], "held_after": held,
              "max_growth_allowed": args.max_growth, "max_growth_allowed_percent": round(100 * args.max_growth, 2),
              "worst_growth": worst, "worst_growth_percent": round(100 * worst, 2), "passed": passed, "processes": growth,
              "rss_trace_mb": {f"{memory.names[pid]}:{pid}": [(round(t, 1), round(rss / 2**20, 1)) for t, rss in points]
                               for pid, points in memory.samples.items()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rss_trace_mb"}, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
