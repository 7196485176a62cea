"""HTTP rows: specserve and target-only through the whole disaggregated stack (ingress -> router ->
draft/target engine actors), measured from a streaming client on loopback.

Both applications run side by side in one Serve instance: specserve at "/" and a target-only
copy (speculation.proposer "none", its own target engine) at TARGET_ONLY_PREFIX, so single-stream
requests of the two can be interleaved prompt by prompt and background load hits both alike.
TTFT is client-side (request sent -> first streamed text); rounds, acceptance and per-round
overhead come from the router's final "speculation" chunk.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from specserve.bench.perfmodel import percentile
from specserve.bench.records import RequestRecord
from specserve.common.config import SpecServeConfig

TARGET_ONLY_APP = "specserve-target-only"
TARGET_ONLY_PREFIX = "/target-only"
REQUEST_TIMEOUT_S = 600.0


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_configs(config: SpecServeConfig, num_draft_tokens: int, adaptive: bool,
                 port: int) -> tuple[SpecServeConfig, SpecServeConfig]:
    """(specserve, target-only) configs for the HTTP rows: the draft-model proposer at a pinned
    depth K (or the config's adaptive policy), and the same stack with proposer "none"."""
    if config.draft is None:
        raise ValueError("the benchmark needs a draft model (set draft.path in the config)")
    spec = config.speculation
    speculation = {"proposer": "draft", "adaptive": adaptive,
                   "num_draft_tokens": num_draft_tokens if not adaptive else spec.num_draft_tokens,
                   "min_draft_tokens": min(spec.min_draft_tokens, num_draft_tokens),
                   "max_draft_tokens": max(spec.max_draft_tokens, num_draft_tokens)}
    base = config.model_dump(mode="json")
    base["http"] = {"host": "127.0.0.1", "port": port}
    speculative = SpecServeConfig.model_validate({**base, "speculation": {**base["speculation"], **speculation}})
    target_only = SpecServeConfig.model_validate({**base, "speculation": {**base["speculation"], "proposer": "none"}})
    return speculative, target_only


@dataclass(frozen=True)
class Endpoints:
    specserve: str
    target_only: str
    model_name: str


@contextmanager
def served_apps(first: SpecServeConfig, more: Sequence[tuple[str, str, SpecServeConfig]] = ()) -> Iterator[str]:
    """One local cluster with logical CPUs for every app at once (start_local alone would reserve
    for one), started as `specserve serve` starts it (init_local_ray: Serve's data plane too,
    cluster/serve_data_plane.py): `first` served at "/", each of `more` (app name, route prefix,
    config) beside it. Yields the base URL; always shut down on exit."""
    from ray import serve

    from specserve.cluster.builder import build_app, logical_cpus_needed
    from specserve.cluster.local import RAY_SYSTEM_CONFIG, init_local_ray, start_local, stop_local, wait_healthy

    init_local_ray(num_cpus=sum(logical_cpus_needed(config) for config in (first, *(app[2] for app in more))),
                   include_dashboard=False, _system_config=RAY_SYSTEM_CONFIG)
    try:
        url = start_local(first)
        for name, route_prefix, config in more:
            serve.run(build_app(config), name=name, route_prefix=route_prefix)
            wait_healthy(url + route_prefix, timeout_s=300.0)
        yield url
    finally:
        stop_local()


@contextmanager
def serving(speculative: SpecServeConfig, target_only: SpecServeConfig) -> Iterator[Endpoints]:
    """Ray + Serve with both applications; always shut down on exit."""
    with served_apps(speculative, [(TARGET_ONLY_APP, TARGET_ONLY_PREFIX, target_only)]) as url:
        yield Endpoints(url, url + TARGET_ONLY_PREFIX, speculative.model_name)


TOP_P = 0.95   # the top_p request class's (bench.inprocess.sampling_params too)


def request_body(model: str, prompt: str, mode: str, max_tokens: int, seed: int) -> dict:
    """The OpenAI completion request matching bench.inprocess.sampling_params."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    if mode == "greedy":
        return {**body, "temperature": 0.0}
    return {**body, "temperature": 0.8, "top_k": 0, "top_p": TOP_P if mode == "top_p" else 1.0, "seed": seed}


async def stream_request(client: httpx.AsyncClient, url: str, body: dict, prompt_id: str,
                         run: int) -> tuple[RequestRecord, float, float]:
    """One streamed completion -> (record, start, end) in time.perf_counter seconds."""
    final: dict = {}
    first_text_at = None
    pieces: list[str] = []
    started = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code} from {url}: {response.text}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"server error from {url}: {chunk['error']['message']}")
            text = chunk["choices"][0].get("text") if chunk.get("choices") else None
            if text:
                first_text_at = first_text_at or time.perf_counter()
                pieces.append(text)
            if "speculation" in chunk:
                final = chunk
    ended = time.perf_counter()
    if not final:
        raise RuntimeError(f"{url}: the stream ended without the final usage/speculation chunk")
    usage, spec = final["usage"], final["speculation"]
    overhead_ms, server_ttft_ms = spec.get("median_overhead_ms"), spec.get("time_to_first_token_ms")
    record = RequestRecord(
        prompt_id=prompt_id, run=run, num_prompt_tokens=usage["prompt_tokens"],
        num_output_tokens=usage["completion_tokens"], wall_s=ended - started,
        ttft_s=None if first_text_at is None else first_text_at - started,
        target_passes=spec["target_passes"], rounds=spec["rounds"], num_drafted=spec["num_drafted"],
        num_accepted=spec["num_accepted"], median_overhead_s=None if overhead_ms is None else overhead_ms / 1000,
        server_ttft_s=None if server_ttft_ms is None else server_ttft_ms / 1000,
        median_hops_s=_seconds(spec.get("median_hops_ms")), median_router_s=_seconds(spec.get("median_router_ms")),
        finish_reason=(final.get("choices") or [{}])[0].get("finish_reason"), output_text="".join(pieces),
        round_stages_ms=spec.get("round_stages_ms"), first_token_stages_ms=spec.get("first_token_stages_ms"),
        cache_hits=spec.get("pipelined_rounds", 0),
        cache_misses=spec.get("speculation_cache_misses", 0))
    return record, started, ended


def _seconds(milliseconds: float | None) -> float | None:
    return None if milliseconds is None else milliseconds / 1000


def run_sequential(jobs: list[tuple[str, str, dict, str, int]]) -> list[tuple[str, RequestRecord]]:
    """Single-stream requests one after another over one keep-alive connection.
    jobs: (row key, base url, body, prompt id, run) -> [(row key, record)] in job order."""
    async def go() -> list[tuple[str, RequestRecord]]:
        async with httpx.AsyncClient() as client:
            return [(key, (await stream_request(client, url, body, prompt_id, run))[0])
                    for key, url, body, prompt_id, run in jobs]

    return asyncio.run(go())


def sweep_request_count(concurrency: int, num_prompts: int, cap: int, per_stream: int = 2) -> int:
    """Requests at one concurrency level: at least per_stream per stream and one per prompt, at
    most cap (but never fewer than the streams, or the level would not reach its concurrency).
    More per stream shortens the ramp-down tail's share of the level, where fewer streams run."""
    return max(concurrency, min(cap, max(per_stream * concurrency, num_prompts)))


def run_level(url: str, bodies: list[tuple[str, dict]], concurrency: int) -> dict:
    """Send bodies with `concurrency` in flight; aggregate tokens/s and latency percentiles."""
    async def go() -> list[tuple[RequestRecord, float, float]]:
        semaphore = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(limits=limits) as client:
            async def bounded(prompt_id: str, body: dict):
                async with semaphore:
                    return await stream_request(client, url, body, prompt_id, run=0)

            return await asyncio.gather(*(bounded(pid, body) for pid, body in bodies))

    results = asyncio.run(go())
    records = [r for r, _, _ in results]
    span_s = max(end for _, _, end in results) - min(start for _, start, _ in results)
    latencies_ms = [1000 * r.wall_s for r in records]
    ttfts_ms = [1000 * r.ttft_s for r in records if r.ttft_s is not None]
    drafted = sum(r.num_drafted for r in records)
    rounds = sum(r.rounds for r in records)
    tokens = sum(r.num_output_tokens for r in records)
    hits, misses = sum(r.cache_hits for r in records), sum(r.cache_misses for r in records)
    return {
        "concurrency": concurrency, "num_requests": len(records), "num_output_tokens": tokens,
        "tokens_per_s": tokens / span_s if span_s > 0 else math.nan,
        "latency_p50_ms": percentile(latencies_ms, 50), "latency_p95_ms": percentile(latencies_ms, 95),
        "ttft_p50_ms": percentile(ttfts_ms, 50), "ttft_p95_ms": percentile(ttfts_ms, 95),
        "acceptance_rate": sum(r.num_accepted for r in records) / drafted if drafted else None,
        "mean_draft_tokens": drafted / rounds if rounds else 0.0,
        "tokens_per_pass": tokens / max(1, sum(r.target_passes for r in records)),
        "cache_hit_share": hits / (hits + misses) if hits + misses else None,
        "records": [r.to_dict() for r in records],
    }
