"""`python -m specserve.bench.figures.process_cpu`: what each process of a served app burns, under
load and idle after it.

Why: on a small machine every process shares the cores with the engines' forwards, so CPU a
process spends beside the rounds (a policy refit, a control loop, a metrics agent) is taken from
them; and a server that burns a core while nobody calls it costs its owner. One run serves the
config with the local bring-up, sends `--streams` streams of the third-party prompts
(`--requests` requests, greedy), and reads every process's CPU over the load and then over
`--idle-s` seconds with no requests. `--compare LABEL=TREE` (twice or more) runs it once per tree
and turn, the trees taking turns, each serving its own code.

    python -m specserve.bench.figures.process_cpu --config bench/figures/null-forward.yaml --compare before=/tmp/tree-before \\
        --compare after=. --turns 2 --name <name> --out bench/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from specserve.bench import DEFAULT_OUT_DIR
from specserve.bench.http_rows import free_port, request_body, run_level
from specserve.bench.round_profile import cpu_seconds_between, cpu_seconds_by_process
from specserve.bench.tree_turns import parse_trees, script_in_tree, turn_order
from specserve.common.config import load_config
from specserve.training.prompts import load_prompt_set


def one_run(config_path: str | None, streams: int, requests: int, max_tokens: int, idle_s: float) -> dict:
    """Serve, load, idle: each role's share of one core (percent) in both phases, and the load's tok/s."""
    from specserve.cluster.local import start_local, stop_local

    base = load_config(config_path)
    data = base.model_dump(mode="json")
    data["http"] = {**data["http"], "host": "127.0.0.1", "port": free_port()}
    config = type(base).model_validate(data)
    prompts = load_prompt_set("thirdparty").prompts
    bodies = [(f"greedy:{i}", request_body(config.model_name, prompts[i % len(prompts)].text, "greedy", max_tokens, i))
              for i in range(requests)]
    url = start_local(config)
    try:
        run_level(url, bodies[:2], 1)  # warm-up
        phases = {}
        before, started = cpu_seconds_by_process(), time.perf_counter()
        level = run_level(url, bodies, streams)
        loaded, loaded_s = cpu_seconds_by_process(), time.perf_counter() - started
        time.sleep(idle_s)
        idle = cpu_seconds_by_process()
        for phase, (first, last, seconds) in {"loaded": (before, loaded, loaded_s), "idle": (loaded, idle, idle_s)}.items():
            phases[phase] = {role: round(100 * spent / seconds, 1)
                             for role, spent in cpu_seconds_between(first, last).items() if spent > 0}
    finally:
        stop_local()
    return {"tokens_per_s": round(level["tokens_per_s"], 1), "cpu_percent": phases}


def median_shares(runs: list[dict], phase: str) -> dict[str, float]:
    roles = {role for run in runs for role in run["cpu_percent"][phase]}
    return {role: round(statistics.median(run["cpu_percent"][phase].get(role, 0.0) for run in runs), 1)
            for role in roles}


def markdown(result: dict) -> str:
    labels = list(result["runs"])
    lines = [f"# CPU by process, under load and idle: {result['name']}", "", f"- command: `{result['command']}`",
             f"- {result['streams']} greedy streams of the third-party prompts ({result['requests']} requests, "
             f"{result['max_tokens']} tokens), then {result['idle_s']} s with no requests; "
             f"{result['turns']} turns, the trees taking turns; medians of the turns",
             f"- trees: {', '.join(f'{label} = {tree}' for label, tree in result['trees'].items())}", "",
             "| tree | tok/s under load (per turn) |", "|---|---|"]
    lines += [f"| {label} | {result['summary'][label]['tokens_per_s']} "
              f"({', '.join(str(run['tokens_per_s']) for run in result['runs'][label])}) |" for label in labels]
    for phase in ("loaded", "idle"):
        shares = {label: result["summary"][label][phase] for label in labels}
        roles = sorted({role for by_role in shares.values() for role in by_role},
                       key=lambda role: -max(by_role.get(role, 0.0) for by_role in shares.values()))
        lines += ["", f"% of one core, {phase}", "", f"| process | {' | '.join(labels)} |", f"|---|{'---|' * len(labels)}"]
        lines += [f"| {role} | {' | '.join(str(shares[label].get(role, 0.0)) for label in labels)} |" for role in roles]
        lines.append(f"| all | {' | '.join(str(round(sum(shares[label].values()), 1)) for label in labels)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.figures.process_cpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--config")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--compare", action="append", default=[], metavar="LABEL=TREE",
                        help="run once per tree (its code serving), the trees taking turns (default: this checkout)")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)  # a tree's turn: print its JSON
    parser.add_argument("--name", default="process-cpu")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)
    if args.one_run:
        print(json.dumps(one_run(args.config, args.streams, args.requests, args.max_tokens, args.idle_s)))
        return
    trees = parse_trees(args.compare or ["this=."])
    child = ["--one-run", "--streams", str(args.streams), "--requests", str(args.requests),
             "--max-tokens", str(args.max_tokens), "--idle-s", str(args.idle_s),
             *(["--config", str(Path(args.config).resolve())] if args.config else [])]
    runs: dict[str, list[dict]] = {label: [] for label, _ in trees}
    for turn in range(args.turns):
        for label in turn_order([label for label, _ in trees], turn):
            runs[label].append(json.loads(script_in_tree(Path(__file__).resolve(), dict(trees)[label], child)))
    result = {"name": args.name, "command": "python -m specserve.bench.figures.process_cpu " + " ".join(
                  argv if argv is not None else sys.argv[1:]),
              "streams": args.streams, "requests": args.requests, "max_tokens": args.max_tokens, "idle_s": args.idle_s,
              "turns": args.turns, "trees": {label: str(tree) for label, tree in trees}, "runs": runs,
              "summary": {label: {"tokens_per_s": round(statistics.median(run["tokens_per_s"] for run in label_runs), 1),
                                  "loaded": median_shares(label_runs, "loaded"), "idle": median_shares(label_runs, "idle")}
                          for label, label_runs in runs.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
