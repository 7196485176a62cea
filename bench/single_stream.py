"""Single-stream greedy tok/s of a RUNNING server, for before/after comparisons across commits.

    python -m specserve.bench.single_stream URL LABEL [PASSES]

Sends the third-party prompt set one request at a time (64 tokens, greedy), PASSES times after a
warm-up, and prints one JSON line: tok/s per pass, their median, the mean depth K, acceptance and
the median per-round overhead the router reports. Start the server of each tree in turn
(`SPECSERVE__HTTP__PORT=P specserve serve`, with PYTHONPATH at that tree) so they never share cores.
"""

import json
import statistics
import sys

from specserve.bench.http_rows import request_body, run_level
from specserve.training.prompts import load_prompt_set


def main(argv: list[str]) -> None:
    url, label, passes = argv[0], argv[1], int(argv[2]) if len(argv) > 2 else 3
    prompts = load_prompt_set("thirdparty").prompts
    bodies = [(p.prompt_id, request_body("specserve-default", p.text, "greedy", 64, seed=i))
              for i, p in enumerate(prompts)]
    run_level(url, bodies[:2], 1)  # warm-up
    levels = [run_level(url, bodies, 1) for _ in range(passes)]
    records = [record for level in levels for record in level["records"]]
    rounds = max(1, sum(r["rounds"] for r in records))
    drafted = max(1, sum(r["num_drafted"] for r in records))
    overheads = [r["median_overhead_s"] for r in records if r["median_overhead_s"] is not None]
    tokens_per_s = [level["tokens_per_s"] for level in levels]
    print(json.dumps({"label": label, "tokens_per_s": tokens_per_s, "median": statistics.median(tokens_per_s),
                      "mean_k": drafted / rounds, "accept": sum(r["num_accepted"] for r in records) / drafted,
                      "median_overhead_ms": 1000 * statistics.median(overheads) if overheads else None}))


if __name__ == "__main__":
    main(sys.argv[1:])
