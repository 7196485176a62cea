"""Re-measure the transport facts the per-round path is designed on (docs/transport.md).

From inside a Serve replica (where the router lives), one round trip of:
- a DeploymentHandle method call to another deployment,
- a plain Ray actor method call to an actor the other deployment's replica owns (what the
  router does every round),
- the same actor call carrying a realistic round payload (a 300-token history in, K+1 = 5
  full-vocabulary float32 rows out: a sampled round's reply).
Run: `python -m bench.transport [--calls 300]`; prints and writes bench/results/transport.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import ray
import torch
from ray import serve

VOCAB = 8192


class Echo:
    def ping(self, payload=None):
        return payload

    def rows(self, history: list[int]) -> torch.Tensor:
        return torch.ones(5, VOCAB)


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class EchoHost:
    def __init__(self) -> None:
        self.actor = ray.remote(Echo).options(num_cpus=0.1).remote()

    def ping(self, payload=None):
        return payload

    def get_actor(self):
        return self.actor


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Caller:
    def __init__(self, host) -> None:
        self.host = host

    async def measure(self, calls: int) -> dict[str, list[float]]:
        actor = await self.host.get_actor.remote()
        history = list(range(300))
        cases = {
            "deployment_handle_call": lambda: self.host.ping.remote(),
            "ray_actor_call": lambda: actor.ping.remote(),
            "ray_actor_call_round_payload": lambda: actor.rows.remote(history),
        }
        timings: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(calls):
            for name, call in cases.items():
                started = time.perf_counter()
                await call()
                timings[name].append(time.perf_counter() - started)
        return timings


def summarize(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples[len(samples) // 10:])  # drop the warm-up tenth
    return {"median_ms": round(1000 * statistics.median(ordered), 3),
            "p95_ms": round(1000 * ordered[int(0.95 * (len(ordered) - 1))], 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default="bench/results/transport.json")
    args = parser.parse_args(argv)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _system_config={"max_direct_call_object_size": 4 * 1024 * 1024})
    try:
        handle = serve.run(Caller.bind(EchoHost.bind()), name="transport", route_prefix=None)
        timings = handle.measure.remote(args.calls).result()
    finally:
        serve.shutdown()
        ray.shutdown()
    result = {name: summarize(samples) for name, samples in timings.items()}
    result["calls"] = args.calls
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
