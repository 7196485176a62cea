"""Offline path of online draft training (docs/online-learning.md): distil a draft on persisted
captures and write a draft folder `specserve serve --draft` takes.

    specserve distill-draft --from-capture CAPTURE_DIR --out NEW_DRAFT_DIR [--draft DRAFT_DIR]

CAPTURE_DIR is what a server with draft_training.capture_dir wrote. The pass is the trainer
actor's (training/online_trainer.py): the serving draft (--draft, default the shipped one) is
distilled on the training slice and canaried on the held-back slice; the folder is written only
if the candidate beats the draft by --canary-margin (exit status 1 otherwise, nothing written).
Periodic offline re-distillation on captured data is what Hong et al. (2025) find best under
domain shift.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from specserve.common.config import DEFAULT_MODELS_DIR, DraftTrainingSpec
from specserve.decoding.capture import load_blocks
from specserve.training.online_trainer import OnlineTrainer


def main(argv: list[str] | None = None) -> None:
    defaults = DraftTrainingSpec()
    parser = argparse.ArgumentParser(prog="specserve distill-draft --from-capture", description=__doc__.splitlines()[0])
    parser.add_argument("--from-capture", required=True, help="directory of captured shards (draft_training.capture_dir)")
    parser.add_argument("--out", required=True, help="where to write the distilled draft folder")
    parser.add_argument("--draft", default=str(DEFAULT_MODELS_DIR / "draft"), help="the draft to start from")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--max-context", type=int, default=defaults.max_context)
    parser.add_argument("--canary-margin", type=float, default=defaults.canary_margin)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    blocks = list(load_blocks(args.from_capture))
    if not blocks:
        raise SystemExit(f"no captured shards (*.npz) under {args.from_capture}")
    settings = {**defaults.model_dump(), "lr": args.lr, "epochs": args.epochs, "batch_size": args.batch_size,
                "max_context": args.max_context, "canary_margin": args.canary_margin, "min_new_positions": 1,
                "max_positions": sum(block.num_positions for block in blocks)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        trainer = OnlineTrainer(args.draft, settings, work)
        trainer.add(blocks)
        if not trainer.ready():
            raise SystemExit("the captures hold no held-back request to judge a candidate on; capture more")
        result = trainer.train_pass()
        print(f"{result['train_positions']} training / {result['held_positions']} held-back positions, "
              f"{result['steps']} steps in {result['seconds']:.1f} s; expected acceptance "
              f"{result['expected_before']:.4f} -> {result['expected_after']:.4f}", flush=True)
        if result["outcome"] != "accepted":
            raise SystemExit(f"the candidate does not beat {args.draft} by {args.canary_margin}: nothing written")
        shutil.rmtree(out, ignore_errors=True)
        Path(trainer.version(result["version"]).path).rename(out)
    print(f"wrote {out} (serve it with: specserve serve --draft {out})")
