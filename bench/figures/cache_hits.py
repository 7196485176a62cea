"""How often the speculation cache has a round's block ready, measured on the engines in process.

The draft and target engines (deployments/draft_worker.py, target_worker.py) run here without
Ray, driven round by round as the router drives them: K and the fan-out from the router's own
`DepthChooser` (its hit floor included), the block proposed, verified, accepted, and the next
round asking the draft engine for the block continuing what was kept. What this measures is
which blocks were pre-drafted and whether the round found its own among them: a property of the
draft's sampling and of the fan-out's sharing, not of the transport, so no HTTP is needed
(docs/speculation-cache.md). The gates are open as for a draft with its own device:
`fan_out_max_batch` at least the number of streams.

    python -m specserve.bench.figures.cache_hits --cases greedy:1,sampled:1,greedy:4 --fan-out 8 \\
        --baseline-tree DIR --out bench/results --name NAME

Each case runs in a process of its own; with --baseline-tree, the same case with another tree's
code (main's, say) runs just before it, so before and after take turns on a shared box.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer

from specserve.bench import DEFAULT_OUT_DIR
from specserve.common.config import SpecServeConfig
from specserve.decoding.proposers import Proposal
from specserve.decoding.sampling import SamplingParams, draft_seed
from specserve.decoding.sequence import RequestState
from specserve.decoding.speculation import accept_round
from specserve.deployments.committed_history import HistorySender, RunningDigest
from specserve.deployments.draft_worker import DraftEngine
from specserve.deployments.target_worker import TargetEngine
from specserve.policies.acceptance import count_round_positions
from specserve.policies.depth_chooser import DepthChooser, request_class
from specserve.training.prompts import load_prompt_set

MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.8, "top_p": 0.95}}
SAGUARO_DOWNWEIGHT = 0.05   # the downweight the results were measured with


@dataclass
class Tally:
    """Rounds of one variant: hits among rounds whose previous round pre-drafted (looked), and
    among every round after a request's first."""

    proposes: int = 0
    rounds: int = 0
    looked: int = 0
    hits: int = 0
    drafted: int = 0
    accepted: int = 0
    predrafted_blocks: int = 0
    thrown_away: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    per_request_hit_share: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        return {"rounds": self.rounds, "looked": self.looked, "hits": self.hits,
                "hit_share_of_rounds": self.hits / self.rounds if self.rounds else None,
                "hit_share_of_looked": self.hits / self.looked if self.looked else None,
                "acceptance": self.accepted / self.drafted if self.drafted else None,
                "blocks_predrafted_per_round": self.predrafted_blocks / self.proposes if self.proposes else None,
                "thrown_away_per_output_token": self.thrown_away / self.output_tokens if self.output_tokens else None,
                "tokens_per_s": self.output_tokens / self.wall_s if self.wall_s else None}


def engines(config: SpecServeConfig, max_sequences: int) -> tuple[DraftEngine, TargetEngine]:
    """The served pair's engines as a server builds them (CPU, float32, one thread each)."""
    options = config.engine_options()

    def model(path: str, sequences: int) -> dict:
        return {"path": path, "dtype": "float32", "device": "cpu", "torch_threads": 1, "max_sequences": sequences}

    target_path, draft_path = str(config.target.path), str(config.draft.path)
    # Pre-drafts take sequence slots of their own: room for the fan-out of every stream.
    draft_sequences = max_sequences * (config.speculation.fan_out + 2)
    return (DraftEngine(config.speculation.proposer, model(draft_path, draft_sequences), target_path, options),
            TargetEngine(model(target_path, max_sequences), options))


async def decode(draft: DraftEngine, target: TargetEngine, chooser: DepthChooser, state: RequestState,
                 num_active, tally: Tally) -> None:
    """One request's rounds as the router runs them (deployments/round_loop.py), counting hits."""
    digest = RunningDigest()
    to_draft, to_target = HistorySender(digest), HistorySender(digest)
    params, seed = state.params, draft_seed(state.params.seed)
    klass, config_verification = request_class(state), chooser.spec.verification
    started = time.perf_counter()
    rows, _ = await target.verify(state.request_id, to_target.update(state), None, params, state.next_output_index)
    accept_round(state, Proposal([], None), rows)
    predrafted, first, hits, rounds = False, True, 0, 0
    while not state.finished:
        now = time.monotonic()
        num_draft = chooser.choose(state, num_active(), now)
        fan_out = chooser.fan_out(state, num_draft, num_active(), now) if num_draft else ()
        if num_draft:
            proposal, _ = await draft.propose(state.request_id, to_draft.update(state), num_draft, params, seed,
                                              len(state.prompt_ids), fan_out, None,
                                              chooser.predraft_depth(state, num_draft, num_active(), now))
        else:   # the depth policy chose a plain target step
            proposal = Proposal([], None)
        if predrafted:
            tally.looked += 1
            chooser.observe_cache(klass, proposal.cached)
        if not first:
            tally.rounds += 1
            rounds += 1
            hits += proposal.cached
            tally.hits += proposal.cached
        first = False
        tally.proposes += 1
        tally.thrown_away += proposal.predrafted_thrown_away
        predrafted = bool(fan_out) and bool(proposal.token_ids)
        tally.predrafted_blocks += sum(fan_out) if predrafted else 0
        round_started = time.perf_counter()
        rows, _ = await target.verify(state.request_id, to_target.update(state), proposal, params,
                                      state.next_output_index)
        accepted_before = state.stats.num_accepted
        accept_round(state, proposal, rows, config_verification)
        num_accepted = state.stats.num_accepted - accepted_before
        if proposal.token_ids:
            count_round_positions(state.draft_reached, state.draft_accepted_at, len(proposal.token_ids), num_accepted)
        if proposal.token_ids:
            chooser.observe_round(klass, len(proposal.token_ids), num_accepted, time.perf_counter() - round_started,
                                  0.0, 0.0, num_active() <= 1)
        tally.drafted += len(proposal.token_ids)
        tally.accepted += num_accepted
    tally.wall_s += time.perf_counter() - started
    tally.output_tokens += len(state.output_ids)
    if rounds:
        tally.per_request_hit_share.append(hits / rounds)
    await draft.release(state.request_id)
    await target.release(state.request_id)


async def run_variant(config: SpecServeConfig, prompt_ids: list[list[int]], mode: str, streams: int,
                      max_tokens: int, seed: int) -> Tally:
    """Every prompt once, streams at a time, with config's speculation settings."""
    draft, target = engines(config, streams)
    chooser = DepthChooser(config.speculation)
    tally, active = Tally(), [0]
    eos = target.scheduler.runner.eos_token_id
    params = SamplingParams(**MODES[mode], max_tokens=max_tokens, ignore_eos=True)

    async def one(index: int, ids: list[int]) -> None:
        active[0] += 1
        try:
            state = RequestState(f"r{index}", list(ids), params.model_copy(update={"seed": seed + index})
                                 if mode == "sampled" else params, eos_token_id=eos, max_context=4096)
            await decode(draft, target, chooser, state, lambda: active[0], tally)
        finally:
            active[0] -= 1

    queue = list(enumerate(prompt_ids))

    async def worker() -> None:
        while queue:
            index, ids = queue.pop(0)
            await one(index, ids)

    await asyncio.gather(*[worker() for _ in range(streams)])
    return tally


def measure(case: str, fan_out: int | None, prompts: str, max_tokens: int, seed: int) -> dict:
    """One case ("greedy:1": mode and streams) with this tree's code, the gates open."""
    mode, streams = case.split(":")
    streams = int(streams)
    if mode not in MODES or streams < 1:
        raise ValueError(f"a case is MODE:STREAMS with MODE one of {sorted(MODES)}, got {case!r}")
    torch.set_num_threads(1)
    config = SpecServeConfig()
    # Saguaro sampling on, as measured (the served default leaves it off: docs/speculation-cache.md).
    speculation = {"fan_out_max_batch": streams, "saguaro_downweight": SAGUARO_DOWNWEIGHT}
    if fan_out is not None:
        speculation["fan_out"] = fan_out
    config = config.model_copy(update={"speculation": config.speculation.model_copy(update=speculation)})
    tokenizer = AutoTokenizer.from_pretrained(config.resolved_tokenizer_path, local_files_only=True)
    prompt_ids = [tokenizer.encode(p.text, add_special_tokens=False) for p in load_prompt_set(prompts).prompts]
    tally = asyncio.run(run_variant(config, prompt_ids, mode, streams, max_tokens, seed))
    return {"case": case, "mode": mode, "streams": streams, "fan_out": config.speculation.fan_out, **tally.summary(),
            "median_request_hit_share": statistics.median(tally.per_request_hit_share)
            if tally.per_request_hit_share else None}


def measure_in(tree: str | None, args, case: str) -> dict:
    """measure(case) in a process of its own, with the code of tree (None: this one)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(tree).resolve()), env.get("PYTHONPATH", "")])
    # This file, run as a script: the driver stays this one, the engines are the tree's.
    command = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--prompts", args.prompts,
               "--max-tokens", str(args.max_tokens), "--seed", str(args.seed)]
    if args.fan_out is not None:
        command += ["--fan-out", str(args.fan_out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    lines = ["| case | code | fan-out | rounds | hits / rounds | hits / rounds that looked | acceptance "
             "| blocks pre-drafted / round | thrown away / output token |", "|---|---|---|---|---|---|---|---|---|"]
    for row in results:
        def fmt(key, digits=2):
            return "-" if row.get(key) is None else f"{row[key]:.{digits}f}"
        lines.append(f"| {row['case']} | {row['code']} | {row['fan_out']} | {row['rounds']} | "
                     f"{fmt('hit_share_of_rounds')} | {fmt('hit_share_of_looked')} | {fmt('acceptance')} | "
                     f"{fmt('blocks_predrafted_per_round', 1)} | {fmt('thrown_away_per_output_token')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.figures.cache_hits", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="greedy:1,sampled:1,greedy:4",
                        help="MODE:STREAMS, comma-separated; each runs in a process of its own")
    parser.add_argument("--case", help="run one case here and print its JSON (what --cases runs)")
    parser.add_argument("--baseline-tree", help="also run each case with the code of this source tree "
                                                "(e.g. `git archive main | tar -x -C DIR`), turn about")
    parser.add_argument("--prompts", default="thirdparty")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--fan-out", type=int, default=None, help="speculation.fan_out (default: the config's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=DEFAULT_OUT_DIR)
    parser.add_argument("--name", default=None, help="write <out>/<name>.json and .md")
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(measure(args.case, args.fan_out, args.prompts, args.max_tokens, args.seed)))
        return
    command = "python -m specserve.bench.figures.cache_hits " + " ".join(argv if argv is not None else sys.argv[1:])
    results = []
    for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
        trees = ([("baseline", args.baseline_tree)] if args.baseline_tree else []) + [("this", None)]
        for code, tree in trees:
            row = {"code": code, **measure_in(tree, args, case)}
            print(json.dumps(row), flush=True)
            results.append(row)
    report = {"command": command, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "machine": platform.node() and f"{os.cpu_count()} CPUs", "results": results}
    print(table(results))
    if args.name:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / f"{args.name}.md").write_text(
            f"# Speculation cache hits (engines in process)\n\n`{command}`\n\n{table(results)}\n")


if __name__ == "__main__":
    main()
