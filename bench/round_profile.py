"""`python -m specserve.bench.round_profile`: where a single stream's round goes beyond the engines' compute.

Serves the default pair, sends the third-party prompts one at a time over HTTP (greedy, streamed,
64 tokens, `--passes` times after a warm-up), and splits each round's overhead two ways:

- the router's own accounting (the response's `speculation`): overhead = round wall time minus
  engine time; hops = the RPC hops of the calls the round waited on (router -> engine until the
  engine takes the call, engine answer -> router has it: pickling, Ray's transport, each event
  loop's pick-up); router = the rest (rejection sampling, chunking, policy, its event loop);
- an outside check from the engines' own call logs (`EngineCore.call_times`, stamped with the one
  CLOCK_MONOTONIC every process shares): per sequence, from one verify leaving the target engine
  to the next one leaving it, minus the time that next verify spent in the engine and the draft
  calls the round waited on (those that left before the verify entered). It does not rely on the
  router's clock at all.

With `--stages` (default on) the cluster runs with the one profiling switch on
(SPECSERVE_PROFILE_ROUNDS=1, deployments/round_stages.py), without which the served path keeps
no benchmark instrumentation: the engines keep their call logs (the outside check), responses
split the overhead into hops and router, and the router records every round's stages: its own
Python (policy, propose bookkeeping, launch, accept_round, record, chunk), each hop out and back,
each engine's batching-loop wait and compute; the report gives median and mean per stage,
pipelined rounds (block drafted ahead) apart from fresh ones.
It also reads the CPU seconds every process of the cluster (and this client) burned while the
requests ran, per round: what the HTTP/SSE side (proxy, ingress) and Ray's own daemons take from
the two cores the engines need.

Also reports tok/s, mean K, acceptance and the share of pipelined rounds. Writes
bench/results/<name>.json and .md.

`--modes greedy,sampled` sends each prompt once per request class (sampled: temperature 0.8,
seeded; top_p: the same with top-p 0.95), one at a time, the classes taking turns, and reports per class the orchestration of a
round: its wall time minus the time the round waited in the engines (each engine's forwards and
its batching loop's wait for a forward in progress), i.e. the hops and the router's own work.

`--compare LABEL=TREE` (given twice or more) runs this file once per tree and turn, the trees
taking turns (`--turns`), each tree's own code serving (PYTHONPATH=TREE: a `git worktree` of the
commit to compare), and writes one table of the classes' orchestration per tree:

    git worktree add /tmp/specserve-before <commit>
    python -m specserve.bench.round_profile --modes greedy,sampled --turns 2 \
        --compare before=/tmp/specserve-before --compare after=. --name <name> --out bench/results

`--compare-config LABEL=YAML` gives one label a config of its own, so one tree under two labels
compares two configs the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import psutil

from specserve.bench import DEFAULT_OUT_DIR
from specserve.bench.http_rows import free_port, request_body, run_level
from specserve.bench.tree_turns import label_configs, parse_trees, runs_per_tree, served_code
from specserve.common.config import load_config
from specserve.training.prompts import load_prompt_set


def engine_call_logs() -> dict[str, list[tuple[str, str, float, float]]]:
    """pool -> every call its engines logged: (kind, sequence id, entered, left)."""
    import ray

    from specserve.common.naming import ENGINE_NAMESPACE, parse_engine_actor_name

    logs: dict[str, list] = defaultdict(list)
    for entry in ray.util.list_named_actors(all_namespaces=True):
        parsed = parse_engine_actor_name(entry["name"]) if entry["namespace"] == ENGINE_NAMESPACE else None
        if parsed is not None:
            actor = ray.get_actor(entry["name"], namespace=ENGINE_NAMESPACE)
            logs[parsed[0]].extend(tuple(call) for call in ray.get(actor.call_times.remote(), timeout=30))
    return logs


def outside_overheads(logs: dict[str, list], sequences: set[str]) -> list[float]:
    """Per round, from the engines' logs: wall (verify left -> next verify left) minus the next
    verify's engine time and the engine time of draft calls that round waited on."""
    verifies, drafts = defaultdict(list), defaultdict(list)
    for kind, seq_id, entered, left in logs.get("target", []):
        if kind == "verify" and seq_id in sequences:
            verifies[seq_id].append((entered, left))
    for kind, seq_id, entered, left in logs.get("draft", []):
        if kind == "propose" and seq_id in sequences:
            drafts[seq_id].append((entered, left))
    overheads = []
    for seq_id, calls in verifies.items():
        calls.sort()
        for (_, previous_left), (entered, left) in zip(calls, calls[1:]):
            waited_drafts = sum(d_left - d_entered for d_entered, d_left in drafts[seq_id]
                                if previous_left <= d_entered and d_left <= entered)
            overheads.append((left - previous_left) - (left - entered) - waited_drafts)
    return overheads


STAGE_ORDER = ["wall", "policy", "draft_hop_out", "draft_loop_wait", "draft_compute", "draft_hop_back",
               "router_propose", "launch", "target_hop_out", "target_loop_wait", "target_compute",
               "target_hop_back", "accept", "record", "chunk"]


def stage_summary(rounds: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """stage -> {median, mean} ms over the rounds that have it, and the share of all rounds."""
    summary = {}
    for stage in STAGE_ORDER:
        values = [r[stage] for r in rounds if stage in r]
        if values:
            summary[stage] = {"median_ms": round(statistics.median(values), 3),
                              "mean_ms": round(statistics.fmean(values), 3),
                              "mean_over_all_rounds_ms": round(sum(values) / len(rounds), 3)}
    return summary


def process_role(process: psutil.Process) -> str:
    """A cluster process's role from its title: ray::Router, ray::TargetEngine, raylet, ..."""
    try:
        cmdline = process.cmdline()
    except psutil.Error:
        return "gone"
    head = cmdline[0] if cmdline else process.name()
    if head.startswith("ray::"):   # ray::ServeReplica:app:Router.handle_request (the method changes as it runs)
        return head[5:].split(" ")[0].split(".")[0].split(":")[-1] or head
    for name in ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env"):
        if name in " ".join(cmdline[:3]):
            return name
    return os.path.basename(head) or "other"


def cpu_seconds_by_process() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of this process and every process it started: pid ->
    (role, seconds)."""
    me = psutil.Process()
    seen: dict[int, tuple[str, float]] = {}
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        role = "client (this benchmark)" if process.pid == me.pid else process_role(process)
        seen[process.pid] = (role, times.user + times.system)
    return seen


def cpu_seconds_between(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role's processes spent between two `cpu_seconds_by_process` readings,
    process by process (a process started in between counts whole)."""
    totals: dict[str, float] = defaultdict(float)
    for pid, (role, seconds) in after.items():
        totals[role] += seconds - before.get(pid, (role, 0.0))[1]
    return totals


def median_ms(values: list[float]) -> float | None:
    return round(1000 * statistics.median(values), 3) if values else None


ENGINE_STAGES = ("draft_loop_wait", "draft_compute", "target_loop_wait", "target_compute")


def orchestration_ms(stages: dict[str, float]) -> float:
    """A round's wall time minus the time it waited in the engines (their forwards, and their
    batching loops' wait for a forward in progress): the hops and the router's own work."""
    return stages["wall"] - sum(stages.get(stage, 0.0) for stage in ENGINE_STAGES)


FIRST_TOKEN_PARTS = ("client", "outside_router", "router", "engine_lookup", "prefill_hops", "prefill_loop_wait",
                     "prefill_compute")


def first_token_split(records: list[dict]) -> dict[str, float] | None:
    """Medians (ms) of where a request's first token went: the client's wait, of it the way in and
    out of the router (HAProxy, the ingress, Serve's call to the router, the chunk's way back) and
    the router's own wait; of that, Serve's engine lookup, the prefill's hops, its engine's
    batching-loop wait and its compute. None without the router's profiled split."""
    split = [(1000 * r["ttft_s"], 1000 * r["server_ttft_s"], r["first_token_stages_ms"]) for r in records
             if r.get("ttft_s") is not None and r.get("server_ttft_s") is not None and r.get("first_token_stages_ms")]
    if not split:
        return None
    parts = {"client": [c for c, _, _ in split], "outside_router": [c - r for c, r, _ in split],
             "router": [r for _, r, _ in split], "engine_lookup": [s["engine_lookup"] for _, _, s in split],
             "prefill_hops": [s["target_hop_out"] + s["target_hop_back"] for _, _, s in split],
             "prefill_loop_wait": [s["target_loop_wait"] for _, _, s in split],
             "prefill_compute": [s["target_compute"] for _, _, s in split]}
    return {name: round(statistics.median(parts[name]), 3) for name in FIRST_TOKEN_PARTS}


def first_token_lines(split_by_row: dict[str, dict[str, float] | None]) -> list[str]:
    """A markdown table of first_token_split per row (a class, or a class and a tree)."""
    rows = {row: split for row, split in split_by_row.items() if split}
    if not rows:
        return []
    return ["", "First token, median ms: the client's wait; of it, outside the router (HAProxy, the ingress, "
            "Serve's call to the router, the chunk's way back) and the router's; of the router's, Serve's "
            "engine lookup, the prefill's hops, its engine's batching-loop wait and its compute", "",
            "| row | " + " | ".join(FIRST_TOKEN_PARTS) + " |", "|---|" + "---|" * len(FIRST_TOKEN_PARTS),
            *(f"| {row} | " + " | ".join(str(split[name]) for name in FIRST_TOKEN_PARTS) + " |"
              for row, split in rows.items())]


def class_summary(records: list[dict], span_s: float) -> dict:
    """One request class's figures: tok/s over its requests' own wall time, the client's time to
    the first token (median), and per round the orchestration (median, mean), the hops and the
    engines' share."""
    stages = [r for record in records for r in (record.get("round_stages_ms") or [])]
    orchestration = [orchestration_ms(r) for r in stages]
    tokens = sum(r["num_output_tokens"] for r in records)
    drafted = sum(r["num_drafted"] for r in records)
    hops = [sum(r.get(k, 0.0) for k in ("draft_hop_out", "draft_hop_back", "target_hop_out", "target_hop_back"))
            for r in stages]
    own = [round_orchestration - round_hops for round_orchestration, round_hops in zip(orchestration, hops)]
    first_token_ms = [1000 * r["ttft_s"] for r in records if r.get("ttft_s") is not None]
    return {"requests": len(records), "rounds_profiled": len(stages),
            "tokens_per_s": round(tokens / span_s, 1) if span_s > 0 else None,
            "ttft_median_ms": round(statistics.median(first_token_ms), 3) if first_token_ms else None,
            "first_token_split_ms": first_token_split(records),
            "acceptance": round(sum(r["num_accepted"] for r in records) / drafted, 3) if drafted else None,
            "orchestration_median_ms": round(statistics.median(orchestration), 3) if stages else None,
            "orchestration_mean_ms": round(statistics.fmean(orchestration), 3) if stages else None,
            "hops_median_ms": round(statistics.median(hops), 3) if stages else None,
            "own_median_ms": round(statistics.median(own), 3) if stages else None,
            "accept_median_ms": round(statistics.median(r.get("accept", 0.0) for r in stages), 3) if stages else None,
            "wall_median_ms": round(statistics.median(r["wall"] for r in stages), 3) if stages else None,
            "engines_median_ms": round(statistics.median(
                sum(r.get(s, 0.0) for s in ENGINE_STAGES) for r in stages), 3) if stages else None}


def median_split(per_turn: list[dict]) -> dict[str, float] | None:
    """The turns' first_token_split medians, part by part (None where a turn has none)."""
    splits = [summary.get("first_token_split_ms") for summary in per_turn]
    if not splits or any(split is None for split in splits):
        return None
    return {name: round(statistics.median(split[name] for split in splits), 3) for name in FIRST_TOKEN_PARTS}


def compare_trees(args) -> None:
    """Run this file under each tree (PYTHONPATH), the trees taking turns; one table per class."""
    trees = parse_trees(args.compare)
    child = ["--passes", str(args.passes), "--max-tokens", str(args.max_tokens), "--prompts", args.prompts,
             "--modes", args.modes]
    if args.num_draft_tokens is not None:
        child += ["-K", str(args.num_draft_tokens)]
    label_args = label_configs(args.compare_config, trees, args.config)
    modes = args.modes.split(",")
    runs = runs_per_tree("specserve.bench.round_profile", child, trees, args.turns, label_args)
    command = "python -m specserve.bench.round_profile " + " ".join(sys.argv[1:])
    result = {"name": args.name, "command": command, "machine": f"{os.cpu_count()} CPUs",
              "trees": {label: str(tree) for label, tree in trees}, "turns": args.turns,
              "configs": {label: arguments[-1] for label, arguments in label_args.items()},
              "runs": {label: [run["classes"] for run in label_runs] for label, label_runs in runs.items()}}
    lines = [f"# round orchestration: {args.name}", "", f"- command: `{command}`",
             f"- trees: {', '.join(f'{label} = {tree}' for label, tree in trees)}; {args.turns} turns, "
             f"the trees taking turns; per turn {args.passes} passes of the {args.prompts} prompts, one request at a "
             f"time, {args.max_tokens} tokens, {result['machine']}",
             *([f"- configs: {', '.join(f'{label} = {path}' for label, path in result['configs'].items())}"]
               if result["configs"] else []),
             "- orchestration per round = round wall time minus the time it waited in the engines "
             "(forwards and batching-loop waits): hops plus the router's own work",
             "- the router's own work per round = orchestration minus hops, of it the acceptance (the accept "
             "stage); - where a tree's own round_profile predates these figures", "",
             "| class | tree | orchestration ms per round, median (per turn) | mean | hops ms, median | "
             "router's own ms, median | of it acceptance ms, median | "
             "round wall ms, median | engines ms, median | tok/s (per turn) | first token ms, median (per turn) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for mode in modes:
        for label, _ in trees:
            per_turn = [run["classes"][mode] for run in runs[label]]
            median = lambda key: (round(statistics.median(c[key] for c in per_turn), 3)  # noqa: E731
                                  if all(c.get(key) is not None for c in per_turn) else None)
            row = summary[f"{mode}/{label}"] = {key: median(key) for key in (
                "orchestration_median_ms", "orchestration_mean_ms", "hops_median_ms", "own_median_ms",
                "accept_median_ms", "wall_median_ms", "engines_median_ms", "tokens_per_s", "ttft_median_ms")}
            cell = lambda key: "-" if row[key] is None else row[key]  # noqa: E731
            lines.append(f"| {mode} | {label} | {cell('orchestration_median_ms')} "
                         f"({', '.join(str(c['orchestration_median_ms']) for c in per_turn)}) | "
                         f"{cell('orchestration_mean_ms')} | {cell('hops_median_ms')} | "
                         f"{cell('own_median_ms')} | {cell('accept_median_ms')} | {cell('wall_median_ms')} | "
                         f"{cell('engines_median_ms')} | {cell('tokens_per_s')} "
                         f"({', '.join(str(c['tokens_per_s']) for c in per_turn)}) | {cell('ttft_median_ms')} "
                         f"({', '.join(str(c['ttft_median_ms']) for c in per_turn)}) |")
    result["summary"] = summary
    lines += first_token_lines({f"{mode} / {label}": median_split([run["classes"][mode] for run in runs[label]])
                                for mode in modes for label, _ in trees})
    result["cpu_ms_per_target_pass"] = cpu = {label: median_cpu([run["cpu_ms_per_target_pass"] for run in runs[label]])
                                              for label, _ in trees}
    lines += ["", "CPU ms per target pass, by process (while the measured requests ran; median of the turns)", "",
              f"| process | {' | '.join(label for label, _ in trees)} |", f"|---|{'---|' * len(trees)}"]
    roles = sorted({role for by_role in cpu.values() for role in by_role}, key=lambda role: -max(
        by_role.get(role, 0.0) for by_role in cpu.values()))
    lines += [f"| {role} | {' | '.join(str(cpu[label].get(role, 0.0)) for label, _ in trees)} |" for role in roles]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def median_cpu(turns: list[dict[str, float]]) -> dict[str, float]:
    """Each process's CPU ms per target pass, the median over turns (0 in a turn it did not show)."""
    roles = {role for turn in turns for role in turn}
    return {role: round(statistics.median(turn.get(role, 0.0) for turn in turns), 3) for role in roles}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.round_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--config")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", default="thirdparty")
    parser.add_argument("--num-draft-tokens", "-K", type=int, default=None, help="pin K (default: adaptive)")
    parser.add_argument("--stream-interval-ms", type=float, default=None,
                        help="http.stream_interval_ms for the served app (default: the config's)")
    parser.add_argument("--no-stages", dest="stages", action="store_false",
                        help="leave the profiling switch off (SPECSERVE_PROFILE_ROUNDS): no stages, hops "
                             "or outside check, only tok/s and the overhead")
    parser.add_argument("--modes", default="greedy", help="request classes, comma-separated: greedy, sampled, "
                        "top_p (sampled with top-p 0.95)")
    parser.add_argument("--compare", action="append", default=[], metavar="LABEL=TREE",
                        help="run once per tree (its code serving), the trees taking turns")
    parser.add_argument("--compare-config", action="append", default=[], metavar="LABEL=YAML",
                        help="with --compare: that label's runs serve this config (in place of --config), so "
                        "one tree compared with itself compares configs")
    parser.add_argument("--turns", type=int, default=2, help="with --compare: turns per tree")
    parser.add_argument("--name", default="round-profile-thirdparty")
    parser.add_argument("--out", default=DEFAULT_OUT_DIR, help="results folder (publish to bench/results/)")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= {"greedy", "sampled", "top_p"}:
        raise SystemExit(f"--modes takes greedy, sampled and/or top_p, not {args.modes!r}")
    if args.compare:
        if not args.stages:
            raise SystemExit("--compare reads the rounds' stages: leave --no-stages out")
        compare_trees(args)
        return

    from specserve.cluster.local import start_local, stop_local

    base = load_config(args.config)
    data = base.model_dump(mode="json")
    data["http"] = {**data["http"], "host": "127.0.0.1", "port": free_port()}
    if args.stream_interval_ms is not None:
        data["http"]["stream_interval_ms"] = args.stream_interval_ms
    if args.num_draft_tokens is not None:
        data["speculation"] = {**data["speculation"], "adaptive": False, "num_draft_tokens": args.num_draft_tokens}
    config = type(base).model_validate(data)
    prompts = load_prompt_set(args.prompts).prompts
    bodies = [(f"{mode}:{p.prompt_id}", request_body(config.model_name, p.text, mode, args.max_tokens, seed=i))
              for i, p in enumerate(prompts) for mode in modes]
    if args.stages:
        from specserve.deployments.round_stages import PROFILE_ENV

        os.environ[PROFILE_ENV] = "1"  # the cluster's processes inherit it
    url = start_local(config)
    try:
        run_level(url, bodies[:2], 1)  # warm-up
        cpu_before = cpu_seconds_by_process()
        levels = [run_level(url, bodies, 1) for _ in range(args.passes)]
        cpu_after = cpu_seconds_by_process()
        logs = engine_call_logs()
    finally:
        stop_local()
    records = [record for level in levels for record in level["records"]]
    # Sequences are named by request id; the logs also hold the two warm-up requests (a small share).
    sequences = {seq_id for _, seq_id, _, _ in logs.get("target", [])}
    drafted, rounds = sum(r["num_drafted"] for r in records), sum(r["rounds"] for r in records)
    outside = outside_overheads(logs, sequences)

    def per_request(key: str) -> float | None:
        values = [r[key] for r in records if r.get(key) is not None]
        return round(1000 * statistics.median(values), 3) if values else None

    stages = [r for record in records for r in (record.get("round_stages_ms") or [])]
    pipelined = [r for r in stages if "draft_compute" not in r]
    fresh = [r for r in stages if "draft_compute" in r]
    target_passes = sum(r["target_passes"] for r in records)
    cpu_spent = cpu_seconds_between(cpu_before, cpu_after)
    cpu_per_round_ms = {role: round(1000 * seconds / max(1, target_passes), 3)
                        for role, seconds in sorted(cpu_spent.items(), key=lambda item: -item[1])}
    result = {
        "name": args.name, "command": "python -m specserve.bench.round_profile " + " ".join(argv if argv is not None else sys.argv[1:]),
        "prompts": args.prompts, "max_tokens": args.max_tokens, "requests": len(records),
        "stream_interval_ms": config.http.stream_interval_ms,
        "tokens_per_s": [round(level["tokens_per_s"], 1) for level in levels],
        "median_tokens_per_s": round(statistics.median(level["tokens_per_s"] for level in levels), 1),
        "mean_draft_tokens": round(drafted / rounds, 2) if rounds else 0.0,
        "acceptance": round(sum(r["num_accepted"] for r in records) / drafted, 3) if drafted else None,
        "router_overhead_ms": per_request("median_overhead_s"),
        "router_hops_ms": per_request("median_hops_s"),
        "router_own_ms": per_request("median_router_s"),
        "outside_overhead_ms": median_ms(outside), "outside_rounds": len(outside),
        "machine": f"{os.cpu_count()} CPUs",
        "stages_all_rounds": stage_summary(stages), "stages_pipelined_rounds": stage_summary(pipelined),
        "stages_fresh_rounds": stage_summary(fresh), "rounds_profiled": len(stages),
        "pipelined_share": round(len(pipelined) / len(stages), 3) if stages else None,
        "cpu_ms_per_target_pass": {role: ms for role, ms in cpu_per_round_ms.items() if ms > 0.0},
        "code": served_code(),
        "classes": {mode: class_summary([r for r in records if r["prompt_id"].startswith(mode + ":")],
                                        sum(r["wall_s"] for r in records if r["prompt_id"].startswith(mode + ":")))
                    for mode in modes},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# round profile: {args.name}", "", f"- command: `{result['command']}`",
             f"- {result['requests']} single-stream requests, {args.prompts} prompts, {args.modes}, {args.max_tokens} tokens, "
             f"{result['machine']}", "", "| measure | value |", "|---|---|"]
    tables = ("stages_all_rounds", "stages_pipelined_rounds", "stages_fresh_rounds", "cpu_ms_per_target_pass", "classes")
    lines += [f"| {key} | {value} |" for key, value in result.items()
              if key not in ("name", "command", "machine", *tables)]
    for key in tables[:3]:
        if result[key]:
            lines += ["", f"{key} (ms; mean over all rounds = mean x share of rounds that have the stage)", "",
                      "| stage | median | mean | mean over all rounds |", "|---|---|---|---|"]
            lines += [f"| {stage} | {v['median_ms']} | {v['mean_ms']} | {v['mean_over_all_rounds_ms']} |"
                      for stage, v in result[key].items()]
    lines += first_token_lines({mode: summary["first_token_split_ms"] for mode, summary in result["classes"].items()})
    lines += ["", "CPU ms per target pass, by process (while the measured requests ran)", "",
              "| process | CPU ms |", "|---|---|"]
    lines += [f"| {role} | {ms} |" for role, ms in result["cpu_ms_per_target_pass"].items()]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
