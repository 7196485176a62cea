"""What an open Ray Compiled Graph costs while it carries nothing: CPU seconds of its two actors
and of the process that compiled it, over 10 idle seconds, before and after compiling.

Why: speculation.compiled_graph keeps a lone request's graph open between rounds (and between
requests). On Ray 2.60 its channel readers wait by polling, so an idle graph is not free; on a
2-core box that CPU comes out of the engines' forwards. Run: `python -m bench.graph_idle`; prints
and writes bench/results/graph-idle-cpu.json.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import psutil
import ray
from ray.dag import InputNode

IDLE_S = 10.0
OUT = Path(__file__).parent / "results" / "graph-idle-cpu.json"


@ray.remote(num_cpus=0.1)
class LoopActor:
    """An asyncio actor whose graph method hands the call to its event loop, as the engines do."""

    async def start(self) -> int:
        self.loop = asyncio.get_running_loop()
        return os.getpid()

    async def step(self, value: int) -> int:
        return value

    def step_in_graph(self, value: int) -> int:
        return asyncio.run_coroutine_threadsafe(self.step(value), self.loop).result()


async def idle_cpu_s(processes: list[psutil.Process]) -> list[float]:
    def cpu() -> list[float]:
        return [sum(p.cpu_times()[:2]) for p in processes]
    before = cpu()
    await asyncio.sleep(IDLE_S)
    return [round(after - start, 2) for after, start in zip(cpu(), before)]


async def measure() -> dict:
    first, second = LoopActor.remote(), LoopActor.remote()
    pids = await asyncio.gather(first.start.remote(), second.start.remote())
    processes = [psutil.Process(pid) for pid in pids] + [psutil.Process()]
    no_graph = await idle_cpu_s(processes)
    with InputNode() as value:
        dag = second.step_in_graph.bind(first.step_in_graph.bind(value))
    compiled = dag.experimental_compile(enable_asyncio=True)
    try:
        await (await compiled.execute_async(1))
        graph_open = await idle_cpu_s(processes)
    finally:
        compiled.teardown()
    names = ["first actor", "second actor", "compiling process"]
    return {"idle_s": IDLE_S, "cpu_s_no_graph": dict(zip(names, no_graph)),
            "cpu_s_graph_open": dict(zip(names, graph_open)), "ray": ray.__version__, "cpus": os.cpu_count()}


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        result = asyncio.run(measure())
    finally:
        ray.shutdown()
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
