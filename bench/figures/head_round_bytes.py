"""Bytes a greedy round puts on the channels, with a draft model and with an EAGLE-3 head at a real
target's width.

A round of the shipped pair runs in process on the engines (deployments/draft_worker.py,
target_worker.py) as the router runs it, and its four messages are encoded as the channels encode
them (common/channel.encode_frame): the propose and its answer, the verify and its answer. With a
head for a draft, the verify's answer also carries the target's features of every position its
forward computed, and the next propose those of the positions committed since the last one
([tokens, 3 x hidden], the model's dtype: decoding.target_features.TargetFeatures); they are laid
into the same frames at the width named (Llama-3.1-8B: 4,096; Llama-3.1-70B: 8,192; bfloat16).
Everything else in the frames is the round's own.

    python -m specserve.bench.figures.head_round_bytes --out bench/results --name NAME
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoTokenizer

from specserve.bench import DEFAULT_OUT_DIR
from specserve.bench.figures.cache_hits import engines
from specserve.common.channel import encode_frame
from specserve.common.config import SpecServeConfig
from specserve.common.messages import ChannelCall, ChannelReply
from specserve.decoding.target_features import TargetFeatures
from specserve.decoding.proposers import Proposal
from specserve.decoding.sampling import SamplingParams, draft_seed
from specserve.decoding.sequence import RequestState
from specserve.decoding.speculation import accept_round
from specserve.deployments.committed_history import HistorySender, RunningDigest
from specserve.training.prompts import load_prompt_set

NUM_DRAFT = 4
WIDTHS = {"Llama-3.1-8B": 4096, "Llama-3.1-70B": 8192}
AUX_LAYERS = 3


async def round_messages(config: SpecServeConfig, prompt_ids: list[int],
                         params: SamplingParams = SamplingParams(temperature=0.0, max_tokens=64)) -> dict:
    """One request's prefill and first speculative round, K = NUM_DRAFT (greedy unless params say
    otherwise): the second round's propose and verify calls with their answers (the first propose
    carries the prompt), and how many positions the verify computed and the round committed."""
    draft, target = engines(config, 1)
    state = RequestState("r", list(prompt_ids), params, eos_token_id=None, max_context=4096)
    digest = RunningDigest()
    to_draft, to_target = HistorySender(digest), HistorySender(digest)
    rows, _ = await target.verify("r", to_target.update(state), None, params, state.next_output_index)
    accept_round(state, Proposal([], None), rows)
    messages = {}
    for _ in range(2):
        committed_before = len(state.history)
        # DraftEngine.propose's arguments by name, in its order: the channel sends them positionally.
        propose_args = {"seq_id": "r", "history": to_draft.update(state), "num_tokens": NUM_DRAFT,
                        "params": params, "seed": draft_seed(params.seed), "prompt_len": len(prompt_ids), "fan_out": (),
                        "features": None, "predraft_tokens": 0}
        proposal, span = await draft.propose(**propose_args)
        verify_args = ("r", to_target.update(state), proposal, params, state.next_output_index, None, None,
                       config.speculation.verification, None)
        verified = await target.verify(*verify_args)
        accept_round(state, proposal, verified[0])
        messages = {"propose": propose_args, "proposal": (proposal, span), "verify": verify_args,
                    "verdict": verified, "computed": len(proposal.token_ids) + 1,
                    "committed": len(state.history) - committed_before}
    await draft.release("r")
    await target.release("r")
    return messages


def frame_bytes(messages: dict, width: int | None) -> dict[str, int]:
    """Each message's frame, with the head's features at this width laid in (None: a draft model)."""
    propose, verdict = messages["propose"], messages["verdict"]
    if width is not None:
        def features(tokens: int) -> TargetFeatures:
            return TargetFeatures(0, torch.zeros(tokens, AUX_LAYERS * width, dtype=torch.bfloat16))

        # The next propose carries the committed positions' features: as many as this round commits.
        propose = {**propose, "features": features(messages["committed"])}
        rows, span = verdict
        verdict = (rows, replace(span, features=features(messages["computed"])))
    frames = {"propose": ChannelCall(1, "propose", tuple(propose.values())), "proposal": ChannelReply(1, messages["proposal"]),
              "verify": ChannelCall(2, "verify", messages["verify"]), "verdict": ChannelReply(2, verdict)}
    sizes = {name: len(encode_frame((message,))) for name, message in frames.items()}
    sizes["total"] = sum(sizes.values())
    return sizes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.figures.head_round_bytes",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT_DIR)
    parser.add_argument("--name", default="head-round-bytes")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = SpecServeConfig()
    tokenizer = AutoTokenizer.from_pretrained(config.resolved_tokenizer_path, local_files_only=True)
    prompt_ids = tokenizer.encode(load_prompt_set("thirdparty").prompts[0].text, add_special_tokens=False)
    messages = asyncio.run(round_messages(config, prompt_ids))
    rows = {"draft model (the shipped pair)": frame_bytes(messages, None)}
    for model, width in WIDTHS.items():
        rows[f"EAGLE-3 head, features at {model} width ({width}, bfloat16)"] = frame_bytes(messages, width)
    lines = [f"# Bytes per greedy round on the channels (K = {NUM_DRAFT})", "",
             f"`python -m specserve.bench.figures.head_round_bytes --out {args.out} --name {args.name}`", "",
             f"One round of the shipped pair on the first third-party prompt: the verify computed "
             f"{messages['computed']} positions and the round committed {messages['committed']} tokens; "
             "each message's frame as the channels send it (8-byte length + pickle).", "",
             "| draft | propose | proposal (answer) | verify | verdict (answer) | total |", "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {s['propose']} B | {s['proposal']} B | {s['verify']} B | {s['verdict']} B | {s['total']} B |"
              for name, s in rows.items()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{args.name}.json").write_text(json.dumps({"computed": messages["computed"],
                                                       "committed": messages["committed"], "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
