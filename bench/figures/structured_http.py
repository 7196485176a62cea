"""Structured outputs over HTTP: many sampled JSON-schema requests against the served default pair,
every output checked against its schema.

The in-process benchmark (bench.figures.structured_outputs) measures speed and grammar cost on the round
path; this one checks the served path end to end as a client sees it: the `openai` client, vLLM's
`structured_outputs` (compact JSON, `disable_any_whitespace`) and OpenAI's `response_format`
`json_schema` in turn, sampled at temperature 1 with speculation on, `streams` requests at a time.

    python -m specserve.bench.figures.structured_http --requests 1000 --out bench/results/cpu-2core-structured-http.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
from openai import OpenAI

from specserve.bench.figures.structured_outputs import PROMPTS, SCHEMAS
from specserve.common.config import SpecServeConfig

MAX_TOKENS = 96
PORT = 8767


FORMS = {
    "structured_outputs json, disable_any_whitespace":
        lambda name, schema: {"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
    "response_format json_schema, schema with x-guidance whitespace_flexible false":
        lambda name, schema: {"response_format": {"type": "json_schema", "json_schema": {
            "name": name, "schema": {**schema, "x-guidance": {"whitespace_flexible": False}}, "strict": True}}},
    "response_format json_schema, free whitespace (vLLM's default)":
        lambda name, schema: {"response_format": {"type": "json_schema", "json_schema": {
            "name": name, "schema": {**schema, "x-guidance": {"whitespace_flexible": True}}, "strict": True}}},
}
COMPACT_FORMS = list(FORMS)[:2]
FLEXIBLE_FORM = list(FORMS)[2]


def request_body(index: int, form: str) -> tuple[dict, dict]:
    """(extra body, schema) of request index in an API form: the schemas and prompts in turn."""
    name = list(SCHEMAS)[index % len(SCHEMAS)]
    return FORMS[form](name, SCHEMAS[name]), SCHEMAS[name]


def run(client: OpenAI, model: str, index: int, form: str) -> dict:
    extra, schema = request_body(index, form)
    started = time.perf_counter()
    response = client.completions.create(model=model, prompt=PROMPTS[index // 2 % len(PROMPTS)], max_tokens=MAX_TOKENS,
                                         temperature=1.0, seed=index, extra_body=extra)
    choice = response.choices[0]
    try:
        jsonschema.validate(json.loads(choice.text), schema)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    speculation = response.model_extra["speculation"]
    return {"form": form, "valid": valid, "finish_reason": choice.finish_reason, "text": choice.text,
            "tokens": response.usage.completion_tokens, "wall_s": time.perf_counter() - started,
            "drafted": speculation["num_drafted"], "accepted": speculation["num_accepted"],
            "emitted": speculation["num_emitted"], "passes": speculation["target_passes"]}


def summary(results: list[dict], seconds: float | None = None, streams: int = 4) -> list[str]:
    valid = sum(r["valid"] for r in results)
    stopped = sum(r["finish_reason"] == "stop" for r in results)
    tokens = sum(r["tokens"] for r in results)
    lines = [f"- valid against their schema: **{valid}/{len(results)}** ({stopped} ended with EOS, the rest at "
             f"max_tokens); acceptance {sum(r['accepted'] for r in results) / max(1, sum(r['drafted'] for r in results)):.3f}, "
             f"tokens per target pass {sum(r['emitted'] for r in results) / max(1, sum(r['passes'] for r in results)):.2f}, "
             f"median request {statistics.median(r['wall_s'] for r in results):.2f} s"
             + ("" if seconds is None else f"; {tokens} tokens in {seconds:.0f} s ({tokens / seconds:.1f} tok/s at "
                                          f"{streams} streams)")]
    return lines + [f"- invalid ({r['finish_reason']}): {r['text'][:80]!r}" for r in results if not r["valid"]][:3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="compact-JSON requests (the two compact forms in turn)")
    parser.add_argument("--flexible", type=int, default=100, help="requests with free whitespace (vLLM's default)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from specserve.cluster.local import start_local, stop_local

    config = SpecServeConfig.model_validate({"http": {"port": PORT}})
    url = start_local(config)
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        run(client, config.model_name, 0, COMPACT_FORMS[0])  # warm-up
        jobs = [(index, COMPACT_FORMS[index % 2]) for index in range(args.requests)]
        started = time.perf_counter()
        with ThreadPoolExecutor(args.streams) as pool:
            compact = list(pool.map(lambda job: run(client, config.model_name, *job), jobs))
            seconds = time.perf_counter() - started
            flexible = list(pool.map(lambda index: run(client, config.model_name, index, FLEXIBLE_FORM),
                                     range(args.flexible)))
    finally:
        stop_local()
    lines = [
        "# Structured outputs over HTTP (default pair, sampled, speculation on)", "",
        f"`python -m specserve.bench.figures.structured_http --requests {args.requests} --flexible {args.flexible} --streams "
        f"{args.streams}`: the `openai` client against `specserve serve`'s default config, temperature 1, max_tokens "
        f"{MAX_TOKENS}, {len(PROMPTS)} prompts x {len(SCHEMAS)} JSON schemas (bench/figures/structured_outputs.py), "
        f"{args.streams} requests at a time; 1-minute load average {os.getloadavg()[0]:.1f} on 2 cores when it ended.", "",
        f"Compact JSON ({' / '.join(COMPACT_FORMS)}, in turn):", "", *summary(compact, seconds, args.streams), ""]
    for form in COMPACT_FORMS:
        lines += [f"{form}:", "", *summary([r for r in compact if r["form"] == form]), ""]
    lines += [f"{FLEXIBLE_FORM}:", "", *summary(flexible), ""]
    report = "\n".join(lines)
    print(report)
    if args.out is not None:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
