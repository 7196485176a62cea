"""Serve's Python proxy against its high-throughput data plane (HAProxy ingress, replicas over
gRPC: cluster/serve_data_plane.py), measured with `specserve bench-load`.

The data plane is chosen per cluster, by environment variables its processes read at start, so the
two cannot share a cluster as bench-load's variants do: each run of bench-load starts its own, and
the two data planes take turns run by run (proxy, haproxy, proxy, haproxy, ...) on a shared box.

    python -m specserve.bench.figures.serve_data_plane --turns 2 --out bench/results --name NAME \\
        -- --variants k4 --null-forward 0.8 --concurrency 1,16,64,256 --max-tokens 128

Everything after `--` goes to each bench-load run. Writes NAME.md (per level: each turn's tok/s and
latencies, medians, haproxy / proxy) and NAME.json (the same, without bench-load's per-request records).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from specserve.bench import DEFAULT_OUT_DIR
from specserve.bench.report import markdown_table
from specserve.cluster.serve_data_plane import HIGH_THROUGHPUT_ENV

# What each data plane's runs set: the proxy by turning both switches off (a user's own setting,
# which specserve leaves alone); haproxy by leaving them to specserve's default.
DATA_PLANES = {"proxy": {name: "0" for name in HIGH_THROUGHPUT_ENV}, "haproxy": {}}
LEVEL_FIELDS = ("tokens_per_s", "latency_p50_ms", "ttft_p50_ms")


def run_bench_load(plane: str, turn: int, bench_args: list[str], folder: Path) -> dict:
    """One bench-load run on a cluster of its own with `plane`'s environment; its results JSON."""
    env = {name: value for name, value in os.environ.items() if name not in HIGH_THROUGHPUT_ENV}
    name = f"{plane}-{turn}"
    subprocess.run([sys.executable, "-m", "specserve.bench.load_sweep", *bench_args, "--out", str(folder),
                    "--name", name], env={**env, **DATA_PLANES[plane]}, check=True)
    return json.loads((folder / f"{name}.json").read_text())


def levels(result: dict) -> dict[tuple[str, int], dict[str, float]]:
    """(variant, streams) -> the level's LEVEL_FIELDS."""
    return {(variant, level["concurrency"]): {field: level[field] for field in LEVEL_FIELDS}
            for variant, rows in result["variants"].items() for level in rows}


def summary(runs: dict[str, list[dict]]) -> dict:
    """Per (variant, streams): each plane's turns and their medians, and haproxy / proxy of tok/s."""
    per_plane = {plane: [levels(result) for result in results] for plane, results in runs.items()}
    rows = []
    for key in per_plane["proxy"][0]:
        row: dict = {"variant": key[0], "streams": key[1]}
        for plane, turns in per_plane.items():
            row[plane] = {field: [turn[key][field] for turn in turns] for field in LEVEL_FIELDS}
            row[plane]["median"] = {field: statistics.median(row[plane][field]) for field in LEVEL_FIELDS}
        row["tokens_per_s_ratio"] = row["haproxy"]["median"]["tokens_per_s"] / row["proxy"]["median"]["tokens_per_s"]
        rows.append(row)
    return {"rows": rows}


def markdown(name: str, command: str, bench_args: list[str], result: dict, first: dict) -> str:
    lines = [f"# {name}: Serve's Python proxy against HAProxy + throughput-optimized Serve", "",
             f"- command: `{command}`",
             f"- each run: `specserve bench-load {' '.join(bench_args)}`, on a cluster of its own; the data planes "
             "took turns run by run", f"- machine: {first['machine']}",
             f"- prompts: {first['prompts']}; max_tokens {first['max_tokens']}; mode {first['mode']}"
             + (f"; null forwards, draft agreement {first['null_forward']}" if first.get("null_forward") else ""),
             ""]
    header = ["variant", "streams", "proxy tok/s (turns)", "haproxy tok/s (turns)", "proxy tok/s median",
              "haproxy tok/s median", "haproxy / proxy", "p50 latency ms proxy / haproxy", "p50 TTFT ms proxy / haproxy"]
    cells = []
    for row in result["rows"]:
        proxy, haproxy = row["proxy"], row["haproxy"]
        cells.append([row["variant"], str(row["streams"]), ", ".join(f"{v:.1f}" for v in proxy["tokens_per_s"]),
                      ", ".join(f"{v:.1f}" for v in haproxy["tokens_per_s"]), f"{proxy['median']['tokens_per_s']:.1f}",
                      f"{haproxy['median']['tokens_per_s']:.1f}", f"{row['tokens_per_s_ratio']:.2f}×",
                      f"{proxy['median']['latency_p50_ms']:.0f} / {haproxy['median']['latency_p50_ms']:.0f}",
                      f"{proxy['median']['ttft_p50_ms']:.0f} / {haproxy['median']['ttft_p50_ms']:.0f}"])
    lines.append(markdown_table(header, cells))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--name", default="serve-data-plane")
    args = parser.parse_args(ours)
    runs: dict[str, list[dict]] = {plane: [] for plane in DATA_PLANES}
    with tempfile.TemporaryDirectory() as folder:
        for turn in range(1, args.turns + 1):
            for plane in DATA_PLANES:
                runs[plane].append(run_bench_load(plane, turn, bench_args, Path(folder)))
    result = {"name": args.name, "bench_load_args": bench_args, **summary(runs)}
    command = "python -m specserve.bench.figures.serve_data_plane " + " ".join(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"command": command, **result}, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(args.name, command, bench_args, result, runs["proxy"][0]))
    print((args.out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
