"""`specserve bench-adapt`: the draft learns a domain its target was fine-tuned on
(docs/online-learning.md).

The scenario users live in: the target was fine-tuned on their domain, the draft was not.

1. Fine-tune the shipped target on a domain it never saw (default: the C headers under
   /usr/include, which every Debian-like box has offline), files split three ways by a hash of
   their path: fine-tuning, traffic, held-out.
2. Before: serve the fine-tuned target with the shipped draft (online training off) and measure
   acceptance, tokens per target pass and single-stream greedy tok/s on held-out prompts.
3. Serve it with online training on: traffic prompts in chunks (greedy and sampled, 4 streams);
   after each chunk the cluster is idle, the trainer runs a pass, canaries and swaps.
4. After: serve the fine-tuned target with the last accepted draft version (training off) and
   measure the held-out prompts again; greedy texts must equal the "before" texts.
5. The curve: each version's greedy agreement with the target on the held-out continuations,
   against the captured positions it was trained on.

Results (JSON and a short Markdown table) go to <--out>/<name>.* (bench-out/ unless told). Wrap it in a
`flock` on a shared box, so two benchmarks do not time each other.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from specserve.bench import DEFAULT_OUT_DIR
from specserve.common.config import DEFAULT_MODELS_DIR, SpecServeConfig

MODEL = "adapt"


def split_files(root: Path, pattern: str, min_bytes: int = 2_000, max_bytes: int = 64_000) -> dict[str, list[str]]:
    """Texts of root's files by role, by sha256 of the relative path: 1 in 10 held out, 1 in 10 traffic."""
    roles: dict[str, list[str]] = {"finetune": [], "traffic": [], "held_out": []}
    for path in sorted(root.glob(pattern)):
        if not path.is_file() or not min_bytes <= path.stat().st_size <= max_bytes:
            continue
        text = path.read_text(errors="ignore")
        bucket = hashlib.sha256(str(path.relative_to(root)).encode()).digest()[0] % 10
        roles["held_out" if bucket == 0 else "traffic" if bucket == 1 else "finetune"].append(text)
    return roles


def fine_tune_target(source: Path, out: Path, texts: list[str], steps: int, lr: float, seed: int) -> dict[str, Any]:
    """AdamW on 8 x 256-token windows of texts; the target folder goes to out (reused if there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.training.default_pair import encode_files, sample_batch
    from specserve.training.online_trainer import save_draft_version

    if (out / "config.json").exists():
        return json.loads((out / "finetune.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(source)
    stream = encode_files(tokenizer, texts)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    started, losses = time.perf_counter(), []
    for _ in range(steps):
        batch = sample_batch(stream, 8, 256, generator)
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    save_draft_version(model.eval(), source, out)
    record = {"steps": steps, "lr": lr, "tokens": len(stream), "seconds": time.perf_counter() - started,
              "loss_first": losses[0], "loss_last": statistics.fmean(losses[-10:])}
    (out / "finetune.json").write_text(json.dumps(record))
    return record


def prompt_windows(tokenizer, texts: list[str], count: int, tokens: int, seed: int) -> list[list[int]]:
    """count prompts of `tokens` ids, each from a different file at a seeded offset."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < tokens + 64:
            continue
        start = int(torch.randint(0, len(ids) - tokens - 64, (1,), generator=generator))
        prompts.append(ids[start : start + tokens])
        if len(prompts) == count:
            break
    return prompts


def complete(url: str, prompt: list[int], max_tokens: int, temperature: float, seed: int | None = None) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed}
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    return {**response.json(), "wall_s": time.perf_counter() - started}


def measure(url: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Single-stream greedy over prompts (after one warm-up): acceptance, tokens per target pass, tok/s."""
    complete(url, prompts[0], 8, 0.0)
    answers = [complete(url, prompt, max_tokens, 0.0) for prompt in prompts]
    spec = [a["speculation"] for a in answers]
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    return {"acceptance": sum(s["num_accepted"] for s in spec) / max(1, sum(s["num_drafted"] for s in spec)),
            "tokens_per_pass": sum(s["num_emitted"] for s in spec) / max(1, sum(s["target_passes"] for s in spec)),
            "tokens_per_s": tokens / sum(a["wall_s"] for a in answers),
            "median_latency_s": statistics.median(a["wall_s"] for a in answers),
            "texts": [a["choices"][0]["text"] for a in answers]}


def serve_config(target: Path, draft: Path, port: int, training: dict[str, Any] | None) -> SpecServeConfig:
    return SpecServeConfig.model_validate({
        "model_name": MODEL, "target": {"path": str(target)}, "draft": {"path": str(draft)}, "http": {"port": port},
        "draft_training": training or {}})


def measured_server(config: SpecServeConfig, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from specserve.cluster.local import start_local, stop_local

    url = start_local(config)
    try:
        return measure(url, prompts, max_tokens)
    finally:
        stop_local()


def trainer_status() -> dict[str, Any]:
    import ray

    from specserve.common.naming import ENGINE_NAMESPACE, draft_trainer_name

    return ray.get(ray.get_actor(draft_trainer_name(MODEL), namespace=ENGINE_NAMESPACE).status.remote(), timeout=30)


def learning_run(config: SpecServeConfig, prompts: list[list[int]], chunks: int, max_tokens: int,
                 pass_timeout_s: float) -> dict[str, Any]:
    """Traffic in chunks (4 streams, half greedy, half sampled at 0.8); after each, wait for the
    trainer's next pass to end. -> per chunk: traffic latency, the pass, the trainer's status."""
    from specserve.cluster.local import start_local, stop_local

    url = start_local(config)
    phases = []
    try:
        size = len(prompts) // chunks
        for chunk in range(chunks):
            part = prompts[chunk * size : (chunk + 1) * size]
            started = time.perf_counter()
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda item: complete(url, item[1], max_tokens, 0.8 * (item[0] % 2), item[0]),
                                        enumerate(part, start=chunk * size)))
            traffic_s = time.perf_counter() - started
            passes_before = sum(trainer_status()["passes"].values())
            deadline, finished = time.monotonic() + pass_timeout_s, False
            while time.monotonic() < deadline and not finished:
                time.sleep(1.0)
                status = trainer_status()
                finished = sum(status["passes"].values()) > passes_before and not status["training_now"]
            phases.append({"requests": len(part), "traffic_s": traffic_s,
                           "traffic_median_latency_s": statistics.median(a["wall_s"] for a in answers),
                           "traffic_acceptance": sum(a["speculation"]["num_accepted"] for a in answers)
                           / max(1, sum(a["speculation"]["num_drafted"] for a in answers)),
                           "last_pass": status["last_pass"] if finished else None,
                           "draft_version": status["draft_version"],
                           "captured_total": status["captured_total"]})
        return {"phases": phases, "status": trainer_status()}
    finally:
        stop_local()


def training_cost_run(config: SpecServeConfig, prompts: list[list[int]], batch: int, max_tokens: int,
                      start_timeout_s: float) -> dict[str, Any]:
    """p50 latency of `batch` requests at 4 streams with no training, then of another `batch`
    sent while a training pass runs: what training costs serving. If the config lets training run
    under load, the pass overlaps the whole batch; by default (training only while idle) it must
    yield as the batch arrives. The first batch stays under min_new_positions."""
    from specserve.cluster.local import start_local, stop_local

    def run_batch(part: list[list[int]], offset: int) -> list[float]:
        with ThreadPoolExecutor(4) as pool:
            return [a["wall_s"] for a in pool.map(
                lambda item: complete(url, item[1], max_tokens, 0.8 * (item[0] % 2), item[0]),
                enumerate(part, start=offset))]

    url = start_local(config)
    try:
        quiet = run_batch(prompts[:batch], 0)
        quiet_status = trainer_status()
        offset, deadline = batch, time.monotonic() + start_timeout_s
        while not trainer_status()["training_now"] and time.monotonic() < deadline:
            run_batch(prompts[offset : offset + 4], offset)  # more captures until a pass starts
            offset += 4
            idle_until = time.monotonic() + 5.0  # idle, so a pass that waits for slack can start
            while not trainer_status()["training_now"] and time.monotonic() < idle_until:
                time.sleep(0.25)
        started_training = trainer_status()["training_now"]
        busy = run_batch(prompts[offset : offset + batch], offset)
        return {"quiet_p50_s": statistics.median(quiet), "training_p50_s": statistics.median(busy),
                "ratio": statistics.median(busy) / statistics.median(quiet),
                "quiet_training_passes": quiet_status["passes"], "training_at_start": started_training,
                "training_at_end": trainer_status()["training_now"], "passes_after": trainer_status()["passes"],
                "requests_per_batch": batch}
    finally:
        stop_local()


@torch.no_grad()
def greedy_agreement_curve(target_path: Path, versions: list[dict[str, Any]], prompts: list[list[int]],
                           max_tokens: int) -> list[dict[str, Any]]:
    """Per draft version: share of held-out positions where its argmax equals the target's greedy
    token (teacher-forced on the target's own greedy continuations)."""
    from specserve.training.online_trainer import load_draft_model

    target = load_draft_model(target_path)
    sequences = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
        sequences.append((len(prompt), out[0]))
    curve = []
    for version in versions:
        draft = load_draft_model(version["path"])
        agree = total = 0
        for prompt_len, sequence in sequences:
            guesses = draft(sequence[None, :-1]).logits[0, prompt_len - 1 :].argmax(-1)
            agree += int((guesses == sequence[prompt_len:]).sum())
            total += len(sequence) - prompt_len
        curve.append({"version": version["version"], "trained_positions": version["trained_positions"],
                      "rolled_back": version["rolled_back"], "greedy_agreement": agree / max(total, 1),
                      "expected_after": version["expected_after"]})
    return curve


def markdown(result: dict[str, Any]) -> str:
    before, after = result["before"], result["after"]
    lines = [f"# bench-adapt: {result['name']}", "", f"Command: `{result['command']}`", "",
             f"Domain: {result['domain']}; files fine-tune/traffic/held-out: {result['files']}. "
             f"Target fine-tuned {result['finetune']['steps']} steps (8 x 256 tokens, AdamW {result['finetune']['lr']}) "
             f"in {result['finetune']['seconds']:.0f} s.", "",
             "| held-out, single stream greedy | before (shipped draft) | after (learned draft) | change |",
             "|---|---|---|---|"]
    for key, label in (("acceptance", "acceptance"), ("tokens_per_pass", "tokens per target pass"),
                       ("tokens_per_s", "tok/s")):
        lines.append(f"| {label} | {before[key]:.3f} | {after[key]:.3f} | {after[key] / before[key] - 1:+.1%} |")
    lines += ["", f"Greedy texts before and after identical: {result['greedy_texts_identical']}.", "",
              "Alpha (greedy agreement with the fine-tuned target on held-out continuations) against captured "
              "positions trained on:", "", "| version | trained positions | greedy agreement | canary expected acceptance |",
              "|---|---|---|---|"]
    for point in result["curve"]:
        expected = "-" if point["expected_after"] is None else f"{point['expected_after']:.3f}"
        lines.append(f"| {point['version']}{' (rolled back)' if point['rolled_back'] else ''} | "
                     f"{point['trained_positions']} | {point['greedy_agreement']:.3f} | {expected} |")
    lines += ["", "Training passes (each after a traffic chunk, while the cluster was idle):", "",
              "| chunk | requests | traffic p50 latency s | traffic acceptance | pass outcome | pass s | steps |",
              "|---|---|---|---|---|---|---|"]
    for n, phase in enumerate(result["learning"]["phases"]):
        last = phase["last_pass"] or {"outcome": "not finished within --pass-timeout-s", "seconds": None}
        seconds = "-" if last["seconds"] is None else f"{last['seconds']:.1f}"
        lines.append(f"| {n + 1} | {phase['requests']} | {phase['traffic_median_latency_s']:.2f} | "
                     f"{phase['traffic_acceptance']:.3f} | {last['outcome']} | {seconds} | {last.get('steps', '-')} |")
    lines += ["", result.get("notes", ""), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specserve bench-adapt", description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-dir", default="/usr/include")
    parser.add_argument("--pattern", default="**/*.h")
    parser.add_argument("--work-dir", default=".bench-adapt")
    parser.add_argument("--finetune-steps", type=int, default=120)
    parser.add_argument("--finetune-lr", type=float, default=3e-4)
    parser.add_argument("--finetune-files", type=int, default=600, help="fine-tuning files used (of the split)")
    parser.add_argument("--traffic", type=int, default=150, help="traffic requests")
    parser.add_argument("--chunks", type=int, default=3, help="traffic chunks (a training pass after each)")
    parser.add_argument("--held-out", type=int, default=16, help="held-out prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4, help="distillation learning rate")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--min-new-positions", type=int, default=500, help="captured positions before a pass")
    parser.add_argument("--pass-timeout-s", type=float, default=300)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--name", default="adapt-c-headers")
    parser.add_argument("--out", default=DEFAULT_OUT_DIR, help="results folder (publish to bench/results/)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--training-cost-only", action="store_true",
                        help="only measure 4-stream p50 latency without and during a training pass")
    parser.add_argument("--allow-overlap", action="store_true",
                        help="with --training-cost-only: let training run under load (default: the served "
                             "default, training only while idle, so the burst meets a pass that must yield)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    roles = split_files(Path(args.corpus_dir), args.pattern)
    print({role: len(texts) for role, texts in roles.items()}, flush=True)
    shipped_target, shipped_draft = DEFAULT_MODELS_DIR / "target", DEFAULT_MODELS_DIR / "draft"
    target = work / "target-finetuned"
    finetune = fine_tune_target(shipped_target, target, roles["finetune"][: args.finetune_files],
                                args.finetune_steps, args.finetune_lr, args.seed)
    print("fine-tuned:", finetune, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(shipped_target)
    held_out = prompt_windows(tokenizer, roles["held_out"], args.held_out, args.prompt_tokens, args.seed)
    traffic = prompt_windows(tokenizer, roles["traffic"], args.traffic, args.prompt_tokens, args.seed + 1)
    if args.training_cost_only:
        settings = {"enabled": True, "sample_every": 1, "min_new_positions": 3000, "lr": args.lr, "epochs": args.epochs,
                    "batch_size": args.batch_size, "versions_dir": str(work / "versions-cost"), "num_cpus": 1.0}
        if args.allow_overlap:
            settings.update(slack_max_active_requests=None, slack_max_busy_share=1.0)
        else:
            settings.update(slack_max_active_requests=0)   # idle-only: every request stops the pass
        config = serve_config(target, shipped_draft, args.port, settings)
        cost = training_cost_run(config, traffic, 16, args.max_tokens, args.pass_timeout_s)
        print(json.dumps(cost))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}.json").write_text(json.dumps(
            {"command": "specserve bench-adapt " + " ".join(argv or []), **cost, "streams": 4,
             "slack_max_active_requests": config.draft_training.slack_max_active_requests,
             "slack_max_busy_share": config.draft_training.slack_max_busy_share,
             "issue_target_ratio": 1.1}, indent=1))
        return
    before = measured_server(serve_config(target, shipped_draft, args.port, None), held_out, args.max_tokens)
    print("before:", {k: v for k, v in before.items() if k != "texts"}, flush=True)
    training = {"enabled": True, "sample_every": 1, "min_new_positions": args.min_new_positions, "lr": args.lr, "epochs": args.epochs,
                "batch_size": args.batch_size, "versions_dir": str(work / "versions"), "num_cpus": 1.0}
    learning = learning_run(serve_config(target, shipped_draft, args.port, training), traffic, args.chunks,
                            args.max_tokens, args.pass_timeout_s)
    print("learning:", json.dumps(learning["phases"]), flush=True)
    versions = learning["status"]["versions"]
    final = next(v for v in reversed(versions) if not v["rolled_back"])
    after = measured_server(serve_config(target, Path(final["path"]), args.port, None), held_out, args.max_tokens)
    print("after:", {k: v for k, v in after.items() if k != "texts"}, flush=True)
    curve = greedy_agreement_curve(target, versions, held_out, args.max_tokens)
    result = {"name": args.name, "command": "specserve bench-adapt " + " ".join(argv or []),
              "domain": f"{args.corpus_dir}/{args.pattern}", "files": {r: len(t) for r, t in roles.items()},
              "finetune": finetune, "before": before, "after": after, "final_version": final["version"],
              "greedy_texts_identical": before["texts"] == after["texts"], "learning": learning, "curve": curve}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(
        {**result, "before": {k: v for k, v in before.items() if k != "texts"},
         "after": {k: v for k, v in after.items() if k != "texts"}}, indent=1, default=str))
    (out / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
