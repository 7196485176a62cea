"""What serving costs an engine's forward: the target's model call timed inside the served engine
actor, alone and while one HTTP stream decodes through the whole stack.

    python -m specserve.bench.figures.served_step [--config bench/figures/small-model-as-target.yaml] \\
        [--turns 3] [--max-tokens 64] --out bench/results --name NAME

The app serves the config's target alone (speculation.proposer none), in a cluster started as
`specserve serve` starts it (bench.http_rows.served_apps: Serve's data plane). Each turn measures the
same engine twice, its runner's model call (`_logits`) timed in place by a wrapper installed
through Ray's `__ray_call__`:
- alone: a driver inside the engine actor decodes the third-party prompts greedily through the
  engine's own iteration (`EngineCore.step`), with no request in flight anywhere else: no channel,
  router, ingress, proxy or client at work;
- served: the same prompts streamed one at a time over HTTP (HAProxy, the ingress, the router, the
  channel to the engine), with the client's time per output token.
The forward is the same call on the same weights both ways; what differs is the processes running
beside it on the box's cores. docs/performance.md reads the result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specserve.bench import DEFAULT_OUT_DIR
from specserve.bench.report import markdown_table

DEFAULT_CONFIG = Path(__file__).resolve().parent / "small-model-as-target.yaml"


def install_timer(process) -> int:
    """(in the engine's actor, deployments.engine_process.EngineProcess) Time its runner's model calls
    (bench.look_alike.timed_forwards), keeping each call's seconds."""
    from specserve.bench.look_alike import timed_forwards

    engine = process.engine
    runner = engine.scheduler.runner
    if not hasattr(runner, "served_step_seconds"):
        runner.served_step_seconds = []
        timed_forwards(engine.scheduler, [0.0], each=runner.served_step_seconds)
    return len(runner.served_step_seconds)


def take_times(process) -> list[float]:
    """(in the engine's actor) The model calls' seconds since the last take."""
    seconds = process.engine.scheduler.runner.served_step_seconds
    taken = list(seconds)
    seconds.clear()
    return taken


def decode_alone(process, prompts: list[list[int]], max_tokens: int, tag: str) -> int:
    """(in the engine's actor) Each prompt decoded greedily through the engine's own iteration, one
    token a step, with no other call in flight; -> tokens decoded."""
    from specserve.decoding.proposers import empty_proposal
    from specserve.decoding.sampling import SamplingParams
    from specserve.deployments.target_worker import VerifyCall

    engine, greedy = process.engine, SamplingParams(temperature=0, max_tokens=max_tokens)
    decoded = 0
    for index, prompt in enumerate(prompts):
        seq_id, history = f"served-step-{tag}-{index}", list(prompt)
        for _ in range(max_tokens):
            results, _ = engine.step([VerifyCall(seq_id, list(history), 1, greedy, None, None, None,
                                                 empty_proposal(), "block")])
            history.append(results[0][0])
            decoded += 1
        engine.forget(seq_id)
    return decoded


def decode_forwards(seconds: list[float]) -> list[float]:
    """The one-token forwards: a prompt's prefill is the longest call of its request, and the
    median over hundreds of decode steps does not move by a dozen prefills, which are dropped."""
    return sorted(seconds)[:max(len(seconds) - len(seconds) // 50, 1)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="specserve YAML whose target is served (default: the shipped draft "
                        "as the target, bench/figures/small-model-as-target.yaml)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", default="thirdparty")
    parser.add_argument("--out", default=str(DEFAULT_OUT_DIR))
    parser.add_argument("--name", default="served-step")
    args = parser.parse_args(argv)

    import ray
    from transformers import AutoTokenizer

    from specserve.bench.http_rows import request_body, run_sequential, served_apps
    from specserve.bench.records import time_per_output_token_s
    from specserve.common.config import load_config
    from specserve.common.naming import ENGINE_NAMESPACE, parse_engine_actor_name
    from specserve.training.prompts import load_prompt_set

    config = load_config(args.config or DEFAULT_CONFIG)
    config = config.model_copy(update={"speculation": config.speculation.model_copy(update={"proposer": "none"})})
    prompts = load_prompt_set(args.prompts).prompts
    tokenizer = AutoTokenizer.from_pretrained(config.resolved_tokenizer_path, local_files_only=True)
    prompt_ids = [tokenizer.encode(p.text, add_special_tokens=False) for p in prompts]
    turns = []
    with served_apps(config) as url:
        names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                 if (parsed := parse_engine_actor_name(actor["name"])) and parsed[0] == "target"]
        engine = ray.get_actor(names[0], namespace=ENGINE_NAMESPACE)
        ray.get(engine.__ray_call__.remote(install_timer))
        jobs = [("served", url, request_body(config.model_name, p.text, "greedy", args.max_tokens, 0), p.prompt_id, 0)
                for p in prompts]
        run_sequential(jobs[:2])                                            # warm-up: both paths once
        ray.get(engine.__ray_call__.remote(decode_alone, prompt_ids[:2], args.max_tokens, "warm"))
        ray.get(engine.__ray_call__.remote(take_times))
        for turn in range(args.turns):
            started = time.perf_counter()
            tokens = ray.get(engine.__ray_call__.remote(decode_alone, prompt_ids, args.max_tokens, str(turn)))
            alone_wall = time.perf_counter() - started
            alone = decode_forwards(ray.get(engine.__ray_call__.remote(take_times)))
            records = [record for _, record in run_sequential(jobs)]
            served = decode_forwards(ray.get(engine.__ray_call__.remote(take_times)))
            turns.append({
                "forward_alone_ms": round(statistics.median(alone) * 1000, 3),
                "forward_served_ms": round(statistics.median(served) * 1000, 3),
                "step_alone_ms": round(alone_wall / tokens * 1000, 3),
                "served_tpot_ms": round(statistics.median(time_per_output_token_s(r) for r in records) * 1000, 3)})
    summary = {field: round(statistics.median(turn[field] for turn in turns), 3) for field in turns[0]}
    summary["served_over_alone"] = round(summary["forward_served_ms"] / summary["forward_alone_ms"], 2)
    given_config = f" --config {args.config}" if args.config else ""
    result = {"command": f"python -m specserve.bench.figures.served_step{given_config} --turns {args.turns} "
                         f"--max-tokens {args.max_tokens} --out {args.out} --name {args.name}",
              "model": config.target.path, "prompts": args.prompts, "turns": turns, "median": summary}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    rows = [[f"turn {i + 1}", *map(str, turn.values())] for i, turn in enumerate(turns)]
    rows.append(["median", *(str(summary[field]) for field in turns[0])])
    lines = [f"# served step: {args.name}", "",
             f"- command: `{result['command']}`",
             f"- target `{config.target.path}` served alone, greedy, {len(prompts)} `{args.prompts}` prompts, "
             f"{args.max_tokens} tokens each, one at a time; turns alternate alone / served",
             "- forward: the runner's model call, median over one-token steps; step alone: the engine's "
             "iteration driven inside its actor, wall per token; served TPOT: the HTTP client's",
             f"- served forward / alone forward: **{summary['served_over_alone']}x**", "",
             markdown_table(["", "forward alone ms", "forward served ms", "step alone ms", "served TPOT ms"], rows)]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
