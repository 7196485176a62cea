"""Train the default draft/target pair from the stdlib corpus: tokenizer, target, distilled draft.

One run does three things, all deterministic given the seed:
1. a byte-level BPE tokenizer (``tokenizers``) shared by both models;
2. a Llama-architecture target trained on next-token cross-entropy;
3. a much smaller Llama draft trained *at the same time* on KL(p_target || q_draft) against the
   target's detached distributions (online distillation: it reuses the target forward that
   training already pays for), then a short pure-distillation phase against the final target;
and beside the draft its token map, the corpus's most frequent tokens (docs/token-map.md).
Distillation, not plain LM training, is what makes the draft agree with *this* target,
which is what speculative decoding's acceptance rate measures.

Checkpoints go to ``--work-dir`` every few minutes; rerunning the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.decoding.token_map import ranked_tokens, write_folder_map
from specserve.training.corpus import iter_stdlib_files, split_corpus

EOS_TOKEN = "<|endoftext|>"


@dataclass
class PairConfig:
    vocab_size: int = 8192
    seq_len: int = 256
    max_position_embeddings: int = 512
    target_hidden: int = 384
    target_layers: int = 8
    target_heads: int = 6
    target_intermediate: int = 1024
    draft_hidden: int = 192
    draft_layers: int = 2
    draft_heads: int = 3
    draft_intermediate: int = 512
    batch_size: int = 8
    joint_steps: int = 2000
    distill_steps: int = 400
    target_lr: float = 1e-3
    draft_lr: float = 2e-3
    warmup_steps: int = 100
    seed: int = 0
    token_map_size: int = 2048   # the draft's token map (docs/token-map.md measures this size)


def llama_config(cfg: PairConfig, hidden: int, layers: int, heads: int, intermediate: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """Byte-level BPE, saved as a PreTrainedTokenizerFast so AutoTokenizer loads it offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=512,
    )
    fast.save_pretrained(out_dir)
    return fast


def encode_files(tokenizer, texts: list[str]) -> torch.Tensor:
    """One long stream of token ids, files separated by EOS."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def sample_batch(stream: torch.Tensor, batch_size: int, seq_len: int, generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()]).long()


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def distill_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Forward KL(p_target || q_draft), averaged over positions."""
    target_logp = F.log_softmax(target_logits.float(), dim=-1)
    draft_logp = F.log_softmax(draft_logits.float(), dim=-1)
    return (target_logp.exp() * (target_logp - draft_logp)).sum(-1).mean()


def distill_step(draft, optimizer, inputs: torch.Tensor, target_logits: torch.Tensor, lr: float) -> torch.Tensor:
    """One AdamW step of the draft towards the target's distributions at lr; returns the KL."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = distill_loss(draft(inputs).logits, target_logits)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
    optimizer.step()
    return loss


@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor, seq_len: int, max_windows: int = 64) -> tuple[float | None, int]:
    """(mean next-token cross-entropy, windows used) over consecutive seq_len windows from the
    stream's start; (None, 0) when the stream is shorter than one window."""
    was_training = model.training
    model.eval()
    losses = []
    for start in range(0, min(len(stream) - seq_len - 1, max_windows * seq_len), seq_len):
        window = stream[start : start + seq_len + 1].long()[None]
        logits = model(window[:, :-1]).logits
        losses.append(F.cross_entropy(logits[0].float(), window[0, 1:]).item())
    model.train(was_training)
    return (sum(losses) / len(losses) if losses else None), len(losses)


def save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def build_pair(cfg: PairConfig):
    """Fresh (target, draft) models of the pair's architecture."""
    from transformers import LlamaForCausalLM

    target = LlamaForCausalLM(llama_config(cfg, cfg.target_hidden, cfg.target_layers, cfg.target_heads,
                                           cfg.target_intermediate))
    draft = LlamaForCausalLM(llama_config(cfg, cfg.draft_hidden, cfg.draft_layers, cfg.draft_heads,
                                          cfg.draft_intermediate))
    return target, draft


def save_pair(target, draft, tokenizer, out: Path) -> None:
    """Save both models in fp16 safetensors, each with the shared tokenizer beside it."""
    for name, model in (("target", target), ("draft", draft)):
        model.to(torch.float16).save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)


def export_checkpoint(work_dir: str | Path, out: str | Path, tokenizer_dir: str | Path) -> None:
    """Save the pair from a (possibly unfinished) training checkpoint, e.g. to try it early."""
    from transformers import AutoTokenizer

    state = torch.load(Path(work_dir) / "checkpoint.pt", weights_only=False, map_location="cpu")
    target, draft = build_pair(PairConfig())
    target.load_state_dict(state["target"])
    draft.load_state_dict(state["draft"])
    save_pair(target, draft, AutoTokenizer.from_pretrained(tokenizer_dir), Path(out))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/default")
    parser.add_argument("--work-dir", default=".train-work")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0 = default)")
    parser.add_argument("--joint-steps", type=int, default=PairConfig.joint_steps)
    parser.add_argument("--distill-steps", type=int, default=PairConfig.distill_steps)
    parser.add_argument("--batch-size", type=int, default=PairConfig.batch_size)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every-s", type=float, default=300.0)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = PairConfig(
        joint_steps=args.joint_steps,
        distill_steps=args.distill_steps,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    out, work = Path(args.out), Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)

    train_files, held_files = split_corpus(iter_stdlib_files())
    tokenizer_dir = out / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").exists():
        print(f"training tokenizer on {len(train_files)} files ...", flush=True)
        train_tokenizer([f.text for f in train_files], cfg.vocab_size, tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    stream_path = work / "streams.pt"
    if stream_path.exists():
        streams = torch.load(stream_path)
    else:
        streams = {
            "train": encode_files(tokenizer, [f.text for f in train_files]),
            "held_out": encode_files(tokenizer, [f.text for f in held_files]),
        }
        torch.save(streams, stream_path)
    train_stream, held_stream = streams["train"], streams["held_out"]
    print(f"corpus: {len(train_stream):,} train tokens, {len(held_stream):,} held-out tokens", flush=True)

    device = torch.device(args.device)
    target, draft = (model.to(device) for model in build_pair(cfg))
    target_opt = torch.optim.AdamW(target.parameters(), lr=cfg.target_lr, weight_decay=0.1, betas=(0.9, 0.95))
    draft_opt = torch.optim.AdamW(draft.parameters(), lr=cfg.draft_lr, weight_decay=0.1, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(cfg.seed)
    step, log = 0, []
    train_seconds: float | None = 0.0  # None when resumed from a checkpoint that did not track it
    checkpoint_path = work / "checkpoint.pt"
    if checkpoint_path.exists():
        state = torch.load(checkpoint_path, weights_only=False)
        target.load_state_dict(state["target"])
        draft.load_state_dict(state["draft"])
        target_opt.load_state_dict(state["target_opt"])
        draft_opt.load_state_dict(state["draft_opt"])
        generator.set_state(state["generator"])
        step, log = state["step"], state["log"]
        train_seconds = state.get("train_seconds")
        print(f"resumed at step {step}", flush=True)

    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    print(f"target {n_target / 1e6:.2f}M params, draft {n_draft / 1e6:.2f}M params", flush=True)
    total_steps = cfg.joint_steps + cfg.distill_steps
    started, last_checkpoint = time.time(), time.time()
    tokens_per_step = cfg.batch_size * cfg.seq_len
    progress = tqdm(total=total_steps, initial=step, desc="train", mininterval=10)
    while step < total_steps:
        batch = sample_batch(train_stream, cfg.batch_size, cfg.seq_len, generator).to(device)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        joint = step < cfg.joint_steps
        if joint:
            for group in target_opt.param_groups:
                group["lr"] = lr_at(step, cfg.joint_steps, cfg.target_lr, cfg.warmup_steps)
            target_logits = target(inputs).logits
            target_loss = F.cross_entropy(target_logits.flatten(0, 1).float(), labels.flatten())
            target_opt.zero_grad(set_to_none=True)
            target_loss.backward()
            torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
            target_opt.step()
            target_logits = target_logits.detach()
        else:
            with torch.no_grad():
                target.eval()
                target_logits = target(inputs).logits
            target_loss = torch.tensor(float("nan"))
        draft_loss = distill_step(draft, draft_opt, inputs, target_logits,
                                  lr_at(step, total_steps, cfg.draft_lr, cfg.warmup_steps))
        step += 1
        if step % 10 == 0:
            elapsed = time.time() - started
            record = {"step": step, "target_loss": target_loss.item(), "draft_kl": draft_loss.item()}
            log.append(record)
            progress.set_postfix(loss=f"{target_loss.item():.3f}", kl=f"{draft_loss.item():.3f}",
                                 tok_s=f"{tokens_per_step * 10 / max(elapsed, 1e-9):.0f}")
            started = time.time()
        progress.update(1)
        if time.time() - last_checkpoint > args.checkpoint_every_s or step == total_steps:
            if train_seconds is not None:
                train_seconds += time.time() - last_checkpoint
            save_checkpoint(checkpoint_path, {
                "train_seconds": train_seconds,
                "target": target.state_dict(), "draft": draft.state_dict(),
                "target_opt": target_opt.state_dict(), "draft_opt": draft_opt.state_dict(),
                "generator": generator.get_state(), "step": step, "log": log,
            })
            last_checkpoint = time.time()
    progress.close()

    target_held, _ = held_out_loss(target, held_stream.to(device), cfg.seq_len)
    draft_held, _ = held_out_loss(draft, held_stream.to(device), cfg.seq_len)
    save_pair(target, draft, tokenizer, out)
    write_folder_map(out / "draft", ranked_tokens(train_stream, cfg.token_map_size, len(tokenizer),
                                                  tokenizer.eos_token_id))
    summary = {
        "config": asdict(cfg),
        "target_params": n_target,
        "draft_params": n_draft,
        "train_tokens": int(len(train_stream)),
        "held_out_tokens": int(len(held_stream)),
        "tokens_seen": total_steps * tokens_per_step,
        "held_out_loss": {"target": target_held, "draft": draft_held},
        "held_out_perplexity": {"target": math.exp(target_held), "draft": math.exp(draft_held)},
        "device": str(device),
        "hardware": f"{platform.machine()} {os.cpu_count()} cores" + (
            f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""),
        "train_seconds": train_seconds,
        "torch_threads": torch.get_num_threads(),
        "log": log,
    }
    (out / "training.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "log"}, indent=1), flush=True)


if __name__ == "__main__":
    main()
