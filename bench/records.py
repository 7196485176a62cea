"""Per-request raw numbers, and how one benchmark row's reported numbers are derived from them.

Every row (in-process or over HTTP, specserve or Hugging Face) produces the same RequestRecord,
so one summary function defines what "tokens/s", "TTFT" or "overhead per round" mean for all of
them, and the JSON keeps the raw numbers a reader can re-derive the table from.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from specserve.bench.perfmodel import (
    expected_tokens_per_pass,
    measured_acceptance_rate,
    median_or_none,
    overlapped_speedup_bound,
    serial_speedup_estimate,
)


@dataclass
class RequestRecord:
    prompt_id: str
    run: int
    num_prompt_tokens: int
    num_output_tokens: int
    wall_s: float                          # request start to last token, as the caller sees it
    ttft_s: float | None                   # request start to the first output token
    target_passes: int                     # target forwards, prefill included where it is separate
    rounds: int                            # target passes that verified at least one draft token
    num_drafted: int
    num_accepted: int
    median_overhead_s: float | None        # median over this request's rounds of wall - model compute
    server_ttft_s: float | None = None     # the router's own TTFT (HTTP rows)
    median_hops_s: float | None = None     # of the overhead: the RPC hops to and from the engines (HTTP rows)
    median_router_s: float | None = None   # of the overhead: the rest, the router's own work (HTTP rows)
    finish_reason: str | None = None
    round_stages_ms: list[dict] | None = None  # per round, when the router profiles (deployments/round_stages.py)
    first_token_stages_ms: dict | None = None  # the first token's engine lookup and prefill, when it profiles
    cache_hits: int = 0                    # rounds whose block was pre-drafted (speculation cache, HTTP rows)
    cache_misses: int = 0                  # rounds drafted just in time although blocks were pre-drafted
    # What was generated, so rows can be checked against each other (greedy speculation is
    # lossless: same ids as target-only), not only timed: ids in-process, streamed text over HTTP.
    output_token_ids: list[int] | None = None
    output_text: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepLatency:
    """Model step latencies on a warm cache (seconds): target t(n) for n new tokens, draft t(1)."""

    target_s: dict[int, float]
    draft_s: float

    @property
    def draft_cost_ratio(self) -> float:
        return self.draft_s / self.target_s[1]

    def target(self, num_new_tokens: int) -> float | None:
        return self.target_s.get(num_new_tokens)


def _tokens_per_s_by_run(records: list[RequestRecord]) -> list[float]:
    """Per run: all output tokens / all request wall time (requests of a row run one at a time)."""
    runs: dict[int, list[RequestRecord]] = {}
    for record in records:
        runs.setdefault(record.run, []).append(record)
    return [sum(r.num_output_tokens for r in rs) / sum(r.wall_s for r in rs)
            for _, rs in sorted(runs.items()) if sum(r.wall_s for r in rs) > 0]


def time_per_output_token_s(record: RequestRecord) -> float | None:
    if record.ttft_s is None or record.num_output_tokens < 2:
        return None
    return (record.wall_s - record.ttft_s) / (record.num_output_tokens - 1)


def summarize_row(records: list[RequestRecord], steps: StepLatency | None) -> dict:
    """A row's reported numbers. tokens/s: median over runs; TTFT, TPOT and overhead: medians over
    requests; acceptance, tokens per pass and mean depth: pooled over all requests.

    acceptance_rate is accepted / drafted (what the router reports); alpha is the per-token
    acceptance of the geometric model fitted to the measured tokens per verifying round at the
    row's mean depth K (policies.acceptance, as the depth policy estimates it), and the bound E * t(1) / t(K+1) and the serial estimate use it (with the
    t(K+1) measured at K rounded to an integer)."""
    if not records:
        raise ValueError("a row needs at least one request record")
    tokens_per_s_runs = _tokens_per_s_by_run(records)
    drafted = sum(r.num_drafted for r in records)
    accepted = sum(r.num_accepted for r in records)
    rounds = sum(r.rounds for r in records)
    passes = sum(r.target_passes for r in records)
    mean_draft_tokens = drafted / rounds if rounds else 0.0
    summary = {
        "tokens_per_s": statistics.median(tokens_per_s_runs) if tokens_per_s_runs else None,
        "tokens_per_s_runs": tokens_per_s_runs,
        "ttft_ms": _ms(median_or_none([r.ttft_s for r in records])),
        "tpot_ms": _ms(median_or_none([time_per_output_token_s(r) for r in records])),
        "acceptance_rate": accepted / drafted if drafted else None,
        "alpha": None,
        "tokens_per_pass": sum(r.num_output_tokens for r in records) / passes if passes else None,
        "tokens_per_round": (accepted + rounds) / rounds if rounds else None,
        "mean_draft_tokens": mean_draft_tokens,
        "overhead_ms": _ms(median_or_none([r.median_overhead_s for r in records])),
        "num_requests": len(records),
        "num_output_tokens": sum(r.num_output_tokens for r in records),
        "expected_tokens_per_pass": None, "bound": None, "serial_estimate": None,
    }
    if not drafted:  # no drafting: one token per pass, nothing to gain or lose
        summary.update(expected_tokens_per_pass=1.0, bound=1.0, serial_estimate=1.0)
        return summary
    alpha = measured_acceptance_rate(accepted, drafted, rounds)
    summary["alpha"] = alpha
    summary["expected_tokens_per_pass"] = expected_tokens_per_pass(alpha, mean_draft_tokens)
    t_k1 = steps.target(step_size_for(mean_draft_tokens)) if steps is not None else None
    if t_k1 is not None:
        summary["bound"] = overlapped_speedup_bound(alpha, mean_draft_tokens, steps.target_s[1], t_k1)
        summary["serial_estimate"] = serial_speedup_estimate(alpha, mean_draft_tokens, steps.target_s[1],
                                                             t_k1, steps.draft_s)
    return summary


def step_size_for(mean_draft_tokens: float) -> int:
    """Tokens per verify forward whose latency stands for a row's mean depth K: round(K) + 1."""
    return int(round(mean_draft_tokens)) + 1


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds
