"""`specserve bench-load-step`: a load step (1 -> N -> 1 streams) against autoscaled pools, traced.

Brings up the app with both pools autoscaled between 1 and `--max-replicas` (Serve's own
autoscaling, driven by the policy actor through `specserve.policies.autoscaling:PoolPolicy`, short Serve
delays), then runs closed-loop streaming clients: 1 stream for `--phase-s`, N streams for
`--phase-s`, 1 stream again for `--phase-s`, then idle. Every second it samples running replicas
per pool (Serve's view), the depth the policy allows a greedy request, active requests, and the
tokens clients received, and writes the trace (JSON + a plot) to --out
(bench-out/ unless told). Counts failed
requests: there must be none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

from specserve.bench import DEFAULT_OUT_DIR
from specserve.bench.http_rows import free_port, request_body
from specserve.common.config import SpecServeConfig, load_config
from specserve.cluster.status import POOL_DEPLOYMENTS
from specserve.common.naming import policy_actor_name
from specserve.training.prompts import load_prompt_set


def autoscaled_config(base: SpecServeConfig, max_replicas: int, port: int) -> SpecServeConfig:
    data = base.model_dump(mode="json")
    data["http"] = {"host": "127.0.0.1", "port": port}
    for pool in ("target_workers", "draft_workers"):
        data[pool] = {**data[pool], "min_replicas": 1, "max_replicas": max_replicas,
                      "upscale_delay_s": 1.0, "downscale_delay_s": 5.0}
    return SpecServeConfig.model_validate(data)


def sample(policy_actor: str) -> dict:
    """Running replicas per pool, the router's view of load and depth, and the load the policy
    actor's last decision was made from (`PolicyActor.load`: cost curves, acceptance, overhead)."""
    import ray

    from specserve.cluster.status import router_status, running_replicas
    from specserve.policies.actor import POLICY_NAMESPACE

    router = router_status(timeout_s=5) or {}
    policy = router.get("policy") or {}
    try:
        policy_load = ray.get(ray.get_actor(policy_actor, namespace=POLICY_NAMESPACE).load.remote(), timeout=5)
    except (ValueError, ray.exceptions.RayError):  # not created yet, or restarting: this second has none
        policy_load = None
    return {"replicas": running_replicas(), "num_draft_tokens": router.get("num_draft_tokens"),
            "policy_num_draft_tokens": (policy.get("num_draft_tokens") or {}).get("greedy"),
            "active_requests": router.get("active_requests"), "policy_reasons": policy.get("reasons", []),
            "policy_load": policy_load}


def step_bodies(model_name: str, prompt_set: str, max_tokens: int) -> list[dict]:
    """One greedy, non-streaming completion body per prompt of the set."""
    return [{**request_body(model_name, p.text, "greedy", max_tokens, seed=i), "stream": False}
            for i, p in enumerate(load_prompt_set(prompt_set).prompts)]


class Clients:
    """Closed-loop streaming clients whose count can change; counts tokens and failures."""

    def __init__(self, url: str, bodies: list[dict]) -> None:
        self.url, self.bodies = url, bodies
        self.wanted = 0
        self.tokens = 0
        self.requests = 0
        self.failures: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()

    async def _client(self, index: int, client: httpx.AsyncClient) -> None:
        turn = 0
        while not self._stop:
            if index >= self.wanted:
                await asyncio.sleep(0.1)
                continue
            body = self.bodies[(index + turn) % len(self.bodies)]
            turn += 1
            try:
                response = await client.post(f"{self.url}/v1/completions", json=body, timeout=300)
                if response.status_code != 200:
                    self.failures.append(f"HTTP {response.status_code}: {response.text[:200]}")
                    continue
                self.tokens += response.json()["usage"]["completion_tokens"]
                self.requests += 1
            except (httpx.HTTPError, ValueError, KeyError) as exc:  # a failure is counted, never silent
                self.failures.append(repr(exc))

    async def _main(self) -> None:
        async with httpx.AsyncClient() as client:
            await asyncio.gather(*(self._client(i, client) for i in range(64)))

    def stop(self) -> None:
        self._stop = True
        self._thread.join(timeout=330)


def plot(trace: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [point["t_s"] for point in trace]
    figure, (load, replicas, depth) = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    load.plot(t, [p["tokens_per_s"] for p in trace], label="tok/s (clients)")
    load.plot(t, [p["streams"] * 10 for p in trace], "--", label="streams x10")
    load.legend(fontsize=8)
    for pool in POOL_DEPLOYMENTS:
        replicas.step(t, [p["replicas"][pool] for p in trace], where="post", label=f"{pool} replicas")
    replicas.legend(fontsize=8)
    depth.step(t, [p["num_draft_tokens"] if p["num_draft_tokens"] is not None else float("nan") for p in trace],
               where="post", label="K for a greedy request")
    depth.legend(fontsize=8)
    depth.set_xlabel("seconds")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


@dataclass(frozen=True)
class Phase:
    """`streams` closed-loop clients for at least `min_s` seconds; the phase ends at `min_s`, or, if
    `until` is given, at the first sample after `min_s` for which until(sample) holds, or at
    `max_s`. Why conditions: how long Serve takes to start a replica depends on the machine, so a
    test waits for what it checks (a pool that grew, pools back at their minimum) with a bound,
    rather than guessing a duration that a slower machine misses."""

    streams: int
    min_s: float
    max_s: float | None = None
    until: Callable[[dict], bool] | None = None

    def over(self, elapsed_s: float, point: dict) -> bool:
        if elapsed_s < self.min_s:
            return False
        if self.until is None or elapsed_s >= (self.max_s or self.min_s):
            return True
        return self.until(point)


@dataclass
class LoadStep:
    """What a load step produced: one trace point a second, and the clients' own counts."""

    trace: list[dict]
    requests: int
    failures: list[str]

    def phase(self, streams: int) -> list[dict]:
        return [point for point in self.trace if point["streams"] == streams]


def run_load_step(url: str, bodies: list[dict], phases: list[Phase], policy_actor: str,
                  echo: bool = False) -> LoadStep:
    """Drive the app at url through the phases, sampling every second: running replicas per pool,
    the policy's depth for a greedy request (and why, and the load policy_actor decided it from),
    active requests, and the tokens clients received meanwhile."""
    clients = Clients(url, bodies)
    trace: list[dict] = []
    started = time.monotonic()
    last_tokens, last_t = 0, started
    try:
        for phase in phases:
            clients.wanted = phase.streams
            phase_start = time.monotonic()
            while True:
                time.sleep(1.0)
                now = time.monotonic()
                point = {"t_s": round(now - started, 1), "streams": phase.streams, **sample(policy_actor),
                         "tokens_per_s": (clients.tokens - last_tokens) / (now - last_t)}
                last_tokens, last_t = clients.tokens, now
                trace.append(point)
                if echo:
                    print(json.dumps(point), file=sys.stderr, flush=True)
                if phase.over(now - phase_start, point):
                    break
    finally:
        clients.stop()
    return LoadStep(trace, clients.requests, clients.failures)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specserve bench-load-step", description=__doc__.splitlines()[0])
    parser.add_argument("--config")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--phase-s", type=float, default=40.0)
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", default="thirdparty")
    parser.add_argument("--out", default=DEFAULT_OUT_DIR, help="results folder (publish to bench/results/)")
    parser.add_argument("--name", default="load-step")
    args = parser.parse_args(argv)

    from specserve.cluster.local import start_local, stop_local

    config = autoscaled_config(load_config(args.config), args.max_replicas, free_port())
    bodies = step_bodies(config.model_name, args.prompts, args.max_tokens)
    url = start_local(config)
    try:
        phases = [Phase(1, args.phase_s), Phase(args.streams, args.phase_s), Phase(1, args.phase_s),
                  Phase(0, args.idle_s)]
        step = run_load_step(url, bodies, phases, policy_actor_name(config.model_name), echo=True)
    finally:
        stop_local()
    trace = step.trace
    result = {"name": args.name, "command": "specserve bench-load-step " + " ".join(argv or sys.argv[1:]),
              "streams": args.streams, "phase_s": args.phase_s, "max_replicas": args.max_replicas,
              "requests": step.requests, "failures": step.failures, "trace": trace,
              "max_replicas_seen": {pool: max(p["replicas"][pool] for p in trace) for pool in POOL_DEPLOYMENTS},
              "depths_seen": sorted({p["num_draft_tokens"] for p in trace if p["num_draft_tokens"] is not None})}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(trace, out / f"{args.name}.png", f"load step 1 -> {args.streams} -> 1 streams, pools autoscaled 1..{args.max_replicas}")
    print(json.dumps({k: v for k, v in result.items() if k != "trace"}, indent=1))


if __name__ == "__main__":
    main()
