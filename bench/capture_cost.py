"""What capturing rounds for online draft training adds to a round (docs/online-learning.md).

    python -m specserve.bench.capture_cost [--rounds 20000] [--k 8] [--top-k 32]

Times, in-process on the default pair's shapes, the work capture adds per verified round: on the
router, `RoundCapture.top_k_for_round` and `observe` for every round (with training on), plus
building a CapturedBlock on a captured round; on the target, `top_rows` over the K rows of a
captured round. Reported per round at the default sample_every, to set against a round's wall
time (docs/performance.md). The push to the trainer (about once a second, fire-and-forget) is
not on a round's path and is not included.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specserve.common.config import SpecServeConfig
from specserve.decoding.capture import captured_block, top_rows
from specserve.common.metrics import RouterMetrics
from specserve.deployments.round_capture import RoundCapture


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20_000)
    parser.add_argument("--k", type=int, default=8, help="drafted tokens per round")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=200)
    args = parser.parse_args(argv)
    config = SpecServeConfig.model_validate({"draft_training": {"enabled": True}})
    capture = RoundCapture(config, RouterMetrics())
    capture._trainer_handle = lambda: None  # time the round path only: no trainer behind it
    logits = torch.randn(args.k + 1, args.vocab)
    context, drafted = list(range(args.context)), list(range(args.k))
    wire = top_rows(logits, config.draft_training.top_k)  # what a captured round's verify answers with
    started = time.perf_counter()
    for _ in range(args.rounds):
        top_k = capture.top_k_for_round()
        block = None
        if top_k is not None:
            block = captured_block("r", context, drafted, 3, *wire, 0)
        capture.observe(0, args.k, 3, block)
    router_us = 1e6 * (time.perf_counter() - started) / args.rounds
    started = time.perf_counter()
    for _ in range(200):
        top_rows(logits, config.draft_training.top_k)
    target_us = 1e6 * (time.perf_counter() - started) / 200
    print(json.dumps({"sample_every": config.draft_training.sample_every, "top_k": config.draft_training.top_k,
                      "k": args.k, "vocab": args.vocab, "router_us_per_round": round(router_us, 2),
                      "target_top_rows_us_per_captured_round": round(target_us, 2),
                      "target_us_per_round": round(target_us / config.draft_training.sample_every, 2)}))


if __name__ == "__main__":
    main()
