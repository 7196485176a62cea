"""What storing the Linear weights input-major saves per engine step on the CPU
(decoding.weight_layout): the draft's step (1 new token a row, batch 1 and 8) and the target's
(1 and 5 new tokens a row, batch 1 and 8), eager, with the weights as PyTorch stores them
([out, in]) against input-major ([in, out]), split into the forward and the rest of the step.

    python -m specserve.bench.figures.weight_layout [--reps 60] [--threads 1] [--pairs default llama3-width]

Both engines serve copies of the same model and take turns every repetition (bench.engine_step's
rows and timing), so the box's drift hits both alike; the largest difference between their logits
is reported. The engine stores its weights input-major itself; the "[out, in]" engine's weights
are put back as loaded after it is built.
"""

from __future__ import annotations

import copy
import json

import torch

from specserve.bench.engine_step import SHAPES, models, step_bench_arguments, step_times
from specserve.bench.report import markdown_table
from specserve.bench.look_alike import VOCAB_SIZE, timed_forwards
from specserve.decoding.scheduler import engine_for_model

VARIANTS = ("out_in", "in_out")


def engines(model) -> dict:
    """Variant -> (eager engine, its forwards' seconds): one over the model as the engine stores
    it (input-major), one over a copy whose weights are put back [out, in]."""
    as_loaded = copy.deepcopy(model)
    built = {"in_out": engine_for_model(model, max_sequences=16, enforce_eager=True),
             "out_in": engine_for_model(as_loaded, max_sequences=16, enforce_eager=True)}
    for module in as_loaded.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.contiguous()
    timed = {}
    for name in VARIANTS:
        seconds = [0.0]
        timed[name] = (timed_forwards(built[name], seconds), seconds)
    return timed


def table(rows: list[dict], command: str) -> str:
    header = ["pair", "model", "rows x new", "[out, in] step ms (forward + outside)",
              "[in, out] step ms (forward + outside)", "[out, in] / [in, out]", "max abs logit diff"]
    body = [[row["pair"], row["role"], f"{row['rows']} x {row['new_tokens']}",
             *(f"{row[name]['step_ms']:.3f} ({row[name]['forward_ms']:.3f} + {row[name]['outside_ms']:.3f})"
               for name in VARIANTS),
             f"{row['ratio']:.2f}", f"{row['max_abs_logit_diff']:.1e}"] for row in rows]
    return "\n".join([f"# Engine step, Linear weights [out, in] vs input-major [in, out] (CPU, eager, "
                      f"{torch.get_num_threads()} torch thread)", "",
                      f"`{command}`; medians, the two taking turns in one run; forward = the runner's model "
                      "call, outside = the rest of the step; llama3-width: the default pair's architecture with a "
                      f"{VOCAB_SIZE:,}-token vocabulary (random weights).", "", markdown_table(header, body)]) + "\n"


def main(argv: list[str] | None = None) -> None:
    args, command = step_bench_arguments("specserve.bench.figures.weight_layout", __doc__.splitlines()[0], argv)
    rows = []
    for (pair, role), model in models(args.pairs).items():
        runners = engines(model)
        for batch, new_tokens in SHAPES[role]:
            row = {"pair": pair, "role": role, "rows": batch, "new_tokens": new_tokens,
                   **step_times(runners, batch, new_tokens, args.reps)}
            row["ratio"] = round(row["out_in"]["step_ms"] / row["in_out"]["step_ms"], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
        text = table(rows, command)   # written after each model: a long run keeps what it measured
        if args.out:
            args.out.write_text(text)
            args.out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
