"""How often EAGLE-3 heads and the draft model guess the target's next token, by drafting depth.

    python -m specserve.bench.figures.head_agreement --head HEAD_DIR [--head HEAD_DIR ...] \\
        [--num-prompts 8] [--max-tokens 64] [--depths 4] --out bench/results --name NAME

On the target's own greedy continuations of held-out prompts (the text a drafter is asked about
when it serves): per drafter, the share of continuation positions where its top token at
drafting depth j (j tokens past the last committed one, fed the continuation's tokens, so every
earlier depth agreed) is the target's greedy token. A head's depths are computed as its training
computes them (training.train_eagle3.ttt_forward, which tests/test_eagle3.py checks equals
drafting); the draft model's top token at a position is the same at every depth, given the
tokens before it. From those, the tokens a greedy round of K drafts commits per target pass,
1 + a_1 + a_1 a_2 + ... (policies.acceptance). It takes a minute where head_vs_draft's rounds take many, so it says
whether a head is worth timing; what decides tokens/s is head_vs_draft.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.bench.figures.head_vs_draft import drafter_arguments, write_report
from specserve.decoding.eagle3_checkpoint import load_eagle3_head
from specserve.policies.acceptance import expected_tokens_by_position
from specserve.training.prompts import load_prompt_set, select_prompts
from specserve.training.train_eagle3 import target_features, ttt_forward


def continuation(target, prompt_ids: list[int], max_tokens: int) -> tuple[torch.Tensor, int]:
    """The prompt and the target's greedy continuation [1, P + max_tokens], and P."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        window = target.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return window, len(prompt_ids)


def by_depth(agreement: list[float], depths: int) -> tuple[float, ...]:
    """Agreement at depths 1..depths: the draft model's one figure holds at every depth."""
    return tuple(agreement[min(depth, len(agreement) - 1)] for depth in range(depths))


def head_drafts(head, aux_layers, target, window: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """Per depth j, the target id the head drafts at each row i of window [1, W]: token i + 2 + j,
    fed the window's tokens before it (rows whose token is in the window)."""
    features, _ = target_features(target, window[:, :-1], aux_layers)
    return [head.draft_to_target[logits[0].argmax(-1)] for logits in ttt_forward(head, features, window, depths)]


def measure(target, draft, heads: dict, prompts: list[list[int]], max_tokens: int, depths: int) -> dict:
    """-> {"positions": continuation positions drafted at depth 1, "agreement": per drafter and
    depth, "tokens_per_pass": per drafter and K}."""
    names = [*heads, "draft model"]
    hits = {name: [0] * (depths if name in heads else 1) for name in names}
    counted = {name: [0] * len(hits[name]) for name in names}
    with torch.no_grad():
        for prompt in prompts:
            window, prompt_len = continuation(target, prompt, max_tokens)
            greedy = target(window[:, :-1]).logits.argmax(-1)[0]    # row i: the target's token i + 1
            # Row i drafts token i + 2 + j at depth j. The prefill gives token prompt_len, so the
            # first drafted is prompt_len + 1: rows from prompt_len - 1 on.
            rows = torch.arange(prompt_len - 1, window.shape[1] - 2)
            for name, (head, aux_layers) in heads.items():
                for depth, drafted in enumerate(head_drafts(head, aux_layers, target, window, depths)):
                    kept = rows[rows < len(drafted)]
                    hits[name][depth] += int((drafted[kept] == greedy[kept + 1 + depth]).sum())
                    counted[name][depth] += len(kept)
            drafted = draft(window[:, :-1]).logits.argmax(-1)[0]
            hits["draft model"][0] += int((drafted[rows + 1] == greedy[rows + 1]).sum())
            counted["draft model"][0] += len(rows)
    agreement = {name: [round(h / n, 4) for h, n in zip(hits[name], counted[name])] for name in names}
    return {"positions": counted["draft model"][0], "agreement": agreement,
            "tokens_per_pass": {name: {k: round(expected_tokens_by_position(by_depth(a, depths), k), 3)
                                       for k in range(1, depths + 1)} for name, a in agreement.items()}}


def table(report: dict) -> str:
    depths = report["depths"]
    lines = [f"# {report['title']}", "", f"`{report['command']}`: {report['setting']}", "",
             "| drafter | " + " | ".join(f"agreement at depth {j + 1}" for j in range(depths))
             + f" | tokens per pass, greedy K = {depths} |", "|---" * (depths + 2) + "|"]
    for name, agreement in report["agreement"].items():
        cells = [str(a) for a in by_depth(agreement, depths)]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {report['tokens_per_pass'][name][depths]} |")
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
        heads[f"EAGLE-3 head {Path(folder).name}"] = (loaded.head.eval(), loaded.aux_layers)
    prompts = [tokenizer.encode(p.text, add_special_tokens=False)
               for p in select_prompts(load_prompt_set(args.prompts).prompts, args.num_prompts)]
    report = measure(target, draft, heads, prompts, args.max_tokens, args.depths)
    report.update(title="Drafters' agreement with the shipped target, by depth", depths=args.depths,
                  command="python -m specserve.bench.figures.head_agreement " + " ".join(sys.argv[1:] if argv is None else argv),
                  setting=f"the target's greedy continuations ({args.max_tokens} tokens) of {len(prompts)} "
                          f"{args.prompts} prompts, {report['positions']} positions; fp32, {args.threads} thread(s)")
    write_report(args, report, table(report))


if __name__ == "__main__":
    main()
