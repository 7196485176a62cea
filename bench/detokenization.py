"""Micro-benchmark: the text cost of one committed token (detokenize + stop-string check + a streamed
chunk every 4 tokens) against output length, incremental (RequestState) vs re-decoding everything.

    python -m specserve.bench.detokenization

Incremental stays flat; re-decoding grows with the output (quadratic over a request).
"""

from __future__ import annotations

import time
from pathlib import Path

from transformers import AutoTokenizer

from specserve.common.config import DEFAULT_MODELS_DIR
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.sequence import RequestState

STOP = "<<never>>"


def _incremental_us(token_ids: list[int], decode) -> tuple[float, float]:
    state = RequestState(request_id="bench", prompt_ids=[1], params=SamplingParams(max_tokens=len(token_ids) + 1,
                         stop=[STOP]), eos_token_id=None, max_context=10**7, detokenize=decode)
    return _timed(token_ids, lambda i: (state.commit([token_ids[i]]), i % 4 == 3 and state.take_text_delta()))


def _redecode_us(token_ids: list[int], decode) -> tuple[float, float]:
    def step(i: int) -> None:  # what decoding/sequence.py did before: whole output, every token and chunk
        STOP in decode(token_ids[:i + 1])
        if i % 4 == 3:
            decode(token_ids[:i + 1])
    return _timed(token_ids, step)


def _timed(token_ids: list[int], step) -> tuple[float, float]:
    """(mean µs per token, µs per token over the last 256 tokens)."""
    start = time.perf_counter()
    for i in range(len(token_ids)):
        if i == len(token_ids) - 256:
            last_start = time.perf_counter()
        step(i)
    end = time.perf_counter()
    return 1e6 * (end - start) / len(token_ids), 1e6 * (end - last_start) / 256


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODELS_DIR / "tokenizer")
    text = (Path(__file__).resolve().parents[1] / "decoding" / "model_runner.py").read_text() * 20
    all_ids = tokenizer.encode(text, add_special_tokens=False)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    print("| output tokens | incremental µs/token (mean / last 256) | re-decode µs/token (mean / last 256) |")
    print("|---|---|---|")
    for length in (256, 1024, 4096):
        incremental = _incremental_us(all_ids[:length], decode)
        redecode = _redecode_us(all_ids[:length], decode)
        print(f"| {length} | {incremental[0]:.1f} / {incremental[1]:.1f} | {redecode[0]:.1f} / {redecode[1]:.1f} |")


if __name__ == "__main__":
    main()
