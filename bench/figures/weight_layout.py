"""What the Linear weights' layout saves per engine step on the CPU (decoding.weight_layout): the
draft's step (1 new token a row, batch 1 and 8) and the target's (1 and 5 new tokens a row, batch 1
and 8), eager, with the weights as PyTorch stores them ([out, in]), input-major ([in, out]) alone,
and input-major with the oneDNN-packed copy that products of several rows read (the engine's),
split into the forward and the rest of the step.

    python -m specserve.bench.figures.weight_layout [--reps 60] [--threads 1] [--pairs default llama3-width]

The engines serve copies of the same model and take turns every repetition (bench.engine_step's
rows and timing), so the box's drift hits all alike; the largest difference between the packed
engine's logits and the input-major one's is reported. The engine lays its weights out itself;
the other two engines' Linears are made plain again after they are built (and the "[out, in]"
engine's weights put back as loaded).
"""

from __future__ import annotations

import copy
import json

import torch

from specserve.bench.engine_step import SHAPES, models, step_bench_arguments, step_times
from specserve.bench.report import markdown_table
from specserve.bench.look_alike import VOCAB_SIZE, timed_forwards
from specserve.decoding.scheduler import engine_for_model
from specserve.decoding.weight_layout import PackedLinear

VARIANTS = ("packed", "in_out", "out_in")   # the first two's logits are compared
LABELS = {"packed": "input-major + packed", "in_out": "input-major [in, out]", "out_in": "[out, in]"}


def engines(model) -> dict:
    """Variant -> (eager engine, its forwards' seconds): one over the model as the engine lays it
    out, one over a copy without the packed copies, one over a copy whose weights are also put
    back [out, in]."""
    copies = {"packed": model, "in_out": copy.deepcopy(model), "out_in": copy.deepcopy(model)}
    built = {name: engine_for_model(copies[name], max_sequences=16, enforce_eager=True) for name in VARIANTS}
    for name in ("in_out", "out_in"):
        for module in copies[name].modules():
            if isinstance(module, PackedLinear):
                module.__class__ = torch.nn.Linear   # the plain product for every row count
                if name == "out_in":
                    module.weight.data = module.weight.data.contiguous()
    timed = {}
    for name in VARIANTS:
        seconds = [0.0]
        timed[name] = (timed_forwards(built[name], seconds), seconds)
    return timed


def table(rows: list[dict], command: str) -> str:
    header = ["pair", "model", "rows x new", *(f"{LABELS[name]} step ms (forward + outside)" for name in VARIANTS),
              "input-major / packed", "[out, in] / packed", "max abs logit diff"]
    body = [[row["pair"], row["role"], f"{row['rows']} x {row['new_tokens']}",
             *(f"{row[name]['step_ms']:.3f} ({row[name]['forward_ms']:.3f} + {row[name]['outside_ms']:.3f})"
               for name in VARIANTS),
             f"{row['in_out_over_packed']:.2f}", f"{row['out_in_over_packed']:.2f}",
             f"{row['max_abs_logit_diff']:.1e}"] for row in rows]
    return "\n".join([f"# Engine step by the Linear weights' layout (CPU, eager, {torch.get_num_threads()} torch thread)", "",
                      f"`{command}`; medians, the three taking turns in one run; forward = the runner's model "
                      "call, outside = the rest of the step; llama3-width: the default pair's architecture with a "
                      f"{VOCAB_SIZE:,}-token vocabulary (random weights); max abs logit diff: packed against "
                      "input-major alone.", "", markdown_table(header, body)]) + "\n"


def main(argv: list[str] | None = None) -> None:
    args, command = step_bench_arguments("specserve.bench.figures.weight_layout", __doc__.splitlines()[0], argv)
    rows = []
    for (pair, role), model in models(args.pairs).items():
        runners = engines(model)
        for batch, new_tokens in SHAPES[role]:
            row = {"pair": pair, "role": role, "rows": batch, "new_tokens": new_tokens,
                   **step_times(runners, batch, new_tokens, args.reps)}
            for name in ("in_out", "out_in"):
                row[f"{name}_over_packed"] = round(row[name]["step_ms"] / row["packed"]["step_ms"], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
        text = table(rows, command)   # written after each model: a long run keeps what it measured
        if args.out:
            args.out.write_text(text)
            args.out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
