"""What starting the served default pair costs, before and after a change, in one run: each
process's imports (the ingress, the router, the CLI, an engine) in a fresh interpreter, and the
whole start (`specserve serve`'s local bring-up: Ray, Serve, the four deployments) until /health
answers, then one request's answer.

    python -m specserve.bench.figures.startup --baseline-tree /tmp/specserve-before [--rounds 3]

Why the imports apart: Serve starts the deployments' replicas at once, so on a small machine their
imports share the cores with the engines' model loads; a replica Serve starts later (a failover's,
an autoscaled one's) pays its own again. Each measurement runs in its own process with PYTHONPATH
set to the tree under test, the trees taking turns every round (this box drifts); medians over
rounds. Writes bench/results/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROCESS_MODULES = {"ingress": "specserve.deployments.ingress", "router": "specserve.deployments.router",
                   "cli": "specserve.cluster.cli", "target engine": "specserve.deployments.target_worker"}
PROMPT = "def read_config(path):"


def import_worker(module: str) -> dict:
    """Seconds this fresh interpreter takes to import module (its own start-up not counted)."""
    import importlib

    started = time.perf_counter()
    importlib.import_module(module)
    return {"seconds": time.perf_counter() - started}


def serve_worker() -> dict:
    """Seconds from nothing running to the default pair's /health answering, then to one greedy
    completion's answer, in this process's tree (the local bring-up `specserve serve` runs)."""
    started = time.perf_counter()
    import httpx

    from specserve.cluster.local import start_local, stop_local
    from specserve.common.config import SpecServeConfig

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = SpecServeConfig.model_validate({"http": {"port": port},
                                             "observability": {"metrics_export_port": 0}})
    url = start_local(config)
    healthy = time.perf_counter()
    try:
        response = httpx.post(f"{url}/v1/completions", timeout=120,
                              json={"model": config.model_name, "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        response.raise_for_status()
        answered = time.perf_counter()
    finally:
        stop_local()
    return {"healthy_s": healthy - started, "first_answer_s": answered - healthy}


def measure(tree: Path, worker: str) -> dict:
    # Imported here, not above: a worker runs this file under a tree that may predate the module.
    from specserve.bench.tree_turns import script_in_tree

    return json.loads(script_in_tree(Path(__file__).resolve(), tree, ["--worker", worker]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.figures.startup", description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", help="a checkout of the code before the change (git worktree)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="cpu-2core-startup")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = serve_worker() if args.worker == "serve" else import_worker(args.worker)
        print(json.dumps(result))
        return
    from specserve.bench.report import markdown_table
    from specserve.bench.tree_turns import turn_order

    trees = {"after": ROOT} | ({"before": Path(args.baseline_tree).resolve()} if args.baseline_tree else {})
    samples: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):
        for tree_name in turn_order(list(trees), round_index):
            for process, module in PROCESS_MODULES.items():
                seconds = measure(trees[tree_name], module)["seconds"]
                samples.setdefault((f"import: {process}", tree_name), []).append(seconds)
            served = measure(trees[tree_name], "serve")
            for key, seconds in served.items():
                samples.setdefault((key, tree_name), []).append(seconds)
            print(round_index, tree_name, served, flush=True)
    measures = list(dict.fromkeys(key for key, _ in samples))
    rows = [{"measure": key, "tree": tree_name, "median_s": round(statistics.median(samples[(key, tree_name)]), 2),
             "per_round_s": [round(value, 2) for value in samples[(key, tree_name)]]}
            for key in measures for tree_name in trees]
    command = "python -m specserve.bench.figures.startup " + " ".join(argv if argv is not None else sys.argv[1:])
    out = ROOT / "bench/results" / args.name
    out.with_suffix(".json").write_text(json.dumps({"command": command, "rounds": args.rounds, "rows": rows}, indent=2))
    table = markdown_table(["measure", "code", "seconds, median (per round)"],
                           [[r["measure"], r["tree"], f"{r['median_s']} ({', '.join(str(v) for v in r['per_round_s'])})"]
                            for r in rows])
    lines = [f"# Starting the served default pair ({args.rounds} rounds, the trees taking turns, medians)", "",
             f"`{command}`", "", table]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
