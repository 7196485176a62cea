"""Are drafts accepted independently? Tokens per round measured at each pinned K of a load sweep,
against what the geometric model (one alpha for every position) predicts from the rounds at
another K. If acceptance were independent, alpha fitted at K = 4 would predict K = 8's tokens per
round; on code it under-predicts them by a third, which is why policies.acceptance counts rounds
by position.

Run: `python -m specserve.bench.streaks bench/results/NAME.json [...]` (sweep runs that keep their records);
prints and writes bench/results/streaks.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specserve.policies.acceptance import acceptance_from_tokens_per_round, expected_tokens_per_round

OUT = Path(__file__).parent / "results" / "streaks.md"


def pinned_rounds(paths: list[str]) -> dict[str, tuple[float, float]]:
    """variant -> (tokens per round, mean K) over every record of every level and run."""
    totals: dict[str, list[float]] = {}
    for path in paths:
        for variant, levels in json.loads(Path(path).read_text())["variants"].items():
            if variant not in ("k2", "k4", "k8"):
                continue
            total = totals.setdefault(variant, [0.0, 0.0, 0.0])  # rounds, accepted, drafted
            for level in levels:
                for record in level.get("records", []):
                    total[0] += record["rounds"]
                    total[1] += record["num_accepted"]
                    total[2] += record["num_drafted"]
    return {variant: (1 + accepted / rounds, drafted / rounds) for variant, (rounds, accepted, drafted) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    args = parser.parse_args()
    measured = pinned_rounds(args.results)
    lines = ["# Tokens per round: measured against the geometric model", "",
             f"- from: {', '.join(f'`{path}`' for path in args.results)}", "",
             "| fitted at | alpha | " + " | ".join(f"predicts {v} ({measured[v][1]:.2f})" for v in measured) + " |",
             "|---|---|" + "---|" * len(measured),
             "| measured | | " + " | ".join(f"{measured[v][0]:.2f}" for v in measured) + " |"]
    for source, (tokens, depth) in measured.items():
        alpha = acceptance_from_tokens_per_round(tokens, depth)
        lines.append(f"| {source} | {alpha:.3f} | " + " | ".join(
            f"{expected_tokens_per_round(alpha, measured[v][1]):.2f}" for v in measured) + " |")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
