"""Which sampling defaults stop the default pair's answers from looping: the choice behind
models/default/target/generation_config.json.

Target-only, in-process, on held-out prompts (bench/prompts_thirdparty_v1.json, code unlike the
training corpus) plus the `make serve` demo prompt: for each candidate (temperature, top_p), a few
seeded 96-token answers per prompt, and how much of each answer repeats itself: the share of
tokens that complete an 8-token span already seen in the answer (a loop repeats spans verbatim).
`python -m specserve.bench.default_generation` (about a minute on an idle CPU); figures in docs/real-checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import AutoTokenizer

from specserve.cluster.cli import DEMO_PROMPT
from specserve.cluster.config import DEFAULT_MODELS_DIR
from specserve.decoding.generate import generate
from specserve.decoding.batched_runner import BatchedModelRunner
from specserve.decoding.scheduler import Scheduler
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.sequence import RequestState

CANDIDATES = [(0.0, 1.0), (0.6, 0.9), (0.7, 0.9), (0.8, 0.95), (1.0, 1.0)]
SPAN = 8


def repeated_share(ids: list[int], span: int = SPAN) -> float:
    """Share of tokens that end a span of `span` tokens seen earlier in ids."""
    seen, repeated = set(), 0
    for end in range(span, len(ids) + 1):
        gram = tuple(ids[end - span:end])
        repeated += gram in seen
        seen.add(gram)
    return repeated / max(1, len(ids) - span + 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", default="bench/results/default-generation.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = DEFAULT_MODELS_DIR / "target"
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = Scheduler(BatchedModelRunner(str(path), dtype="float32", device="cpu"))
    held_out = json.loads(Path("bench/prompts_thirdparty_v1.json").read_text())["prompts"][:args.prompts]
    prompts = [DEMO_PROMPT] + [p["text"] for p in held_out]
    results = []
    for temperature, top_p in CANDIDATES:
        shares, demo = [], None
        for index, prompt in enumerate(prompts):
            for seed in range(1 if temperature == 0 else args.seeds):
                params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=args.max_tokens,
                                        ignore_eos=True)
                state = RequestState(request_id="b", prompt_ids=tokenizer.encode(prompt), params=params,
                                     eos_token_id=None, max_context=engine.max_context,
                                     detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
                for _ in generate(engine, state):
                    pass
                shares.append(repeated_share(state.output_ids))
                if index == 0 and seed == 0:
                    demo = state.output_text
        results.append({"temperature": temperature, "top_p": top_p, "mean_repeated_share": round(statistics.fmean(shares), 3),
                        "answers_mostly_repeated": sum(s > 0.5 for s in shares), "answers": len(shares),
                        "demo_answer": demo})
        print(json.dumps({k: v for k, v in results[-1].items() if k != "demo_answer"}), flush=True)
    Path(args.out).write_text(json.dumps({"command": "python -m specserve.bench.default_generation", "span": SPAN,
                                          "max_tokens": args.max_tokens, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
