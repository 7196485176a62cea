"""Re-measure the transport facts the per-round path is designed on (docs/transport.md).

From inside a Serve replica (where the router lives), one round trip of:
- a DeploymentHandle method call to another deployment,
- a plain Ray actor method call to an actor the other deployment's replica owns (what the
  router does every round),
- the same actor call carrying a realistic round payload (a 300-token history in, K+1 = 5
  full-vocabulary float32 rows out: a sampled round's reply);
- a round's two hops, router -> draft -> router -> target -> router, as two chained actor calls to
  asyncio actors (the engines are asyncio actors that batch on their event loop), against the same
  two hops as a Ray Compiled Graph, router -> draft -> target -> router, whose bound methods hand
  the call to the actor's event loop and block for it (a graph's loop runs them on a thread of
  its own; docs/transport.md says why that shape).
Run: `python -m specserve.bench.transport [--calls 300]`; prints and writes bench/results/transport.json.
"""

from __future__ import annotations

import argparse
import asyncio
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


class LoopEngine:
    """Stands in for an engine actor: an asyncio actor whose calls run on its event loop."""

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()

    async def step(self, history: list[int], block: list[int] | None = None) -> list[int]:
        return (block or history)[-4:]

    def step_in_graph(self, history: list[int], block: list[int] | None = None) -> list[int]:
        """A compiled graph calls this on its own thread: hand the call to the loop, wait."""
        return asyncio.run_coroutine_threadsafe(self.step(history, block), self.loop).result()


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
        timings.update(await self.round_hops(calls, history))
        return timings

    async def round_hops(self, calls: int, history: list[int]) -> dict[str, list[float]]:
        """A round's two hops: chained actor calls, then one compiled graph execution."""
        from ray.dag import InputNode

        draft, target = (ray.remote(LoopEngine).options(num_cpus=0.1).remote() for _ in range(2))
        await asyncio.gather(draft.start.remote(), target.start.remote())
        chained, graph = [], []
        for _ in range(calls):
            started = time.perf_counter()
            block = await draft.step.remote(history)
            await target.step.remote(history, block)
            chained.append(time.perf_counter() - started)
        with InputNode() as history_in:
            dag = target.step_in_graph.bind(history_in, draft.step_in_graph.bind(history_in))
        compiled = dag.experimental_compile(enable_asyncio=True)
        try:
            for _ in range(calls):
                started = time.perf_counter()
                await (await compiled.execute_async(history))
                graph.append(time.perf_counter() - started)
        finally:
            compiled.teardown()
        return {"round_two_actor_calls_chained": chained, "round_compiled_graph": graph}


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
