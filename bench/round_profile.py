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
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import psutil

from specserve.bench import DEFAULT_OUT_DIR
from specserve.bench.http_rows import free_port, request_body, run_level
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
    if head.startswith("ray::"):
        return re.split(r"[.:]", head[5:].replace("ServeReplica:", "").split(" ")[0])[-1] or head
    for name in ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env"):
        if name in " ".join(cmdline[:3]):
            return name
    return os.path.basename(head) or "other"


def cpu_seconds_by_role() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process and every process it started, by role."""
    me = psutil.Process()
    totals: dict[str, float] = defaultdict(float)
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        role = "client (this benchmark)" if process.pid == me.pid else process_role(process)
        totals[role] += times.user + times.system
    return totals


def median_ms(values: list[float]) -> float | None:
    return round(1000 * statistics.median(values), 3) if values else None


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
    parser.add_argument("--name", default="round-profile-thirdparty")
    parser.add_argument("--out", default=DEFAULT_OUT_DIR, help="results folder (publish to bench/results/)")
    args = parser.parse_args(argv)

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
    bodies = [(p.prompt_id, request_body(config.model_name, p.text, "greedy", args.max_tokens, seed=i))
              for i, p in enumerate(prompts)]
    if args.stages:
        from specserve.deployments.round_stages import PROFILE_ENV

        os.environ[PROFILE_ENV] = "1"  # the cluster's processes inherit it
    url = start_local(config)
    try:
        run_level(url, bodies[:2], 1)  # warm-up
        cpu_before = cpu_seconds_by_role()
        levels = [run_level(url, bodies, 1) for _ in range(args.passes)]
        cpu_after = cpu_seconds_by_role()
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
    cpu_per_round_ms = {role: round(1000 * (cpu_after.get(role, 0.0) - cpu_before.get(role, 0.0)) / max(1, target_passes), 3)
                        for role in sorted(cpu_after, key=lambda k: cpu_before.get(k, 0.0) - cpu_after[k])}
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
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# round profile: {args.name}", "", f"- command: `{result['command']}`",
             f"- {result['requests']} single-stream requests, {args.prompts} prompts, greedy, {args.max_tokens} tokens, "
             f"{result['machine']}", "", "| measure | value |", "|---|---|"]
    tables = ("stages_all_rounds", "stages_pipelined_rounds", "stages_fresh_rounds", "cpu_ms_per_target_pass")
    lines += [f"| {key} | {value} |" for key, value in result.items()
              if key not in ("name", "command", "machine", *tables)]
    for key in tables[:3]:
        if result[key]:
            lines += ["", f"{key} (ms; mean over all rounds = mean x share of rounds that have the stage)", "",
                      "| stage | median | mean | mean over all rounds |", "|---|---|---|---|"]
            lines += [f"| {stage} | {v['median_ms']} | {v['mean_ms']} | {v['mean_over_all_rounds_ms']} |"
                      for stage, v in result[key].items()]
    lines += ["", "CPU ms per target pass, by process (while the measured requests ran)", "",
              "| process | CPU ms |", "|---|---|"]
    lines += [f"| {role} | {ms} |" for role, ms in result["cpu_ms_per_target_pass"].items()]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
