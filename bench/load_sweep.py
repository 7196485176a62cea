"""`specserve bench-load`: aggregate throughput and latency under load, several server variants in one run.

Each variant is a full Serve application (ingress -> router -> draft/target engine actors) brought
up alone on this machine, warmed, then driven at 1, 2, 4, ... concurrent streaming clients over
loopback HTTP; the variants run one after another with the same prompts and bodies, so their rows
compare like with like. Besides client-side tok/s, p50/p95 latency and TTFT, each level reads the
engines' own counters (engine `stats()`): mean batch size per pool = rows / forwards over the
level, and the target pool's busy share.

Variants (`--variants`):
- `specserve`: speculative decoding, batched engines (the shipped configuration, K pinned or adaptive)
- `target-only`: proposer "none", batched target engine
- `specserve-unbatched` / `target-only-unbatched`: the same with `batching.max_batch_rows: 1`,
  i.e. one sequence per forward, as the engines were before continuous batching
- `k0`, `k2`, `k4`, `k8`: speculation pinned at that K (k0 = target-only through the same stack)
- `adaptive`: the configured adaptive depth policy
- any variant with `-token`: the same with speculation.verification "token" (block is the default;
  docs/block-verification.md), e.g. `adaptive,adaptive-token --mode sampled`
- any variant with `-plain`: the same with speculation.fan_out 0, plain rounds without the
  speculation cache (docs/speculation-cache.md), e.g. `adaptive,adaptive-plain`
- any variant with `-unmeasured`: the same with speculation.fan_out_measured false, the fan-out
  kept whether or not rounds measure faster with it, e.g. `adaptive,adaptive-unmeasured,adaptive-plain`
- any variant with `-2routers`: the same with two router replicas, e.g. `k4,k4-2routers`
- any variant with `-intervalN`: the same with `http.stream_interval_ms` N (a stream's rounds merged
  into one chunk per N ms), e.g. `k4,k4-interval50`
- any variant with `-stepsN`: the same with `speculation.target_only_steps` N (tokens a round
  without a block decodes in the target), e.g. `target-only-steps1,target-only`
- any variant with `-topkN`: the same with `speculation.draft_top_k` N (the draft tokens a sampled
  draft row keeps), e.g. `k4-topk64,k4 --mode sampled`

`--null-forward A` serves every variant's engines with null forwards (decoding/null_forward.py):
no model is computed, the target follows a hashed rule and the draft agrees with it at rate A, so
what is measured is the stack itself (ingress, routers, channels, engine loops, scheduler, block
manager): its capacity, the ceiling any model's throughput lives under.

`--compare LABEL=TREE` (twice or more) runs the whole sweep once per tree and turn, the trees
taking turns (`--turns`, bench/tree_turns.py), and writes one table: per variant and level, each
tree's tok/s per turn and medians, e.g. a change's effect on the stack's capacity:

    git worktree add /tmp/specserve-before <commit>
    specserve bench-load --variants k4 --null-forward 0.8 --concurrency 1,64 --turns 2 \
        --compare before=/tmp/specserve-before --compare after=. --name <name> --out bench/results

`--interleave N` runs the variants side by side instead: every variant is its own Serve
application (own route, own model name, own engines and policy actor) in ONE cluster, and each
level is run N times per variant, taking turns (the order rotated and reversed between turns).
Why: on a shared 2-core VM a variant's tok/s drifts by more than the differences being measured
(K = 8 at one stream read 159.1 to 196.7 tok/s across four sequential runs), and variants run
one after another meet different minutes of that drift; taking turns level by level gives every
variant the same minutes. The price: the idle apps' background work (health checks, load
reports) runs beside the measured one, the same for every variant. The engines' busy share is
not reported then (idle apps' engines would dilute it); mean batch sizes are.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from specserve.bench import DEFAULT_OUT_DIR
from specserve.bench.http_rows import free_port, request_body, run_level, served_apps, sweep_request_count
from specserve.bench.perfmodel import median_or_none
from specserve.bench.tree_turns import label_configs, parse_trees, runs_per_tree, served_code
from specserve.common.config import SpecServeConfig, load_config
from specserve.training.prompts import DEFAULT_PROMPT_SET, PROMPT_SETS, load_prompt_set, select_prompts

VARIANTS = ["specserve", "target-only", "specserve-unbatched", "target-only-unbatched",
            "k0", "k2", "k4", "k8", "adaptive"]


# A variant's modifiers: plain ones, stripped outermost first ("k4-token-2routers"), and numbered
# ones anywhere after the base ("k4-token-topk256-steps8-interval50").
SUFFIXES = ("-2routers", "-plain", "-unmeasured", "-token")
NUMBERED = re.compile(r"-(interval|steps|topk)(\d+(?:\.\d+)?)")


def split_variant(variant: str) -> tuple[str, dict[str, float], frozenset[str]]:
    """variant -> (its base in VARIANTS, its numbered modifiers {"interval" | "steps" | "topk": N},
    the SUFFIXES it carries)."""
    numbers = {name: float(value) for name, value in NUMBERED.findall(variant)}
    variant = NUMBERED.sub("", variant)
    suffixes = set()
    for suffix in SUFFIXES:
        if variant.endswith(suffix):
            suffixes.add(suffix)
            variant = variant.removesuffix(suffix)
    return variant, numbers, frozenset(suffixes)


def variant_config(base: SpecServeConfig, variant: str, num_draft_tokens: int, port: int,
                   null_forward: float | None = None) -> SpecServeConfig:
    """The config of one variant: same models and limits, speculation and batching as named; a
    "-token" one with token-wise verification, a "-2routers" one with two router replicas, a
    "-stepsN" one decoding N tokens a target-only round, a "-topkN" one drafting sampled tokens
    from N candidates, an "-intervalN" one streaming a chunk per N ms.
    null_forward: the engines' forwards are null, the draft agreeing with the target at this rate."""
    data = base.model_dump(mode="json")
    data["http"] = {"host": "127.0.0.1", "port": port}
    if null_forward is not None:
        data["target"]["null_forward_agreement"] = 1.0
        if data.get("draft") is not None:
            data["draft"]["null_forward_agreement"] = null_forward
    spec = data["speculation"]
    variant, numbers, suffixes = split_variant(variant)
    if "interval" in numbers:
        data["http"]["stream_interval_ms"] = numbers["interval"]
    if "steps" in numbers:
        spec["target_only_steps"] = int(numbers["steps"])
    if "topk" in numbers:
        spec["draft_top_k"] = int(numbers["topk"])
    if "-2routers" in suffixes:
        data["router"] = {**data["router"], "num_replicas": 2}
    if "-plain" in suffixes:
        spec["fan_out"] = 0
    if "-unmeasured" in suffixes:
        spec["fan_out_measured"] = False
    if "-token" in suffixes:
        spec["verification"] = "token"
    pinned = {"proposer": "draft", "adaptive": False}
    if variant.startswith("target-only"):
        spec.update(proposer="none")
    elif variant == "adaptive":
        spec.update(proposer="draft", adaptive=True)
    else:
        k = int(variant[1:]) if variant in ("k0", "k2", "k4", "k8") else num_draft_tokens
        spec.update(pinned, num_draft_tokens=k, min_draft_tokens=min(spec["min_draft_tokens"], k),
                    max_draft_tokens=max(spec["max_draft_tokens"], k))
        if k == 0:
            spec.update(proposer="none")
    if variant.endswith("-unbatched"):
        data["batching"] = {**data.get("batching", {}), "max_batch_rows": 1}
    return SpecServeConfig.model_validate(data)


def engine_counters() -> dict[str, dict[str, float]]:
    """Summed engine counters per pool, read from the named engine actors."""
    from specserve.common.messages import EngineStats
    from specserve.cluster.status import read_engine_stats

    totals: dict[str, dict[str, float]] = {}
    for stats in read_engine_stats():
        if not isinstance(stats, EngineStats):  # unreachable
            continue
        pool = totals.setdefault(stats.pool, {"forwards": 0, "rows": 0, "busy_s": 0.0, "idle_s": 0.0})
        pool["forwards"] += stats.forwards
        pool["rows"] += stats.batch_rows_total
        pool["busy_s"] += stats.busy_s
        pool["idle_s"] += stats.idle_s
    return totals


def engine_load(before: dict, after: dict) -> dict[str, dict[str, float | None]]:
    """Per pool over one level: mean batch size (rows per forward) and busy share."""
    load = {}
    for pool, end in after.items():
        start = before.get(pool, {"forwards": 0, "rows": 0, "busy_s": 0.0, "idle_s": 0.0})
        forwards, rows = end["forwards"] - start["forwards"], end["rows"] - start["rows"]
        busy, idle = end["busy_s"] - start["busy_s"], end["idle_s"] - start["idle_s"]
        load[pool] = {"mean_batch_size": rows / forwards if forwards else None,
                      "busy_share": busy / (busy + idle) if busy + idle > 0 else None}
    return load


def start_on_a_free_port(config: SpecServeConfig, attempts: int = 3) -> tuple[str, SpecServeConfig]:
    """start_local, on another free port if the chosen one was taken between choosing and binding
    (a lost race that once cost a whole sweep run)."""
    from specserve.cluster.local import start_local

    for attempt in range(attempts):
        try:
            return start_local(config), config
        except Exception as exc:
            if "Failed to bind" not in str(exc) or attempt == attempts - 1:
                raise
            config = config.model_copy(update={"http": config.http.model_copy(update={"port": free_port()})})
    raise AssertionError("unreachable")


def measured_level(url: str, bodies: list[tuple[str, dict]], level: int) -> dict:
    """run_level, plus the engines' batch sizes and busy share over it and the median of the
    requests' per-round overheads."""
    before = engine_counters()
    result = run_level(url, bodies, level)
    result["engines"] = engine_load(before, engine_counters())
    overheads = [r["median_overhead_s"] for r in result["records"] if r.get("median_overhead_s") is not None]
    result["overhead_ms"] = 1e3 * statistics.median(overheads) if overheads else None
    return result


def run_interleaved(configs: dict[str, SpecServeConfig], bodies_for, levels: list[int], turns: int, log,
                    progress) -> dict[str, list[dict]]:
    """Every variant as its own Serve app in one cluster, each level run `turns` times per variant
    in alternating order; a level's figures are the mean over its turns (module docstring)."""
    names = list(configs)
    beside = [(f"bench-{name}", f"/{name}", configs[name]) for name in names[1:]]
    with served_apps(configs[names[0]], beside) as base_url:
        urls = {names[0]: base_url, **{name: f"{base_url}/{name}" for name in names[1:]}}
        for name in names:  # warm-up: both engines, the tokenizer, the HTTP path
            run_level(urls[name], bodies_for(2, configs[name].model_name)[:2], 2)
        results: dict[str, list[dict]] = {name: [] for name in names}
        for level in levels:
            turns_of: dict[str, list[dict]] = {name: [] for name in names}
            for turn in range(turns):
                order = names[turn % len(names):] + names[:turn % len(names)]
                for name in (reversed(order) if turn % 2 else order):
                    run = measured_level(urls[name], bodies_for(level, configs[name].model_name), level)
                    run["engines"] = {pool: {**load, "busy_share": None} for pool, load in run["engines"].items()}
                    turns_of[name].append(run)
            for name in names:
                merged = mean_level(turns_of[name])
                merged["engines"] = turns_of[name][-1]["engines"]
                merged["turns_tokens_per_s"] = [run["tokens_per_s"] for run in turns_of[name]]
                results[name].append(merged)
                log(f"  {level:>2} streams, {name}: {merged['tokens_per_s']:.1f} tok/s "
                    f"(turns: {', '.join(f'{t:.1f}' for t in merged['turns_tokens_per_s'])})")
                progress.update()
        return results


def run_variant(config: SpecServeConfig, bodies_for, levels: list[int], log, progress) -> list[dict]:
    from specserve.cluster.local import stop_local

    url, config = start_on_a_free_port(config)
    try:
        run_level(url, bodies_for(2)[:2], 2)  # warm-up: both engines, the tokenizer, the HTTP path
        results = []
        for level in levels:
            result = measured_level(url, bodies_for(level), level)
            log(f"  {level:>2} streams: {result['tokens_per_s']:.1f} tok/s, p50 {result['latency_p50_ms']:.0f} ms, "
                f"batch {json.dumps({p: l['mean_batch_size'] for p, l in result['engines'].items()})}")
            results.append(result)
            progress.update()
        return results
    finally:
        stop_local()


def adaptive_against_fixed(result: dict) -> list[dict] | None:
    """Per level: adaptive tok/s, the best pinned K and its tok/s, their ratio; None without both.
    The last row holds the geometric means over the levels every variant ran."""
    variants = result["variants"]
    fixed = {name: levels for name, levels in variants.items() if name in ("k0", "k2", "k4", "k8")}
    if "adaptive" not in variants or not fixed:
        return None

    def by_level(levels: list[dict]) -> dict[int, float]:
        return {level["concurrency"]: level["tokens_per_s"] for level in levels}

    adaptive, pinned = by_level(variants["adaptive"]), {name: by_level(levels) for name, levels in fixed.items()}
    common = sorted(set(adaptive).intersection(*(set(levels) for levels in pinned.values())))
    rows = []
    for streams in common:
        best = max(pinned, key=lambda name: pinned[name][streams])
        rows.append({"streams": streams, "adaptive": adaptive[streams], "best_fixed": best,
                     "best_fixed_tokens_per_s": pinned[best][streams],
                     "ratio": adaptive[streams] / pinned[best][streams]})

    def geomean(values: list[float]) -> float:
        return math.exp(sum(math.log(v) for v in values) / len(values))

    means = {name: geomean([levels[s] for s in common]) for name, levels in {"adaptive": adaptive, **pinned}.items()}
    best_mean = max(pinned, key=means.get)
    rows.append({"streams": "geometric mean", "adaptive": means["adaptive"], "best_fixed": best_mean,
                 "best_fixed_tokens_per_s": means[best_mean], "ratio": means["adaptive"] / means[best_mean]})
    return rows


def combine_runs(runs: list[dict], name: str) -> dict:
    """One result whose tok/s per variant and level is the mean over runs of the same sweep. Why:
    on this shared box a level's tok/s drifts over a run, so variants that ran late read slower;
    the same sweep run again in reverse variant order and averaged cancels that order effect."""
    first = runs[0]
    combined = {key: first[key] for key in ("prompts", "max_tokens", "mode", "machine")}
    combined.update(name=name, command="mean of: " + "; ".join(f"`{run['command']}`" for run in runs),
                    runs=[run["name"] for run in runs], variants={})
    for variant, levels in first["variants"].items():
        combined["variants"][variant] = [
            mean_level([other for run in runs for other in run["variants"].get(variant, [])
                        if other["concurrency"] == level["concurrency"]])
            for level in levels]
    return combined


def mean_level(same: list[dict]) -> dict:
    """One level's row from several measurements of it: figures averaged, requests summed, the
    rest (engines, concurrency) from the first; per-request records dropped."""
    row = {key: value for key, value in same[0].items() if key != "records"}
    for key in ("tokens_per_s", "latency_p50_ms", "latency_p95_ms", "ttft_p50_ms", "ttft_p95_ms",
                "acceptance_rate", "mean_draft_tokens", "overhead_ms", "tokens_per_pass", "cache_hit_share"):
        values = [other[key] for other in same if other.get(key) is not None]
        row[key] = sum(values) / len(values) if values else None
    row["num_requests"] = sum(other["num_requests"] for other in same)
    return row


def compare_trees(args, argv: list[str]) -> None:
    """The sweep under each tree, the trees taking turns; one table of every tree's levels."""
    trees = parse_trees(args.compare)
    child = ["--variants", args.variants, "--concurrency", args.concurrency, "--requests-per-level",
             str(args.requests_per_level), "--requests-per-stream", str(args.requests_per_stream), "--max-tokens",
             str(args.max_tokens), "--mode", args.mode, "-K", str(args.num_draft_tokens), "--prompts", args.prompts,
             "--interleave", str(args.interleave)]
    for flag, value in (("--num-prompts", args.num_prompts), ("--null-forward", args.null_forward)):
        if value is not None:
            child += [flag, str(value)]
    label_args = label_configs(args.compare_config, trees, args.config)
    runs = runs_per_tree("specserve.bench.load_sweep", child, trees, args.turns, label_args)
    first = next(iter(runs.values()))[0]
    command = "specserve bench-load " + " ".join(argv)
    keys = ("tokens_per_s", "ttft_p50_ms", "latency_p50_ms", "overhead_ms")
    summary: dict[str, dict] = {}
    lines = [f"# specserve load sweep, trees compared: {args.name}", "", f"- command: `{command}`",
             f"- trees: {', '.join(f'{label} = {tree}' for label, tree in trees)}; {args.turns} turns, the trees "
             f"taking turns; per turn the whole sweep",
             *([f"- configs: {', '.join(f'{label} = {arguments[-1]}' for label, arguments in label_args.items())}"]
               if label_args else []),
             f"- prompts: {first['prompts']}; max_tokens "
             f"{first['max_tokens']}; mode {first['mode']}; machine: {first['machine']}"]
    if first.get("null_forward") is not None:
        lines.append(f"- engines: null forwards (no model computed), the draft agreeing with the target at "
                     f"{first['null_forward']}: the stack's own capacity")
    lines += ["", "| variant | streams | tree | tok/s, median (per turn) | × first tree | p50 TTFT ms | "
              "p50 latency ms | overhead ms/round |", "|---|---|---|---|---|---|---|---|"]
    for variant, levels in first["variants"].items():
        for index, level in enumerate(levels):
            base = None
            for label, _ in trees:
                same = [run["variants"][variant][index] for run in runs[label]]
                medians = {key: median_or_none([row.get(key) for row in same]) for key in keys}
                summary[f"{variant}/{level['concurrency']}/{label}"] = {
                    **medians, "tokens_per_s_per_turn": [round(row["tokens_per_s"], 1) for row in same]}
                base = base or medians["tokens_per_s"]
                per_turn = ", ".join(f"{row['tokens_per_s']:.1f}" for row in same)
                lines.append(f"| {variant} | {level['concurrency']} | {label} | {medians['tokens_per_s']:.1f} "
                             f"({per_turn}) | "
                             f"{medians['tokens_per_s'] / base:.2f}× | {_fmt(medians['ttft_p50_ms'], 0)} | "
                             f"{_fmt(medians['latency_p50_ms'], 0)} | {_fmt(medians['overhead_ms'], 2)} |")
    result = {"name": args.name, "command": command, "trees": {label: str(tree) for label, tree in trees},
              "configs": {label: arguments[-1] for label, arguments in label_args.items()},
              "turns": args.turns, "summary": summary}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def render_markdown(result: dict) -> str:
    lines = [f"# specserve load sweep: {result['name']}", "",
             f"- prompts: {result['prompts']}; max_tokens {result['max_tokens']}; mode {result['mode']}",
             f"- command: `{result['command']}`",
             f"- machine: {result['machine']}"]
    if result.get("null_forward") is not None:
        lines.append(f"- engines: null forwards (no model computed), the draft agreeing with the target at "
                     f"{result['null_forward']}: the stack's own capacity")
    lines += ["",
              "| variant | streams | requests | tok/s | × 1 stream | p50 latency ms | p95 latency ms | p50 TTFT ms "
              "| p95 TTFT ms | accept | mean K | tokens/pass | cache hits | overhead ms/round | target batch "
              "| draft batch | target busy |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    for variant, levels in result["variants"].items():
        single = levels[0]["tokens_per_s"] if levels else None
        for level in levels:
            engines = level.get("engines", {})
            lines.append(" | ".join([
                f"| {variant}", str(level["concurrency"]), str(level["num_requests"]), _fmt(level["tokens_per_s"]),
                _fmt(level["tokens_per_s"] / single if single else None, 2) + "×", _fmt(level["latency_p50_ms"], 0),
                _fmt(level["latency_p95_ms"], 0), _fmt(level["ttft_p50_ms"], 0), _fmt(level["ttft_p95_ms"], 0),
                _fmt(level["acceptance_rate"], 3), _fmt(level.get("mean_draft_tokens"), 2),
                _fmt(level.get("tokens_per_pass"), 2), _fmt(level.get("cache_hit_share"), 2),
                _fmt(level.get("overhead_ms"), 2), _fmt(engines.get("target", {}).get("mean_batch_size"), 2),
                _fmt(engines.get("draft", {}).get("mean_batch_size"), 2),
                _fmt(engines.get("target", {}).get("busy_share"), 2)]) + " |")
    comparison = adaptive_against_fixed(result)
    if comparison:
        lines += ["", "Adaptive against the best pinned K at each level (tok/s):", "",
                  "| streams | adaptive | best pinned K | its tok/s | adaptive / best |", "|---|---|---|---|---|"]
        lines += [f"| {row['streams']} | {row['adaptive']:.1f} | {row['best_fixed']} | "
                  f"{row['best_fixed_tokens_per_s']:.1f} | {row['ratio']:.2f}× |" for row in comparison]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4))
    for variant, levels in result["variants"].items():
        streams = [level["concurrency"] for level in levels]
        throughput.plot(streams, [level["tokens_per_s"] for level in levels], marker="o", label=variant)
        latency.plot(streams, [level["latency_p50_ms"] for level in levels], marker="o", label=variant)
    for axis, title in ((throughput, "aggregate tok/s"), (latency, "p50 request latency (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    throughput.legend(fontsize=8)
    figure.suptitle(f"{result['name']} ({result['prompts']}, {result['mode']}, {result['max_tokens']} tokens)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specserve bench-load", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="specserve YAML (default: the shipped pair)")
    parser.add_argument("--variants", default="specserve,target-only,specserve-unbatched")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--requests-per-level", type=int, default=32, help="cap on requests per level")
    parser.add_argument("--requests-per-stream", type=int, default=2,
                        help="at least this many requests per stream at each level (under the cap)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--mode", default="greedy", choices=["greedy", "sampled"])
    parser.add_argument("--num-draft-tokens", "-K", type=int, default=4)
    parser.add_argument("--prompts", default="thirdparty",
                        help=f"prompt set: {' | '.join(PROMPT_SETS)} or a JSON path (default: thirdparty, code "
                             f"unlike the pair's training corpus; {DEFAULT_PROMPT_SET} is in-distribution)")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--out", default=DEFAULT_OUT_DIR, help="results folder (publish to bench/results/)")
    parser.add_argument("--name", default=None)
    parser.add_argument("--interleave", type=int, default=0, metavar="TURNS",
                        help="run every variant side by side in one cluster, each level TURNS times per "
                             "variant taking turns (module docstring); 0: one variant after another")
    parser.add_argument("--null-forward", type=float, default=None, metavar="A",
                        help="serve null forwards (no model computed; the draft agrees with the target at rate "
                             "A): the capacity of the stack itself (module docstring)")
    parser.add_argument("--compare", action="append", default=[], metavar="LABEL=TREE",
                        help="run the sweep once per tree (its code serving), the trees taking turns")
    parser.add_argument("--compare-config", action="append", default=[], metavar="LABEL=YAML",
                        help="with --compare: that label's runs serve this config (in place of --config), so "
                        "one tree compared with itself compares configs")
    parser.add_argument("--turns", type=int, default=2, help="with --compare: turns per tree")
    parser.add_argument("--combine", nargs="+", metavar="NAME",
                        help="no run: average these results in --out (names or JSON paths) of the same sweep, "
                             "e.g. one run and one in reverse variant order, into --name")
    args = parser.parse_args(argv)
    if args.compare:
        if not args.name:
            parser.error("--compare needs --name")
        compare_trees(args, argv if argv is not None else sys.argv[1:])
        return
    if args.combine:
        out = Path(args.out)
        paths = [Path(name) if Path(name).is_file() else out / f"{name}.json" for name in args.combine]
        combined = combine_runs([json.loads(path.read_text()) for path in paths], args.name or "combined")
        (out / f"{combined['name']}.json").write_text(json.dumps(combined, indent=1))
        (out / f"{combined['name']}.md").write_text(render_markdown(combined))
        plot(combined, out / f"{combined['name']}.png")
        print(render_markdown(combined))
        return
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted({split_variant(v)[0] for v in variants} - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    levels = [int(c) for c in args.concurrency.split(",")]
    prompt_set = load_prompt_set(args.prompts)
    prompts = select_prompts(prompt_set.prompts, args.num_prompts)
    base = load_config(args.config)

    def log(message: str) -> None:
        print(f"[bench-load {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    def bodies_for(level: int, model_name: str = base.model_name) -> list[tuple[str, dict]]:
        count = sweep_request_count(level, len(prompts), args.requests_per_level, args.requests_per_stream)
        return [(prompts[i % len(prompts)].prompt_id,
                 request_body(model_name, prompts[i % len(prompts)].text, args.mode, args.max_tokens, seed=i))
                for i in range(count)]

    import os
    import platform

    name = args.name or datetime.now(timezone.utc).strftime("load-%Y%m%dT%H%M%SZ")
    result = {"name": name, "prompts": f"`{prompt_set.name}` ({prompt_set.path.name}, {len(prompts)} prompts)",
              "max_tokens": args.max_tokens, "mode": args.mode,
              "command": "specserve bench-load " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
              "null_forward": args.null_forward, "code": served_code(), "variants": {}}
    from tqdm import tqdm

    progress = tqdm(total=len(variants) * len(levels), desc="bench-load", unit="level", file=sys.stderr)
    if args.interleave:
        # One HTTP port for every app; each app its own model name, so its own policy actor.
        port = free_port()
        configs = {variant: variant_config(base, variant, args.num_draft_tokens, port, args.null_forward).model_copy(
            update={"model_name": f"{base.model_name}-{variant}"}) for variant in variants}
        result["variants"] = run_interleaved(configs, bodies_for, levels, args.interleave, log, progress)
    else:
        for variant in variants:
            log(f"variant {variant}")
            config = variant_config(base, variant, args.num_draft_tokens, free_port(), args.null_forward)
            result["variants"][variant] = run_variant(config, bodies_for, levels, log, progress)
    progress.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(render_markdown(result))
    plot(result, out / f"{name}.png")
    print(render_markdown(result))


if __name__ == "__main__":
    main()
