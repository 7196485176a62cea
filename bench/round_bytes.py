"""Bytes per request-round crossing processes: the pickled size of what each engine call sends
and returns, greedy and sampled, by context length and vocabulary size; and the seconds the round
protocol's own work takes besides the forwards (`--timing`).

    python -m specserve.bench.round_bytes [--timing] [--out bench/results/round-bytes.md]

Timing (medians of repeated rounds, this machine): the draft engine turning K rows of logits into
its answer (q cut to draft_top_k, tokens drawn), the target engine turning K + 1 rows into its
answer (row processing, p at the drafted tokens, residual and bonus draws), the router building the
round's two calls and verifying the answer (`accept_round`), and pickling + unpickling every message
(what Ray's serialisation costs, transport aside).

No Ray and no model: the router's own message-building code (deployments.request_engines) is
driven against stand-in engine handles that keep what each `.remote` call was given, and the
engines' replies are built by the functions the engines build them with, from random logits of
the vocabulary's width. One steady-state round of a request whose engines already hold it:
the round before committed K + 1 tokens, the draft proposes K tokens, the verify is chained to
the draft's answer (the block goes draft -> target directly), the target answers. Ray pickles arguments and results with
(cloud)pickle protocol 5; an ObjectRef inside the arguments is counted as its 28-byte id.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.common.config import LimitsSpec, SpeculationSpec
from specserve.common.messages import CallSpan
from specserve.decoding.compact_verify import DraftSupport, draft_support, sample_from_support
from specserve.decoding.proposers import Proposal
from specserve.decoding.sampling import SamplingParams, logits_to_probs, make_generator
from specserve.decoding.sequence import RequestState
from specserve.decoding.speculation import accept_round, target_rows, verify_answer
from specserve.deployments.request_engines import RequestEngines

NUM_DRAFT_TOKENS = 4
CONTEXTS = (100, 3_500)
VOCABS = (8_192, 128_256)
CLASSES = {"greedy": SamplingParams(temperature=0, max_tokens=512),
           "sampled": SamplingParams(temperature=0.8, max_tokens=512, seed=7)}
CALLS = ("router->draft propose", "draft->router proposal", "draft->target proposal",
         "router->target verify", "target->router rows")
OBJECT_REF_BYTES = 28


@dataclass(frozen=True)
class StandInRef:
    """What an ObjectRef costs inside a call's arguments: its id."""

    object_id: bytes = b"\0" * OBJECT_REF_BYTES


class RecordingHandle:
    """An engine actor handle whose `.method.remote(*args)` keeps the arguments' pickled size."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}

    def __getattr__(self, method: str):
        handle = self

        class _Method:
            @staticmethod
            def remote(*args, **kwargs):
                handle.sent[method] = pickled_size((args, kwargs))
                return StandInRef()

        return _Method()


def pickled_size(obj) -> int:
    return len(pickle.dumps(obj, protocol=5))


def draft_reply(logits: torch.Tensor, params: SamplingParams) -> tuple[Proposal, CallSpan]:
    """A draft engine's propose answer for K rows of draft logits, built as
    DraftModelProposer.propose_batch (q cut to speculation.draft_top_k) and DraftEngine._to_wire
    build it."""
    generator = make_generator(params.seed)
    if params.is_greedy:
        proposal = Proposal(torch.argmax(logits, dim=-1).tolist(), None)
    else:
        supports = [draft_support(logits_to_probs(row, params), SpeculationSpec().draft_top_k) for row in logits]
        tokens = [int(sample_from_support(q, generator)) for q in supports]
        proposal = Proposal(tokens, DraftSupport.stack(supports).wire())
    return proposal, CallSpan(0.0, 0.0, 0.0)


def target_reply(logits: torch.Tensor, params: SamplingParams, proposal: Proposal) -> tuple[object, CallSpan]:
    """A target engine's verify answer for K + 1 rows of logits (TargetEngine._forward_rows)."""
    answer = verify_answer(target_rows(logits, params), proposal, make_generator(params.seed),
                           SpeculationSpec().verification)
    return answer, CallSpan(0.0, 0.0, 0.0)


def round_bytes(context_len: int, vocab_size: int, params: SamplingParams) -> dict[str, int]:
    """Pickled bytes of each call of one steady-state round at this context and vocabulary."""
    torch.manual_seed(0)
    prompt_len = context_len // 2
    history = torch.randint(0, vocab_size, (context_len,)).tolist()
    state = RequestState("cmpl-bench", history[:prompt_len], params, eos_token_id=None, max_context=1 << 20)
    engines = RequestEngines(None, None, LimitsSpec())
    engines.draft, engines.target = RecordingHandle(), RecordingHandle()
    # The round before: it left the engines holding all but the K + 1 tokens it committed.
    state.output_ids = history[prompt_len:-(NUM_DRAFT_TOKENS + 1)]
    engines.send_verify(state, None, engines.propose(state, NUM_DRAFT_TOKENS))
    state.output_ids = history[prompt_len:]
    proposal_answer = draft_reply(torch.randn(NUM_DRAFT_TOKENS, vocab_size), params)
    answer = engines.propose(state, NUM_DRAFT_TOKENS)
    engines.send_verify(state, None, answer)
    verify_answer = target_reply(torch.randn(NUM_DRAFT_TOKENS + 1, vocab_size), params, proposal_answer[0])
    proposal_bytes = pickled_size(proposal_answer)
    return {"router->draft propose": engines.draft.sent["propose"], "draft->router proposal": proposal_bytes,
            "draft->target proposal": proposal_bytes, "router->target verify": engines.target.sent["verify"],
            "target->router rows": pickled_size(verify_answer)}


def round_seconds(context_len: int, vocab_size: int, params: SamplingParams, repeats: int = 30) -> dict[str, float]:
    """Median seconds of each part of one steady-state round's protocol work (module docstring)."""
    torch.manual_seed(0)
    prompt_len = context_len // 2
    history = torch.randint(0, vocab_size, (context_len,)).tolist()
    draft_logits, target_logits = torch.randn(NUM_DRAFT_TOKENS, vocab_size), torch.randn(NUM_DRAFT_TOKENS + 1,
                                                                                          vocab_size)
    parts: dict[str, list[float]] = {"draft answer": [], "target answer": [], "router": [], "pickling": []}
    for _ in range(repeats):
        state = RequestState("cmpl-bench", history[:prompt_len], params, eos_token_id=None, max_context=1 << 20)
        state.output_ids = history[prompt_len:]
        engines = RequestEngines(None, None, LimitsSpec())
        engines.draft, engines.target = RecordingHandle(), RecordingHandle()
        started = time.perf_counter()
        proposal, span = draft_reply(draft_logits, params)
        drafted = time.perf_counter()
        answer, _ = target_reply(target_logits, params, proposal)
        answered = time.perf_counter()
        engines.send_verify(state, None, engines.propose(state, NUM_DRAFT_TOKENS))
        accept_round(state, proposal, answer, SpeculationSpec().verification)
        routed = time.perf_counter()
        for message in ((proposal, span), (answer, span)):
            pickle.loads(pickle.dumps(message, protocol=5))
        pickled = time.perf_counter()
        for part, seconds in zip(parts, (drafted - started, answered - drafted, routed - answered,
                                         pickled - routed)):
            parts[part].append(seconds)
    return {part: statistics.median(values) for part, values in parts.items()}


def timing_table() -> list[str]:
    lines = ["| class | context | V | draft answer ms | target answer ms | router ms | pickling ms | total ms |",
             "|---|---|---|---|---|---|---|---|"]
    for name, params in CLASSES.items():
        for context_len in CONTEXTS:
            for vocab_size in VOCABS:
                parts = round_seconds(context_len, vocab_size, params)
                cells = " | ".join(f"{1e3 * seconds:.2f}" for seconds in parts.values())
                lines.append(f"| {name} | {context_len} | {vocab_size} | {cells} | {1e3 * sum(parts.values()):.2f} |")
    return lines


def table() -> list[str]:
    short = ["propose", "proposal (to router)", "proposal (to target)", "verify", "verify answer"]
    lines = [f"| class | context | V | {' | '.join(short)} | total |", "|---|---|---|" + "---|" * (len(short) + 1)]
    for name, params in CLASSES.items():
        for context_len in CONTEXTS:
            for vocab_size in VOCABS:
                sizes = round_bytes(context_len, vocab_size, params)
                cells = " | ".join(human(sizes[call]) for call in CALLS)
                lines.append(f"| {name} | {context_len} | {vocab_size} | {cells} | {human(sum(sizes.values()))} |")
    return lines


def human(num_bytes: int) -> str:
    if num_bytes < 10_000:
        return f"{num_bytes} B"
    if num_bytes < 1_000_000:
        return f"{num_bytes / 1e3:.1f} kB"
    return f"{num_bytes / 1e6:.2f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--timing", action="store_true", help="also time the protocol's work per round")
    args = parser.parse_args()
    spec = SpeculationSpec()
    command = "`python -m specserve.bench.round_bytes" + (" --timing`" if args.timing else "`")
    lines = [f"Pickled bytes per request-round (K={NUM_DRAFT_TOKENS}, the verify chained to the draft's "
             "answer; sampled: temperature 0.8, no top-k/top-p, "
             f"speculation.draft_top_k={spec.draft_top_k}, verification={spec.verification!r}), {command}", "",
             *table(), ""]
    if args.timing:
        lines += ["Protocol work per request-round besides the forwards, median of 30 rounds, ms (module docstring; "
                  f"load average at start {os.getloadavg()[0]:.1f}):", "", *timing_table(), ""]
    report = "\n".join(lines)
    print(report)
    if args.out is not None:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
