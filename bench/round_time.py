"""Per-round time of sampled vs greedy requests and of long vs short histories, on a 128k-vocabulary
look-alike pair at fixed K (issue 37: a round's cost should follow K, not the sampling mode, the
history or the vocabulary).

    python -m specserve.bench.round_time [--rounds 40] [--warmup 2] [--threads 1] [--out bench/results/cpu-2core-round-time.md]

The pair is the shipped default pair's architecture (models/default: target and draft configs)
with Llama 3's vocabulary width (128,256) and a context of 4,096, random weights. Six requests,
one per variant (greedy / sampled / sampled with top-p x 100 / 3,500 history tokens), are
prefilled, then take turns round by round, so the box's drift hits every variant alike. A round is
one `decoding.generate.generate` step: the draft drafts K tokens (sampled: temperature 0.8, and
top-p 0.95 in the top-p variant; the draft's support cut to speculation.draft_top_k), the
target runs one forward over the block, its rows are processed and answered on the engine's path
(decoding.speculation.target_rows_batch, verify_answers) and the block is verified. The draft
always drafts K tokens (ignore_eos, max_tokens past the run), so every round does the same work
whatever was accepted. Medians and p90 per variant, and each variant's median over greedy-short's.

No Ray: transport is bench.round_bytes' and bench.transport's subject; this is the engines' work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specserve.cluster.config import SpeculationSpec
from specserve.decoding.batched_runner import runner_for_model
from specserve.decoding.generate import generate
from specserve.decoding.proposers import DraftModelProposer
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.sequence import RequestState

DEFAULT_PAIR = Path(__file__).resolve().parents[1] / "models" / "default"
VOCAB_SIZE = 128_256
MAX_CONTEXT = 4_096
NUM_DRAFT_TOKENS = 4
HISTORIES = {"short": 100, "long": 3_500}
MODES = {"greedy": SamplingParams(temperature=0, max_tokens=MAX_CONTEXT, ignore_eos=True),
         "sampled": SamplingParams(temperature=0.8, max_tokens=MAX_CONTEXT, ignore_eos=True, seed=7),
         # top-p (and top-k) sort each processed row: over 128k ids the costliest stage of a sampled row
         "sampled_top_p": SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_CONTEXT, ignore_eos=True,
                                         seed=7)}


def look_alike(role: str, seed: int):
    """models/default/<role>'s architecture, 128k vocabulary, a 4k context, random weights."""
    config = AutoConfig.from_pretrained(DEFAULT_PAIR / role, local_files_only=True)
    config.vocab_size, config.max_position_embeddings = VOCAB_SIZE, MAX_CONTEXT
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def measure(num_rounds: int, num_warmup: int) -> dict:
    """Seconds per round, per variant, the variants taking turns after num_warmup untimed rounds each."""
    target = runner_for_model(look_alike("target", 0), max_sequences=8, model_path="look-alike-target",
                              max_model_len=MAX_CONTEXT)
    proposer = DraftModelProposer(runner_for_model(look_alike("draft", 1), max_sequences=8,
                                                   model_path="look-alike-draft", max_model_len=MAX_CONTEXT),
                                  max_candidates=SpeculationSpec().draft_top_k)
    ids = torch.randint(0, VOCAB_SIZE, (max(HISTORIES.values()),), generator=torch.Generator().manual_seed(3))
    rounds, seconds = {}, {}
    for history, length in HISTORIES.items():
        for mode, params in MODES.items():
            name = f"{mode}-{history}"
            state = RequestState(name, ids[:length].tolist(), params, eos_token_id=None, max_context=MAX_CONTEXT)
            rounds[name] = generate(target, state, proposer, NUM_DRAFT_TOKENS)
            next(rounds[name])  # the prefill, untimed
            seconds[name] = []
    if (num_warmup + num_rounds) * (NUM_DRAFT_TOKENS + 1) + max(HISTORIES.values()) >= MAX_CONTEXT:
        raise ValueError(f"{num_warmup + num_rounds} rounds would run the long history past the {MAX_CONTEXT}-token "
                         "context")
    for _ in range(num_warmup):
        for round_iterator in rounds.values():
            next(round_iterator)
    for _ in range(num_rounds):
        for name, round_iterator in rounds.items():
            started = time.perf_counter()
            next(round_iterator)
            seconds[name].append(time.perf_counter() - started)
    for round_iterator in rounds.values():
        round_iterator.close()
    return seconds


def summary(seconds: dict) -> dict:
    baseline = statistics.median(seconds["greedy-short"])
    return {name: {"median_ms": 1e3 * statistics.median(values),
                   "p90_ms": 1e3 * statistics.quantiles(values, n=10)[-1] if len(values) > 1 else 1e3 * values[0],
                   "vs_greedy_short": statistics.median(values) / baseline, "rounds": len(values)}
            for name, values in seconds.items()}


def table(rows: dict, command: str) -> str:
    lines = [f"Per-round time, K = {NUM_DRAFT_TOKENS}, V = {VOCAB_SIZE:,}, the default pair's architecture with "
             f"random weights, torch threads {torch.get_num_threads()}; variants taking turns (`{command}`).", "",
             "| variant | history tokens | median ms per round | p90 ms | median / greedy-short's |",
             "|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {HISTORIES[name.rsplit('-', 1)[1]]:,} | {row['median_ms']:.1f} | {row['p90_ms']:.1f} "
                     f"| {row['vs_greedy_short']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per variant before the timed ones")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", type=Path, help="write the table here (and the raw numbers beside it as .json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    command = f"python -m specserve.bench.round_time --rounds {args.rounds} --warmup {args.warmup} --threads {args.threads}"
    seconds = measure(args.rounds, args.warmup)
    rows = summary(seconds)
    text = table(rows, command)
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"command": command, "summary": rows,
                                                             "seconds": seconds}, indent=1))


if __name__ == "__main__":
    main()
