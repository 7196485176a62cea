"""Structured outputs under speculation on the default pair, in process (decoding.generate):
speed and acceptance with and without a JSON schema, the draft masked or not, the grammar's cost
per round, and the validity of many sampled outputs.

    python -m specserve.bench.figures.structured_outputs [--validity 1000] \
        [--out bench/results/cpu-2core-structured-outputs.md]

Speed: one stream at a time, K = 4, one torch thread; for every (prompt, schema) pair, greedy
and sampled, the five variants run in turn (so a load change on the box hits them alike):
target-only and speculative without a grammar, then target-only, speculative with the draft
masked (how specserve serves it) and speculative with the draft unmasked (DraftModelProposer
without grammars: the debug knob) under the schema. Grammar cost: seconds spent syncing matchers,
computing masks and masking rows (draft and target side), per target pass.

Validity: `--validity N` sampled schema requests (temperature 1, the draft masked), decoded in
batches of 100 over paged runners (decoding.generate.generate_batch), each output checked with
`jsonschema` against its schema.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import jsonschema
import torch
from transformers import AutoTokenizer

from specserve.common.config import DEFAULT_MODELS_DIR
from specserve.decoding import grammar as grammar_module
from specserve.decoding import row_processors
from specserve.decoding.batched_runner import BatchedModelRunner
from specserve.decoding.scheduler import Scheduler
from specserve.decoding.generate import generate, generate_batch
from specserve.decoding.grammar import GrammarCompiler, GrammarMatchers, GrammarSpec
from specserve.decoding.proposers import DraftModelProposer
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.sequence import RequestState

NUM_DRAFT_TOKENS = 4
MAX_TOKENS = 96
VALIDITY_BATCH = 100
PROMPTS = ["config = json.loads('", "def to_dict(self):\n    return ", "payload = ", "# user record\nuser = "]
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                                "admin": {"type": "boolean"}},
               "required": ["name", "age", "admin"], "additionalProperties": False},
    "server": {"type": "object", "properties": {"host": {"type": "string", "maxLength": 24},
                                                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                                "mode": {"enum": ["debug", "release", "test"]},
                                                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                         "maxItems": 3}},
               "required": ["host", "port", "mode", "tags"], "additionalProperties": False},
}
VARIANTS = ["target-only", "speculative", "target-only + schema", "speculative + schema (draft masked)",
            "speculative + schema (draft unmasked)"]


class GrammarClock:
    """Seconds spent in grammar work: matcher syncs and the mask processor's calls (both sides)."""

    def __init__(self) -> None:
        self.total_s = 0.0

    @contextmanager
    def installed(self):
        patched = [(grammar_module.GrammarMatchers, "synced"), (row_processors.GrammarMask, "process"),
                   (row_processors.GrammarMask, "advance")]
        originals = [(owner, name, getattr(owner, name)) for owner, name in patched]
        for owner, name, original in originals:
            setattr(owner, name, self._timed(original))
        try:
            yield self
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)

    def _timed(self, method):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.total_s += time.perf_counter() - started
        return timed


def run_one(variant: str, target: Scheduler, draft: Scheduler, compiler: GrammarCompiler, prompt: list[int],
            params: SamplingParams, spec: GrammarSpec, eos, clock: GrammarClock, request_id: str) -> dict:
    constrained = "schema" in variant
    params = params.model_copy(update={"structured": spec if constrained else None})
    proposer = None
    if variant.startswith("speculative"):
        proposer = DraftModelProposer(draft, None if "unmasked" in variant else GrammarMatchers(compiler))
    state = RequestState(request_id, prompt, params, eos, target.max_context)
    before = clock.total_s
    started = time.perf_counter()
    for _ in generate(target, state, proposer, NUM_DRAFT_TOKENS, grammars=GrammarMatchers(compiler)):
        pass
    seconds = time.perf_counter() - started
    return {"tokens": len(state.output_ids), "seconds": seconds, "drafted": state.stats.num_drafted,
            "accepted": state.stats.num_accepted, "passes": state.stats.target_passes,
            "grammar_s": clock.total_s - before, "finish": state.finish_reason, "output": state.output_ids}


def speed(target, draft, compiler, tokenizer, eos, clock) -> list[str]:
    results: dict[tuple[str, str], list[dict]] = defaultdict(list)
    specs = {name: GrammarSpec.json_schema(schema, "response_format", whitespace_flexible=False)
             for name, schema in SCHEMAS.items()}
    count = 0
    for mode, params in (("greedy", SamplingParams(temperature=0, max_tokens=MAX_TOKENS)),
                         ("sampled", SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS))):
        for prompt_text in PROMPTS:
            prompt = tokenizer.encode(prompt_text)
            for name, spec in specs.items():
                for variant in VARIANTS:
                    count += 1
                    seeded = params.model_copy(update={"seed": count}) if mode == "sampled" else params
                    results[(mode, variant)].append(run_one(variant, target, draft, compiler, prompt, seeded, spec,
                                                            eos, clock, f"r{count}"))
    lines = ["| mode | variant | tok/s | x target-only (same constraint) | acceptance | tokens per target pass | "
             "grammar ms per pass | outputs ending in EOS |", "|---|---|---|---|---|---|---|---|"]

    def tok_s(runs: list[dict]) -> float:
        return sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)

    for (mode, variant), runs in results.items():
        baseline = tok_s(results[(mode, "target-only + schema" if "schema" in variant else "target-only")])
        tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
        drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
        passes, grammar_s = sum(r["passes"] for r in runs), sum(r["grammar_s"] for r in runs)
        acceptance = f"{accepted / drafted:.3f}" if drafted else "-"
        grammar = f"{1e3 * grammar_s / passes:.2f}" if "schema" in variant else "-"
        stops = sum(r["finish"] == "stop" for r in runs)
        lines.append(f"| {mode} | {variant} | {tokens / seconds:.1f} | {tokens / seconds / baseline:.2f} | "
                     f"{acceptance} | {tokens / passes:.2f} | "
                     f"{grammar} | {stops}/{len(runs)} |")
    greedy_equal = all(a["output"] == b["output"] for a, b in zip(results[("greedy", "target-only + schema")],
                                                                   results[("greedy", "speculative + schema (draft masked)")]))
    return lines + ["", f"Greedy speculative output under the schema equals target-only: {greedy_equal}."]


def validity(num_requests: int, tokenizer, eos) -> list[str]:
    target = Scheduler(BatchedModelRunner(str(DEFAULT_MODELS_DIR / "target"), max_sequences=VALIDITY_BATCH))
    draft = Scheduler(BatchedModelRunner(str(DEFAULT_MODELS_DIR / "draft"), max_sequences=VALIDITY_BATCH))
    compiler = GrammarCompiler(tokenizer, target.vocab_size, sorted(eos))
    names = list(SCHEMAS)
    valid, finished, tokens, started = 0, 0, 0, time.perf_counter()
    failures: list[str] = []
    for first in range(0, num_requests, VALIDITY_BATCH):
        states = []
        for i in range(first, min(num_requests, first + VALIDITY_BATCH)):
            spec = GrammarSpec.json_schema(SCHEMAS[names[i % len(names)]], "response_format", whitespace_flexible=False)
            params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=i, structured=spec)
            states.append(RequestState(f"v{i}", tokenizer.encode(PROMPTS[i % len(PROMPTS)]), params, eos,
                                       target.max_context))
        generate_batch(target, states, DraftModelProposer(draft, GrammarMatchers(compiler)), NUM_DRAFT_TOKENS,
                       grammars=GrammarMatchers(compiler))
        for i, state in enumerate(states, start=first):
            tokens += len(state.output_ids)
            finished += state.finish_reason == "stop"
            text = tokenizer.decode(state.output_ids)
            try:
                jsonschema.validate(json.loads(text), SCHEMAS[names[i % len(names)]])
                valid += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                failures.append(f"{state.finish_reason}: {text!r} ({type(exc).__name__})")
    seconds = time.perf_counter() - started
    lines = [f"{valid}/{num_requests} sampled schema outputs valid ({finished} ended with EOS, the rest at "
             f"max_tokens={MAX_TOKENS}); {tokens} tokens in {seconds:.0f} s, batches of {VALIDITY_BATCH}."]
    return lines + [f"- invalid: {failure}" for failure in failures[:5]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--validity", type=int, default=1000, help="sampled requests checked for validity (0: skip)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODELS_DIR / "tokenizer")
    target = Scheduler(BatchedModelRunner(str(DEFAULT_MODELS_DIR / "target")))
    draft = Scheduler(BatchedModelRunner(str(DEFAULT_MODELS_DIR / "draft")))
    eos = sorted(target.eos_token_ids)
    compiler = GrammarCompiler(tokenizer, target.vocab_size, eos)
    clock = GrammarClock()
    with clock.installed():
        speed_lines = speed(target, draft, compiler, tokenizer, eos, clock)
    validity_lines = validity(args.validity, tokenizer, eos) if args.validity else []
    load = os.getloadavg()[0]
    report = "\n".join([
        "# Structured outputs under speculation (default pair, in process)", "",
        f"`python -m specserve.bench.figures.structured_outputs --validity {args.validity}`: one stream, K={NUM_DRAFT_TOKENS}, "
        f"max_tokens={MAX_TOKENS}, 1 torch thread, {len(PROMPTS)} prompts x {len(SCHEMAS)} JSON schemas "
        "(compact: no free whitespace), variants in turn per request; 1-minute load average "
        f"{load:.1f} on 2 cores when it ended (other sessions shared the box).", "",
        *speed_lines, "", "## Validity", "", *validity_lines, ""])
    print(report)
    if args.out is not None:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
