"""Prefix caching's effect on time to first token: 16 requests sharing a long system prompt, each
with its own question, through the target engine in process (scheduler, chunked prefill, paged
cache; no Ray, no HTTP), with prefix caching on and off in one run.

    python -m specserve.bench.figures.prefix_cache [--system-tokens 3000] [--context 4096] [--requests 16] [--eagle3] [--out FILE.md]

The model is a look-alike of the shipped target (its architecture and tokenizer, random weights,
max_position_embeddings = --context): time to first token depends on the shapes, not the weights.
Three patterns per setting, each on a fresh engine: one request at a time (each alone on the
engine: the first prefill is cold, the others find the system prompt cached) and all at once (a
burst the engine batches and chunks; its makespan gives the prompt throughput), and a replayed
10-turn chat (each turn resends the conversation). TTFT here is the prefill verify's time in the engine, from submit to answer.
--eagle3: the target serves an EAGLE-3 head (aux_layers: the default layers), so each prefill
also answers every prompt position's features, those of the cached positions read from the pool.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specserve.common.config import SpecServeConfig
from specserve.decoding.eagle3_checkpoint import default_aux_layers
from specserve.decoding.sampling import SamplingParams
from specserve.deployments.committed_history import whole_history as whole
from specserve.deployments.target_worker import TargetEngine

DEFAULT_TARGET = Path(__file__).resolve().parents[2] / "models" / "default" / "target"
DOCS = Path(__file__).resolve().parents[2] / "docs"
GREEDY = SamplingParams(temperature=0, max_tokens=1)
CHAT_TURNS = 10
CHAT_ANSWER_TOKENS = 64   # each turn's answer, taken from docs text (its KV computed as decoding would)


def look_alike(directory: Path, context: int) -> Path:
    """The shipped target's architecture and tokenizer with random weights and a longer context."""
    config = AutoConfig.from_pretrained(DEFAULT_TARGET, local_files_only=True)
    config.max_position_embeddings = context
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_TARGET / name, directory / name)
    return directory


def prompts(tokenizer_dir: Path, system_tokens: int, num_requests: int
            ) -> tuple[list[int], list[list[int]], list[int]]:
    """A system prompt of system_tokens tokens (the project's docs, as text), num_requests
    distinct questions after it, and more docs text for a chat's answers."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    text = "\n".join(path.read_text() for path in sorted(DOCS.glob("*.md")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < system_tokens + CHAT_TURNS * CHAT_ANSWER_TOKENS:
        raise ValueError(f"docs/ hold {len(ids)} tokens, too few for --system-tokens {system_tokens}")
    questions = [tokenizer.encode(f"\nQuestion {i}: what does section {i} say about the KV cache of "
                                  f"engine {i * 7 % 13}?\nAnswer:", add_special_tokens=False)
                 for i in range(num_requests)]
    return ids[:system_tokens], questions, ids[system_tokens:]


Engines = dict[str, TargetEngine]   # "off" / "on"
Sample = tuple[float, float, int]   # (TTFT wall seconds, CPU seconds of this thread, cached tokens)


async def timed_prefill(engine: TargetEngine, seq_id: str, history: list[int]) -> Sample:
    """A lone call runs in the calling thread (deployments.engine_loop), so this thread's CPU time
    is the forward's: a figure the box's other load does not inflate the way it does wall time."""
    wall, cpu = time.perf_counter(), time.thread_time()
    _, span = await engine.verify(seq_id, whole(history), None, GREEDY)
    return time.perf_counter() - wall, time.thread_time() - cpu, span.cached_tokens


async def one_at_a_time(engines: Engines, histories: list[list[int]]) -> dict[str, list[Sample]]:
    """Each request alone on each engine, the engines taking turns request by request."""
    results: dict[str, list[Sample]] = {name: [] for name in engines}
    for i, history in enumerate(histories):
        for name, engine in engines.items():
            results[name].append(await timed_prefill(engine, f"alone-{i}", history))
            await engine.release(f"alone-{i}")
    return results


async def burst(engine: TargetEngine, histories: list[list[int]]) -> tuple[list[Sample], float]:
    """Every request at once: (TTFT, -, cached tokens) of each, and the makespan (wall seconds)."""
    started = time.perf_counter()

    async def request(i: int, history: list[int]) -> Sample:
        _, span = await engine.verify(f"burst-{i}", whole(history), None, GREEDY)
        return time.perf_counter() - started, float("nan"), span.cached_tokens

    results = await asyncio.gather(*(request(i, history) for i, history in enumerate(histories)))
    makespan = time.perf_counter() - started
    for i in range(len(histories)):
        await engine.release(f"burst-{i}")
    return list(results), makespan


async def chat(engines: Engines, questions: list[list[int]], answers: list[int]) -> dict[str, list[Sample]]:
    """A replayed chat, the engines taking turns: turn t sends the whole conversation so far plus
    its question, then its answer is computed into the KV (as decoding it would) and the turn ends."""
    results: dict[str, list[Sample]] = {name: [] for name in engines}
    conversation: list[int] = []
    for turn in range(CHAT_TURNS):
        conversation = conversation + questions[turn]
        answered = conversation + answers[turn * CHAT_ANSWER_TOKENS:(turn + 1) * CHAT_ANSWER_TOKENS]
        for name, engine in engines.items():
            results[name].append(await timed_prefill(engine, f"chat-{turn}", conversation))
            await engine.verify(f"chat-{turn}", whole(answered), None, GREEDY)
            await engine.release(f"chat-{turn}")
        conversation = answered
    return results


def summary(results: list[Sample]) -> dict:
    walls, cpus = sorted(wall for wall, _, _ in results), [cpu for _, cpu, _ in results]
    return {"ttft_p50_s": statistics.median(walls), "ttft_max_s": walls[-1],
            "ttft_cpu_p50_s": statistics.median(cpus), "first_request_ttft_s": results[0][0],
            "cached_tokens_mean": statistics.mean(cached for _, _, cached in results)}


def run(model_dir: Path, histories: list[list[int]], questions: list[list[int]], answers: list[int],
        aux_layers: list[int] | None = None) -> dict[str, dict]:
    """Every pattern with prefix caching off and on, each pattern on fresh engines (aux_layers: a
    target serving an EAGLE-3 head)."""
    # A prefill chunked over many iterations counts against the admission deadline (engine_loop):
    # lift it, so a slow box measures slow prefills instead of failing them.
    options = SpecServeConfig().engine_options() | {"policy_actor": None, "admission_timeout_s": 3600.0}

    async def fresh_engines() -> Engines:
        """Engines whose caches hold nothing of the prompts (one short warm-up request each)."""
        engines = {}
        for name, prefix_caching in (("off", False), ("on", True)):
            spec = {"path": str(model_dir), "dtype": "float32", "device": "cpu", "torch_threads": 1,
                    "max_sequences": 64, "prefix_caching": prefix_caching, "aux_layers": aux_layers or ()}
            engines[name] = engine = TargetEngine(spec, options)
            await engine.verify("warmup", whole([1] * 64), None, GREEDY)
            await engine.release("warmup")
        return engines

    async def scenario() -> dict[str, dict]:
        alone = await one_at_a_time(await fresh_engines(), histories)
        turns = await chat(await fresh_engines(), questions, answers)
        record: dict[str, dict] = {}
        for name, engine in (await fresh_engines()).items():
            together, makespan = await burst(engine, histories)
            prompt_tokens = sum(map(len, histories))
            record[name] = {
                "one_at_a_time": summary(alone[name]),
                "burst": {**summary(together), "makespan_s": makespan, "requests_per_s": len(histories) / makespan,
                          "prompt_tokens_per_s": prompt_tokens / makespan},
                "chat_turns": [{"ttft_s": wall, "ttft_cpu_s": cpu, "cached_tokens": cached}
                               for wall, cpu, cached in turns[name]]}
        return record

    return asyncio.run(scenario())


def markdown(record: dict) -> str:
    on, off = record["on"], record["off"]
    one, burst_off, burst_on = (off["one_at_a_time"], on["one_at_a_time"]), off["burst"], on["burst"]
    head = (f", the target serving an EAGLE-3 head (aux layers {record['aux_layers']}: every prefill also "
            "answers its prompt's features)") if record.get("aux_layers") else ""
    lines = [f"# Prefix caching: {record['requests']} requests sharing a {record['system_tokens']}-token system "
             f"prompt{head}", "",
             f"`{record['command']}`: target engine in process, look-alike of the shipped target "
             f"(random weights, context {record['context']}), fp32, 1 thread, prefill_token_budget "
             f"{record['prefill_token_budget']}; load average at start {record['load_at_start']}. Off and on "
             "take turns request by request (one at a time, chat); CPU s is the forward's thread time.", "",
             "| arrivals | TTFT p50 off, s (CPU s) | TTFT p50 on, s (CPU s) | on / off | first request on, s "
             "| mean cached tokens on |", "|---|---|---|---|---|---|",
             f"| one at a time | {one[0]['ttft_p50_s']:.3f} ({one[0]['ttft_cpu_p50_s']:.3f}) "
             f"| {one[1]['ttft_p50_s']:.3f} ({one[1]['ttft_cpu_p50_s']:.3f}) "
             f"| {one[1]['ttft_p50_s'] / one[0]['ttft_p50_s']:.3f} | {one[1]['first_request_ttft_s']:.3f} "
             f"| {one[1]['cached_tokens_mean']:.0f} |",
             f"| burst | {burst_off['ttft_p50_s']:.3f} | {burst_on['ttft_p50_s']:.3f} "
             f"| {burst_on['ttft_p50_s'] / burst_off['ttft_p50_s']:.3f} | {burst_on['first_request_ttft_s']:.3f} "
             f"| {burst_on['cached_tokens_mean']:.0f} |",
             "", f"Burst throughput: {burst_off['requests_per_s']:.2f} requests/s "
             f"({burst_off['prompt_tokens_per_s']:.0f} prompt tokens/s) off, {burst_on['requests_per_s']:.2f} "
             f"requests/s ({burst_on['prompt_tokens_per_s']:.0f}) on.",
             "", f"A replayed chat of {CHAT_TURNS} turns (question, then a {CHAT_ANSWER_TOKENS}-token answer each; "
             "no system prompt): TTFT per turn.", "",
             "| turn | prompt tokens | TTFT off, s (CPU s) | TTFT on, s (CPU s) | cached tokens on |",
             "|---|---|---|---|---|"]
    for turn, (a, b) in enumerate(zip(off["chat_turns"], on["chat_turns"]), start=1):
        lines.append(f"| {turn} | {record['chat_prompt_tokens'][turn - 1]} | {a['ttft_s']:.3f} ({a['ttft_cpu_s']:.3f}) "
                     f"| {b['ttft_s']:.3f} ({b['ttft_cpu_s']:.3f}) | {b['cached_tokens']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-tokens", type=int, default=3000)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--eagle3", action="store_true", help="the target serves an EAGLE-3 head (its default layers)")
    parser.add_argument("--out", default=None, help="write the markdown table here (and the JSON beside it)")
    args = parser.parse_args()
    load_at_start = [round(x, 1) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = look_alike(Path(tmp), args.context)
        system, questions, answers = prompts(model_dir, args.system_tokens, max(args.requests, CHAT_TURNS))
        histories = [system + question for question in questions[:args.requests]]
        record = {"command": "python -m specserve.bench.figures.prefix_cache " + " ".join(
                      f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                      if k not in ("out", "eagle3") and v is not None) + (" --eagle3" if args.eagle3 else ""),
                  "requests": args.requests, "system_tokens": args.system_tokens, "context": args.context,
                  "prefill_token_budget": SpecServeConfig().batching.prefill_token_budget,
                  "load_at_start": load_at_start,
                  "chat_prompt_tokens": [sum(len(q) for q in questions[:turn + 1]) + turn * CHAT_ANSWER_TOKENS
                                         for turn in range(CHAT_TURNS)]}
        if args.eagle3:
            record["aux_layers"] = list(default_aux_layers(AutoConfig.from_pretrained(model_dir).num_hidden_layers))
        record.update(run(model_dir, histories, questions, answers, record.get("aux_layers")))
    text = markdown(record)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
