"""How often EAGLE-3 heads and the draft model guess the target's tokens, by drafting depth.

    python -m specserve.bench.figures.head_agreement --head HEAD_DIR [--head HEAD_DIR ...] \\
        [--num-prompts 8] [--max-tokens 64] [--depths 4] --out bench/results --name NAME

On the target's own greedy continuations of held-out prompts (the text a drafter is asked about
when it serves), a greedy round of K drafts from every position in turn, the tokens before it
committed: per drafter, the share of rounds whose draft at depth j is the target's token among
those that kept the drafts before it (acceptance by position, as the policies count it), and
the tokens a round commits a target pass (the bonus or corrected token included). A head's drafts
are computed as its training computes them (training.train_eagle3.ttt_forward; tests/test_eagle3.py
checks they are the tokens drafting proposes); the draft model's token at a position is its top
token given the tokens before it. Served rounds start only where the round before ended, often
just past a token the drafter missed, so they accept somewhat less than rounds from every
position. It takes a minute where head_vs_draft's rounds take many: a head worth timing there
has to pass the draft model here first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.bench.figures.head_vs_draft import drafter_arguments, head_name, write_report
from specserve.decoding.eagle3_checkpoint import load_eagle3_head
from specserve.decoding.eagle3_head import aux_features
from specserve.training.prompts import load_prompt_set, select_prompts
from specserve.training.train_eagle3 import ttt_forward


def continuation(target, prompt_ids: list[int], max_tokens: int) -> tuple[torch.Tensor, int]:
    """The prompt and the target's greedy continuation [1, P + max_tokens], and P."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        window = target.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return window, len(prompt_ids)


def head_drafts(head, features: torch.Tensor, window: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """Per depth j, the target id the head drafts at each row i of window [1, W]: token i + 2 + j,
    fed the window's tokens before it (rows whose token is in the window). features: the target's
    at the head's aux layers over window[:, :-1] (training.train_eagle3.target_features)."""
    return [head.draft_to_target[logits[0].argmax(-1)] for logits in ttt_forward(head, features, window, depths)]


def accepted_runs(right: torch.Tensor) -> torch.Tensor:
    """right [rounds, K] (is the drafter's token at depth j of each round the target's?) -> the
    tokens each greedy round accepts: its leading run of right tokens."""
    return right.int().cumprod(dim=1).sum(dim=1)


def measure(target, draft, heads: dict, prompts: list[list[int]], max_tokens: int, depths: int) -> dict:
    """A round of `depths` drafts starting at every continuation position in turn (the tokens
    before it committed, as greedy rounds commit the target's tokens) -> {"rounds": how many,
    "acceptance": per drafter, the share of rounds that accept depth j among those that accepted
    depth j - 1, "tokens_per_pass": per drafter and K, 1 + the mean tokens a round of K accepts}."""
    names = [*heads, "draft model"]
    runs: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    with torch.no_grad():
        for prompt in prompts:
            window, prompt_len = continuation(target, prompt, max_tokens)
            output = target(window[:, :-1], output_hidden_states=True)   # one forward: every head's features
            greedy = output.logits.argmax(-1)[0]    # greedy[t - 1]: the target's token t
            # A round's first draft is token t: the prefill gives token prompt_len, so t from
            # prompt_len + 1, and up to where all its depths are in the window.
            firsts = torch.arange(prompt_len + 1, window.shape[1] - depths + 1)
            for name, (head, aux_layers) in heads.items():
                drafts = head_drafts(head, aux_features(output.hidden_states, aux_layers), window,
                                     depths)   # row t - 2 drafts token t
                right = torch.stack([drafts[j][firsts - 2] == greedy[firsts - 1 + j] for j in range(depths)], dim=1)
                runs[name].append(accepted_runs(right))
            drafted = draft(window[:, :-1]).logits.argmax(-1)[0]     # the draft model's token t: drafted[t - 1]
            right = torch.stack([drafted[firsts - 1 + j] == greedy[firsts - 1 + j] for j in range(depths)], dim=1)
            runs["draft model"].append(accepted_runs(right))
    accepted = {name: torch.cat(found) for name, found in runs.items()}
    acceptance = {name: [round(float((run > j).sum() / max(1, int((run >= j).sum()))), 4) for j in range(depths)]
                  for name, run in accepted.items()}
    tokens = {name: {k: round(1 + float(run.clamp(max=k).float().mean()), 3) for k in range(1, depths + 1)}
              for name, run in accepted.items()}
    return {"rounds": len(accepted["draft model"]), "acceptance": acceptance, "tokens_per_pass": tokens}


def table(report: dict) -> str:
    depths = report["depths"]
    lines = [f"# {report['title']}", "", f"`{report['command']}`: {report['setting']}", "",
             "| drafter | " + " | ".join(f"acceptance at depth {j + 1}" for j in range(depths))
             + f" | tokens per pass, greedy K = {depths} |", "|---" * (depths + 2) + "|"]
    for name, acceptance in report["acceptance"].items():
        lines.append(f"| {name} | " + " | ".join(map(str, acceptance))
                     + f" | {report['tokens_per_pass'][name][depths]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = drafter_arguments(argparse.ArgumentParser(prog="python -m specserve.bench.figures.head_agreement",
                                                       description=__doc__.splitlines()[0]))
    parser.add_argument("--depths", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = Path(args.models)
    target = AutoModelForCausalLM.from_pretrained(models / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(models / "draft", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(models / "target")
    heads = {}
    for folder in args.head:
        loaded = load_eagle3_head(folder, target)
        heads[head_name(folder)] = (loaded.head.eval(), loaded.aux_layers)
    prompts = [tokenizer.encode(p.text, add_special_tokens=False)
               for p in select_prompts(load_prompt_set(args.prompts).prompts, args.num_prompts)]
    report = measure(target, draft, heads, prompts, args.max_tokens, args.depths)
    arguments = sys.argv[1:] if argv is None else argv
    report.update(title="Drafters' acceptance by depth, rounds from every position of the target's own text",
                  depths=args.depths, command="python -m specserve.bench.figures.head_agreement " + " ".join(arguments),
                  setting=f"the target's greedy continuations ({args.max_tokens} tokens) of {len(prompts)} "
                          f"{args.prompts} prompts, a greedy round of {args.depths} drafts from each of "
                          f"{report['rounds']} positions; fp32, {args.threads} thread(s)")
    write_report(args, report, table(report))


if __name__ == "__main__":
    main()
