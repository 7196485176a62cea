"""`specserve bench`: every row of the benchmark in one run, so ratios compare like with like.

Order: load the pair once, measure step latencies, run the in-process rows (interleaved prompt
by prompt so background load hits every row alike), then bring up Ray Serve and run the HTTP rows
(specserve and target-only interleaved, then the concurrency sweep), then summarise and write
<--out>/<name>.{json,md} and plots (by default in bench-out/, which git ignores). HTTP rows are skipped, with a note, off CPU (the GPU box
has no Ray) or where Ray is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.bench import DEFAULT_OUT_DIR
from specserve.bench.perfmodel import ratio
from specserve.bench.records import RequestRecord, StepLatency, step_size_for, summarize_row
from specserve.training.prompts import DEFAULT_PROMPT_SET, PROMPT_SETS, load_prompt_set, select_prompts

IN_PROCESS_ROWS = ["target-inproc", "hf-target", "hf-dynamic", "hf-constant", "specserve-inproc"]
HTTP_ROWS = ["target-http", "specserve-http"]
ALL_ROWS = IN_PROCESS_ROWS + HTTP_ROWS + ["sweep"]
WARMUP_TOKENS = 8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specserve bench", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="specserve YAML (default: the shipped pair models/default/{target,draft})")
    parser.add_argument("--device", default="cpu", help="cpu | cuda (cuda: in-process rows only)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="in-process rows; the HTTP rows use the config's dtype")
    parser.add_argument("--mode", default="both", choices=["greedy", "sampled", "both"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-draft-tokens", "-K", type=int, default=4)
    parser.add_argument("--adaptive", action="store_true",
                        help="HTTP rows use the config's adaptive depth instead of pinning K")
    parser.add_argument("--rows", default=",".join(ALL_ROWS), help=f"comma-separated subset of {','.join(ALL_ROWS)}")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="stream counts of the HTTP sweep")
    parser.add_argument("--sweep-max-requests", type=int, default=32, help="cap on requests per sweep level")
    parser.add_argument("--sweep-target-only", action="store_true", help="sweep the target-only app too")
    parser.add_argument("--num-prompts", type=int, default=None, help="use a subset (code and prose mixed)")
    parser.add_argument("--prompts", default=DEFAULT_PROMPT_SET,
                        help=f"prompt set ({', '.join(PROMPT_SETS)}) or a prompt-set JSON path; "
                             "thirdparty is code unlike the training corpus")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the in-process rows")
    parser.add_argument("--out", default=DEFAULT_OUT_DIR, help="results folder (publish to bench/results/)")
    parser.add_argument("--name", help="result file stem (default: UTC time and device)")
    args = parser.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ALL_ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {ALL_ROWS}")
    args.rows = rows
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.modes = ["greedy", "sampled"] if args.mode == "both" else [args.mode]
    if args.num_draft_tokens < 1 or args.max_tokens < 2 or args.runs < 1:
        parser.error("need --num-draft-tokens >= 1, --max-tokens >= 2 and --runs >= 1")
    return args


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def seed_for(run: int, prompt_index: int) -> int:
    """Sampled requests: the same seed for every row at one (run, prompt)."""
    return 1000 * run + prompt_index


def machine_info(device: str) -> dict:
    import transformers

    info = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "device": device,
            "loadavg_start": _loadavg()}
    try:
        import ray

        info["ray"] = ray.__version__
    except ImportError:
        info["ray"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(torch.device(device))
    else:
        info["device_name"] = _cpu_model() or platform.processor() or "cpu"
    return info


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# -- measurement phases -----------------------------------------------------------------------------

def run_in_process(args, pair, prompts, prompt_ids, records: dict) -> None:
    from specserve.bench.inprocess import in_process_rows

    rows = [row for row in in_process_rows(args.num_draft_tokens) if row.key in args.rows]
    for mode in args.modes:
        first = prompts[0].prompt_id
        for row in rows:  # warm-up: allocator, kernels, HF's first-call setup
            row.measure(pair, "warmup", 0, prompt_ids[first], mode, WARMUP_TOKENS, 0)
        progress = tqdm(total=args.runs * len(prompts) * len(rows), desc=f"in-process {mode}", unit="req",
                        file=sys.stderr, mininterval=5)
        for run in range(args.runs):
            for index, prompt in enumerate(prompts):
                for row in rows:
                    record = row.measure(pair, prompt.prompt_id, run, prompt_ids[prompt.prompt_id], mode,
                                         args.max_tokens, seed_for(run, index))
                    records.setdefault((mode, row.key), []).append(record)
                    progress.update()
            log(f"in-process {mode} run {run + 1}/{args.runs} done")
        progress.close()


def run_http(args, config, prompts, records: dict, sweeps: dict) -> None:
    from specserve.bench.http_rows import free_port, http_configs, request_body, run_level, run_sequential, serving
    from specserve.bench.http_rows import sweep_request_count

    speculative, target_only = http_configs(config, args.num_draft_tokens, args.adaptive, free_port())
    log("starting Ray Serve (specserve + target-only apps) ...")
    with serving(speculative, target_only) as endpoints:
        log(f"serving at {endpoints.specserve} and {endpoints.target_only}")
        urls = {"specserve-http": endpoints.specserve, "target-http": endpoints.target_only}
        keys = [key for key in HTTP_ROWS if key in args.rows]
        for mode in args.modes:
            body = request_body(endpoints.model_name, prompts[0].text, mode, WARMUP_TOKENS, 0)
            run_sequential([(key, urls[key], body, "warmup", 0) for key in urls])
            for run in range(args.runs):
                jobs = [(key, urls[key], request_body(endpoints.model_name, prompt.text, mode, args.max_tokens,
                                                      seed_for(run, index)), prompt.prompt_id, run)
                        for index, prompt in enumerate(prompts) for key in keys]
                for key, record in run_sequential(jobs):
                    records.setdefault((mode, key), []).append(record)
                if jobs:
                    log(f"HTTP single-stream {mode} run {run + 1}/{args.runs} done")
            if "sweep" not in args.rows:
                continue
            apps = {"specserve": endpoints.specserve}
            if args.sweep_target_only:
                apps["target-only"] = endpoints.target_only
            for app, url in apps.items():
                levels = []
                for concurrency in args.concurrency:
                    count = sweep_request_count(concurrency, len(prompts), args.sweep_max_requests)
                    bodies = [(prompts[i % len(prompts)].prompt_id,
                               request_body(endpoints.model_name, prompts[i % len(prompts)].text, mode,
                                            args.max_tokens, seed_for(0, i))) for i in range(count)]
                    levels.append(run_level(url, bodies, concurrency))
                    log(f"sweep {app} {mode} x{concurrency}: {levels[-1]['tokens_per_s']:.1f} tok/s")
                sweeps.setdefault(mode, {})[app] = levels


# -- summary ----------------------------------------------------------------------------------------

ROW_INFO = {  # key -> (label, transport)
    "target-inproc": ("target-only (generate, K=0)", "in-process"),
    "hf-target": ("HF generate, target only", "in-process"),
    "hf-dynamic": ("HF assisted, default dynamic schedule", "in-process"),
    "hf-constant": ("HF assisted, constant K", "in-process"),
    "specserve-inproc": ("specserve reference (decoding/generate.py)", "in-process"),
    "target-http": ("target-only (Serve app, proposer none)", "HTTP"),
    "specserve-http": ("specserve, single stream", "HTTP"),
}


def configured_depth(key: str, args) -> int | None:
    if key in ("target-inproc", "hf-target", "target-http"):
        return 0
    if key == "hf-dynamic" or (key == "specserve-http" and args.adaptive):
        return None
    return args.num_draft_tokens


def summarize_mode(mode: str, args, records: dict, steps: StepLatency | None) -> list[dict]:
    """Rows of one mode, with ratios against the baselines measured in this same run."""
    rows = []
    for key in IN_PROCESS_ROWS + HTTP_ROWS:
        if (mode, key) not in records:
            continue
        label, transport = ROW_INFO[key]
        rows.append({"key": key, "label": label, "transport": transport, "mode": mode,
                     "num_draft_tokens": configured_depth(key, args),
                     **summarize_row(records[(mode, key)], steps),
                     "records": [r.to_dict() for r in records[(mode, key)]]})
    speed = {row["key"]: row["tokens_per_s"] for row in rows}
    for row in rows:
        baseline = "target-http" if row["transport"] == "HTTP" and "target-http" in speed else "target-inproc"
        row["baseline"] = baseline
        row["vs_target_only"] = ratio(row["tokens_per_s"], speed.get(baseline))
        row["vs_target_only_inproc"] = ratio(row["tokens_per_s"], speed.get("target-inproc"))
        row["vs_hf_dynamic"] = ratio(row["tokens_per_s"], speed.get("hf-dynamic"))
        row["vs_hf_constant"] = ratio(row["tokens_per_s"], speed.get("hf-constant"))
    return rows


def notes(args, skipped: list[str]) -> list[str]:
    k = args.num_draft_tokens
    items = [
        "tok/s: output tokens / request wall time per run (requests one at a time), median over runs; TTFT: "
        "request start to first token (HTTP: first streamed text, client-side); TPOT: (wall − TTFT) / "
        "(tokens − 1), median over requests.",
        "× target-only: vs the target-only row of the same transport (in-process rows vs the in-process "
        "target-only, HTTP rows vs the HTTP target-only app). × HF: vs the in-process HF assisted rows.",
        "target-only over HTTP: a second Serve application (speculation.proposer \"none\") running beside the "
        "specserve app in the same Ray cluster; single-stream requests to the two alternate prompt by prompt.",
        f"HTTP rows: speculation depth {'adaptive (the config policy)' if args.adaptive else f'pinned at K={k}'}; "
        "one target and one draft engine (1 torch thread each, per the config).",
        "HF assisted, default: transformers' own assistant defaults (up to 20 draft tokens, drafting stops when "
        "the draft's confidence falls below 0.4; " + ("scikit-learn present: HF tunes that threshold per request"
                                                        if importlib.util.find_spec("sklearn") else
                                                        "scikit-learn absent: the threshold stays at 0.4")
        + f"). Constant K: num_assistant_tokens={k}, schedule \"constant\", confidence threshold off. Both share "
        "the in-process models (same weights, dtype, threads).",
        "accept: accepted / drafted. α: per-token acceptance of the geometric model fitted to the measured tokens "
        "per verifying round at the mean depth K (accepted / drafted understates it: after a rejection the "
        "rest of the block can never be accepted). tok/pass: output tokens / target forwards (prefill included).",
        "overhead ms/round: median over requests of the per-request median of (round wall time − model "
        "compute). In-process: compute timed by forward hooks on both models; HTTP: the router's "
        "median_overhead_ms (round wall − engine-reported draft and target compute), i.e. RPC, serialization "
        "and sampling. The first pass (prefill) is excluded.",
        "bound: E·t(1)/t(K+1) with E from α at the row's mean depth (drafting fully overlapped); serial est.: "
        "E·t(1)/(K·t_draft + t(K+1)) (draft then verify, zero overhead). t(n) measured on a warm cache.",
        "sweep: requests cycle through the prompt set, at least 2 per stream, capped; sampled requests seeded.",
    ]
    return items + skipped


def build_context_ids(prompt_ids: dict) -> list[int]:
    from specserve.bench.inprocess import step_context

    return step_context(list(prompt_ids.values()))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from specserve.bench.http_rows import ray_available
    from specserve.bench.inprocess import STEP_CONTEXT_TOKENS, load_pair, measure_steps
    from specserve.bench.report import render_markdown, write_outputs
    from specserve.common.config import load_config

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device is visible to torch here")
    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    if config.draft is None:
        raise SystemExit("the benchmark needs a draft model: set draft.path in the config")
    for spec in (config.target, config.draft):
        if not Path(spec.path).is_dir():
            raise SystemExit(f"model directory {spec.path} does not exist; train the default pair "
                             "(`specserve train-default`) or pass --config pointing at a pair")
    prompt_set = load_prompt_set(args.prompts)
    prompts = select_prompts(prompt_set.prompts, args.num_prompts)
    tokenizer = AutoTokenizer.from_pretrained(config.resolved_tokenizer_path, local_files_only=True)
    # The ingress encodes prompts exactly like this, so in-process and HTTP rows see the same ids.
    prompt_ids = {p.prompt_id: tokenizer.encode(p.text, add_special_tokens=False) for p in prompts}
    name = args.name or datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + f"-{args.device.replace(':', '')}"
    machine = machine_info(args.device)
    records: dict[tuple[str, str], list[RequestRecord]] = {}
    sweeps: dict[str, dict] = {}
    skipped: list[str] = []

    log(f"loading {config.target.path} and {config.draft.path} on {args.device} ({args.dtype})")
    pair = load_pair(config.target.path, config.draft.path, args.device, args.dtype)
    context_ids = build_context_ids(prompt_ids)
    steps = measure_steps(pair, context_ids, [args.num_draft_tokens + 1])
    log(f"step latency: target {steps.target_s}, draft {steps.draft_s:.4f} s")
    run_in_process(args, pair, prompts, prompt_ids, records)

    wants_http = any(key in args.rows for key in HTTP_ROWS + ["sweep"])
    if wants_http and not args.device.startswith("cpu"):
        skipped.append(f"HTTP rows skipped: --device {args.device} (the Serve path is measured on CPU; the GPU "
                       "box has no Ray).")
    elif wants_http and not ray_available():
        skipped.append("HTTP rows skipped: Ray is not installed here.")
    elif wants_http:
        run_http(args, config, prompts, records, sweeps)

    # t(K+1) for every depth a row ended up using (HF's dynamic schedule, adaptive HTTP depth).
    needed = {step_size_for(sum(r.num_drafted for r in rs) / max(1, sum(r.rounds for r in rs)))
              for rs in records.values()}
    missing = sorted(n for n in needed if n not in steps.target_s)
    if missing:
        extra = measure_steps(pair, context_ids, missing)
        steps = StepLatency(target_s={**steps.target_s, **extra.target_s}, draft_s=steps.draft_s)
    machine["loadavg_end"] = _loadavg()

    result = {
        "name": name,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "prompt_set": {**prompt_set.describe(), "num_prompts": len(prompts),
                       "num_code": sum(p.kind == "code" for p in prompts),
                       "num_prose": sum(p.kind != "code" for p in prompts),
                       "prompt_ids": [p.prompt_id for p in prompts],
                       "prompt_tokens": {pid: len(ids) for pid, ids in prompt_ids.items()}},
        "settings": {"device": args.device, "dtype": args.dtype, "modes": args.modes, "max_tokens": args.max_tokens,
                     "runs": args.runs, "num_draft_tokens": args.num_draft_tokens, "adaptive": args.adaptive,
                     "threads": args.threads, "rows": args.rows, "concurrency": args.concurrency,
                     "sweep_max_requests": args.sweep_max_requests, "config": args.config,
                     "target_path": config.target.path, "draft_path": config.draft.path,
                     "draft_token_map": config.draft_token_map},
        "machine": machine,
        "step_latency": {"context_tokens": STEP_CONTEXT_TOKENS,
                         "target_ms": {str(n): 1000 * s for n, s in sorted(steps.target_s.items())},
                         "draft_ms": 1000 * steps.draft_s, "draft_cost_ratio": steps.draft_cost_ratio},
        "modes": {mode: {"rows": summarize_mode(mode, args, records, steps), "sweep": sweeps.get(mode, {})}
                  for mode in args.modes},
        "notes": notes(args, skipped),
    }
    paths = write_outputs(result, Path(args.out))
    print(render_markdown(result))
    log("wrote " + ", ".join(str(p) for p in paths))
    return result


if __name__ == "__main__":
    main()
