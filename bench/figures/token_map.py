"""A draft model over a token map against the same draft over its whole vocabulary (docs/token-map.md).

    python -m specserve.bench.figures.token_map [--sizes 2048 4096] [--look-alike-size 32768] \\
        [--num-prompts 8] [--max-tokens 64] --out bench/results --name NAME

First the draft's step alone (bench.engine_step's timing: one row and eight, one new token, 100
cached tokens, eager, the runners taking turns step by step, forward and the rest apart): the
shipped draft over its whole vocabulary and over each map (`training.token_map` over the default
pair's training corpus), and its Llama-3-width look-alike (V = 128,256, random weights, so only its
cost means anything) over its whole vocabulary and over a map of its first --look-alike-size ids.
Then the shipped pair in process on the held-out third-party prompts (bench.figures.head_vs_draft's
rounds: greedy and sampled at temperature 0.8, one stream and eight, K = 4 every round, the
variants taking turns prompt by prompt): per-token acceptance, tokens per target pass, the
drafter's milliseconds per drafted token, tok/s, target-only beside. Greedy outputs of every
variant must equal target-only's; a difference is reported, not hidden.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specserve.bench import DEFAULT_OUT_DIR
from specserve.bench.engine_step import step_times
from specserve.bench.figures.head_vs_draft import round_table, run_cases, write_report
from specserve.bench.look_alike import DEFAULT_PAIR, VOCAB_SIZE, timed_forwards
from specserve.decoding.model_runner import load_causal_lm
from specserve.decoding.proposers import DraftModelProposer
from specserve.decoding.scheduler import engine_for_model
from specserve.decoding.token_map import map_lm_head
from specserve.training.prompts import load_prompt_set, select_prompts
from specserve.training.token_map import corpus_texts, token_map

STEP_SHAPES = ((1, 1), (8, 1))


def mapped(model: torch.nn.Module, token_ids: list[int]) -> torch.nn.Module:
    """A copy of model whose LM head scores token_ids only, in every step: sampled rows too
    (`draft.token_map_sampled`), so the rounds show what a map costs them (served by default,
    a sampled row scores the whole head) and the step's timing calls need not say they are greedy."""
    copied = copy.deepcopy(model)
    map_lm_head(copied, torch.tensor(token_ids), maps_sampled=True)
    return copied


def look_alike_draft() -> torch.nn.Module:
    """The shipped draft's architecture at Llama-3's vocabulary, random weights, float32."""
    config = AutoConfig.from_pretrained(DEFAULT_PAIR / "draft", local_files_only=True)
    config.vocab_size, config.tie_word_embeddings = VOCAB_SIZE, False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def step_rows(pair: str, models: dict[str, torch.nn.Module], reps: int) -> list[dict]:
    """The step of each model (name -> model) at STEP_SHAPES, taking turns."""
    runners = {}
    for name, model in models.items():
        seconds = [0.0]
        runners[name] = (timed_forwards(engine_for_model(model, max_sequences=16, enforce_eager=True), seconds),
                         seconds)
    rows = []
    for batch, new_tokens in STEP_SHAPES:
        times = step_times(runners, batch, new_tokens, reps)
        times.pop("max_abs_logit_diff")   # the maps' logits differ from the whole head's by design
        rows.append({"pair": pair, "rows": batch, "new_tokens": new_tokens, **times})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def step_table(rows: list[dict]) -> list[str]:
    lines = ["| draft | rows x new | variant | step ms (forward + outside) | × whole vocabulary |",
             "|---|---|---|---|---|"]
    for row in rows:
        whole = row["whole vocabulary"]["step_ms"]
        for name, each in row.items():
            if isinstance(each, dict):
                lines.append(f"| {row['pair']} | {row['rows']} x {row['new_tokens']} | {name} | {each['step_ms']:.3f} "
                             f"({each['forward_ms']:.3f} + {each['outside_ms']:.3f}) | {each['step_ms'] / whole:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.figures.token_map",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096], help="map sizes for the shipped draft")
    parser.add_argument("--look-alike-size", type=int, default=32768, help="map size at the Llama-3 width")
    parser.add_argument("--reps", type=int, default=40, help="timed steps per variant and shape")
    parser.add_argument("--prompts", default="thirdparty")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=DEFAULT_OUT_DIR)
    parser.add_argument("--name", default=None, help="write <out>/<name>.json and .md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_PAIR / "target"), local_files_only=True)
    texts = corpus_texts([])
    maps = {size: token_map(tokenizer, texts, size) for size in args.sizes}
    draft = load_causal_lm(str(DEFAULT_PAIR / "draft"), dtype="float32", device="cpu")
    names = {size: f"token map {len(ids)}" for size, ids in maps.items()}
    # Copied before any engine lays the draft's weights out (each engine lays out its own model).
    drafts = {"whole vocabulary": draft, **{names[size]: mapped(draft, ids) for size, ids in maps.items()}}
    steps = step_rows("default", drafts, args.reps)
    wide = look_alike_draft()
    steps += step_rows("llama3-width", {"whole vocabulary": wide, f"token map {args.look_alike_size}":
                                        mapped(wide, list(range(args.look_alike_size)))}, args.reps)

    target = load_causal_lm(str(DEFAULT_PAIR / "target"), dtype="float32", device="cpu")
    engines = {"target only": (engine_for_model(target), None)}
    for name, model in drafts.items():
        label = "draft model" if model is draft else f"draft model, {name}"
        engines[label] = (engine_for_model(target), DraftModelProposer(engine_for_model(model)))
    prompts = [tokenizer(p.text, add_special_tokens=False)["input_ids"]
               for p in select_prompts(load_prompt_set(args.prompts).prompts, args.num_prompts)]
    cases = run_cases(engines, prompts, args.max_tokens, args.k)

    command = "python -m specserve.bench.figures.token_map " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {"command": command, "maps": {str(size): len(ids) for size, ids in maps.items()},
              "look_alike_map": args.look_alike_size, "steps": steps, "cases": cases,
              "prompts": f"{args.prompts} ({len(prompts)})", "max_tokens": args.max_tokens, "k": args.k,
              "threads": args.threads, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"}
    drafters = [name for name in engines if name != "target only"]
    text = "\n".join([
        "# A draft model over a token map", "",
        f"`{command}`: {report['machine']}, fp32, {args.threads} torch thread(s); maps of the default pair's "
        "training corpus's most frequent tokens (`python -m specserve.training.token_map`).", "",
        "## The draft's step (100 cached tokens a row, eager, variants taking turns, medians)", "",
        *step_table(steps), "",
        f"## The shipped pair in process: {report['prompts']} prompts, {args.max_tokens} tokens each, K = {args.k} "
        "every round, variants taking turns", "",
        round_table(cases, drafters)])
    write_report(args, report, text)


if __name__ == "__main__":
    main()
