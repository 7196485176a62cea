"""Distil the draft further against a fixed, trained target on the target's *own* generations.

    .venv/bin/specserve distill-draft                 # models/default/draft, in place; resumable
    .venv/bin/specserve distill-draft --from-capture DIR --out NEW_DRAFT   # on a server's captures

Speculative decoding accepts a draft token when it matches what the target would say *while the
target is generating*, so the draft is best trained where that happens: on continuations the
target writes itself (greedy and sampled, from prompts cut out of the training split), with the
forward KL to the target's distributions at every position, mixed with plain corpus windows so it
still covers the prompts users send. This is the "teacher-generated data" recipe of DistillSpec
(Zhou et al., 2023) and of the self-distillation used to train Medusa/EAGLE heads. The target is
never changed: only the draft's weights are rewritten.

Deterministic given the seed. The teacher data is generated once and cached in ``--work-dir``;
checkpoints go there every few minutes and rerunning the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.decoding.sampling import SamplingParams, logits_to_probs, sample_from_probs
from specserve.training.corpus import iter_stdlib_files, split_corpus
from specserve.training.default_pair import distill_step, encode_files, held_out_loss, lr_at, sample_batch, save_checkpoint


@dataclass
class DistillConfig:
    prompt_tokens: int = 64        # eval prompts are 200-300 characters, ~60-90 tokens
    new_tokens: int = 128
    greedy_sequences: int = 768    # target continuations at temperature 0 ...
    sampled_sequences: int = 768   # ... and at temperature 0.8 (the sampled-acceptance setting)
    temperature: float = 0.8
    generate_batch: int = 64
    steps: int = 2000
    batch_size: int = 8
    corpus_every: int = 3          # every n-th step trains on a plain corpus window instead
    lr: float = 1e-3
    warmup_steps: int = 50
    seed: int = 0


@torch.no_grad()
def teacher_continuations(target, stream: torch.Tensor, count: int, cfg: DistillConfig,
                          temperature: float, generator: torch.Generator, desc: str) -> torch.Tensor:
    """[count, prompt_tokens + new_tokens] token ids: random training-split prompts, each
    continued by the target (greedy when temperature is 0). All prompts have the same length,
    so batches need no padding and every row is a real prefix the target saw."""
    params = SamplingParams(temperature=temperature)
    rows = []
    progress = tqdm(total=count, desc=desc, mininterval=10)
    for done in range(0, count, cfg.generate_batch):
        n = min(cfg.generate_batch, count - done)
        ids = sample_batch(stream, n, cfg.prompt_tokens - 1, generator).to(target.device)
        cache, next_input = None, ids
        for _ in range(cfg.new_tokens):
            out = target(next_input, past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1].float()
            if params.is_greedy:
                token = logits.argmax(-1, keepdim=True)
            else:
                # sampled on the CPU so the seeded CPU generator reproduces on any device
                token = sample_from_probs(logits_to_probs(logits, params).cpu(), generator)[:, None].to(target.device)
            ids = torch.cat([ids, token], dim=1)
            next_input = token
        rows.append(ids.cpu())
        progress.update(n)
    progress.close()
    return torch.cat(rows)


@torch.no_grad()
def agreement_on(draft, sequences: torch.Tensor, start: int) -> float:
    """Fraction of positions >= start where the draft's argmax equals the token that follows
    (the target's own choice when the rows are greedy target continuations)."""
    agreed = total = 0
    for batch in sequences.split(32):
        batch = batch.to(draft.device)
        predicted = draft(batch[:, :-1]).logits[:, start - 1 :].argmax(-1)
        agreed += int((predicted == batch[:, start:]).sum())
        total += predicted.numel()
    return agreed / max(total, 1)


def tokens_seen(cfg: DistillConfig) -> int:
    """Input tokens the draft trained on: teacher rows feed prompt + new - 1 tokens, the corpus
    windows of every corpus_every-th step one more."""
    corpus_steps = cfg.steps // cfg.corpus_every
    return cfg.batch_size * (cfg.steps * (cfg.prompt_tokens + cfg.new_tokens - 1) + corpus_steps)


def make_teacher_data(target, tokenizer, cfg: DistillConfig, generator: torch.Generator) -> dict:
    """Token streams of both corpus splits, the target's greedy and sampled continuations of
    training prompts, and greedy continuations of held-out prompts (only ever measured)."""
    train_files, held_files = split_corpus(iter_stdlib_files())
    train_stream, held_stream = (encode_files(tokenizer, [f.text for f in files]).long()
                                 for files in (train_files, held_files))
    return {
        "train_stream": train_stream,
        "held_stream": held_stream,
        "greedy": teacher_continuations(target, train_stream, cfg.greedy_sequences, cfg, 0.0,
                                        generator, "teacher greedy"),
        "sampled": teacher_continuations(target, train_stream, cfg.sampled_sequences, cfg,
                                         cfg.temperature, generator, "teacher sampled"),
        "held_greedy": teacher_continuations(target, held_stream, 64, cfg, 0.0,
                                             torch.Generator().manual_seed(cfg.seed + 1), "held-out greedy"),
    }


def distill(draft, target, data: dict, cfg: DistillConfig, generator: torch.Generator,
            checkpoint_path: Path, checkpoint_every_s: float) -> dict:
    """Train the draft in place; resume from checkpoint_path when it exists. Returns the run's
    record (log, wall seconds, agreement before training)."""
    teacher = torch.cat([data["greedy"], data["sampled"]])
    optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95))
    run = {"step": 0, "log": [], "train_seconds": 0.0}
    if checkpoint_path.exists():
        state = torch.load(checkpoint_path, weights_only=False)
        draft.load_state_dict(state.pop("draft"))
        optimizer.load_state_dict(state.pop("optimizer"))
        generator.set_state(state.pop("generator"))
        run = state
        print(f"resumed at step {run['step']}", flush=True)
    else:
        run["agreement_before"] = agreement_on(draft.eval(), data["held_greedy"], cfg.prompt_tokens)
    print(f"held-out greedy agreement before: {run['agreement_before']:.3f}", flush=True)

    draft.train()
    progress = tqdm(total=cfg.steps, initial=run["step"], desc="distill", mininterval=10)
    last_checkpoint = started = time.time()
    tokens = 0
    while run["step"] < cfg.steps:
        step = run["step"]
        if step % cfg.corpus_every == cfg.corpus_every - 1:
            batch = sample_batch(data["train_stream"], cfg.batch_size, cfg.prompt_tokens + cfg.new_tokens, generator)
        else:
            batch = teacher[torch.randint(0, len(teacher), (cfg.batch_size,), generator=generator)]
        inputs = batch[:, :-1].to(draft.device)
        with torch.no_grad():
            target_logits = target(inputs).logits
        loss = distill_step(draft, optimizer, inputs, target_logits, lr_at(step, cfg.steps, cfg.lr, cfg.warmup_steps))
        run["step"] = step = step + 1
        tokens += inputs.numel()
        if step % 10 == 0:
            run["log"].append({"step": step, "draft_kl": loss.item()})
            progress.set_postfix(kl=f"{loss.item():.3f}", tok_s=f"{tokens / (time.time() - started):.0f}")
        progress.update(1)
        if time.time() - last_checkpoint > checkpoint_every_s or step == cfg.steps:
            run["train_seconds"] += time.time() - last_checkpoint
            last_checkpoint = time.time()
            save_checkpoint(checkpoint_path, {**run, "draft": draft.state_dict(),
                                              "optimizer": optimizer.state_dict(),
                                              "generator": generator.get_state()})
    progress.close()
    return run


def main(argv: list[str] | None = None) -> None:
    if any(arg.startswith("--from-capture") for arg in (sys.argv[1:] if argv is None else argv)):  # served traffic's captures instead
        from specserve.training.capture_distill import main as distill_captures

        return distill_captures(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="models/default", help="folder with target/, draft/, training.json")
    parser.add_argument("--work-dir", default=".distill-work")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0 = default)")
    parser.add_argument("--steps", type=int, default=DistillConfig.steps)
    parser.add_argument("--greedy-sequences", type=int, default=DistillConfig.greedy_sequences)
    parser.add_argument("--sampled-sequences", type=int, default=DistillConfig.sampled_sequences)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every-s", type=float, default=300.0)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = DistillConfig(steps=args.steps, greedy_sequences=args.greedy_sequences,
                        sampled_sequences=args.sampled_sequences, seed=args.seed)
    models, work = Path(args.models), Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    target = AutoModelForCausalLM.from_pretrained(models / "target", dtype=torch.float32).to(args.device).eval()
    draft = AutoModelForCausalLM.from_pretrained(models / "draft", dtype=torch.float32).to(args.device)
    tokenizer = AutoTokenizer.from_pretrained(models / "target")

    data_path = work / "teacher.pt"
    if data_path.exists():
        data = torch.load(data_path)
    else:
        data = make_teacher_data(target, tokenizer, cfg, generator)
        torch.save(data, data_path)
    run = distill(draft, target, data, cfg, generator, work / "checkpoint.pt", args.checkpoint_every_s)

    draft.eval()
    agreement_after = agreement_on(draft, data["held_greedy"], cfg.prompt_tokens)
    draft_held, _ = held_out_loss(draft, data["held_stream"].to(draft.device), 256)
    print(f"held-out greedy agreement after: {agreement_after:.3f}; held-out loss {draft_held:.3f}", flush=True)
    draft.to(torch.float16).save_pretrained(models / "draft")
    tokenizer.save_pretrained(models / "draft")

    training_path = models / "training.json"
    training = json.loads(training_path.read_text())
    training["draft_distillation"] = {
        "config": asdict(cfg),
        "teacher_sequences": len(data["greedy"]) + len(data["sampled"]),
        "tokens_seen": tokens_seen(cfg),
        "held_out_greedy_agreement": {"before": run["agreement_before"], "after": agreement_after},
        "draft_held_out_loss": draft_held,
        "draft_held_out_perplexity": math.exp(draft_held),
        "train_seconds": round(run["train_seconds"]),
        "hardware": f"{os.uname().machine}, {os.cpu_count()} CPU cores" + (
            f", {torch.cuda.get_device_name(draft.device)}" if draft.device.type == "cuda" else ""),
        "torch_threads": torch.get_num_threads(),
        "log": run["log"],
    }
    training["held_out_loss"]["draft"] = draft_held
    training["held_out_perplexity"]["draft"] = math.exp(draft_held)
    training_path.write_text(json.dumps(training, indent=1))


if __name__ == "__main__":
    main()
