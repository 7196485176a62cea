"""Train an EAGLE-3 head for a target on the stdlib corpus (CPU or GPU; resumable).

The head (decoding.eagle3_head) learns the target's next-but-one distribution from the target's
own features, as EAGLE-3's "training-time test" does: step 0 reads the target's fused features
and the next token at every position of a window; step j reads the head's own pre-norm outputs
of step j - 1 at the same rows (the positions it would draft j tokens ahead) and attends to the
step-0 entries up to its row and to its own chain, exactly what drafting sees at inference
(decoding.eagle3_proposer). Each step's loss is KL(target || head) at its positions, weighted
down by depth. Tokens fed are the corpus's, or with --generated-share the target's own
continuations of corpus text in that share of the windows (the target's distributions are
computed on whichever is fed, so teacher and input agree). The head starts from the target's
final norm and lm_head (full vocabulary, d2t all zero) and drafts with the target's
embeddings; the embeddings and lm_head stay frozen (the head learns a hidden state the target's
own head reads, and on a CPU the lm_head's weight gradient would cost a third of a step).

Checkpoints go to --work-dir every few minutes; rerunning the same command resumes. --export
writes the head as a speculators-format folder (what `decoding.eagle3_checkpoint` reads);
docs/eagle3.md says when one is shipped.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specserve.decoding.eagle3_checkpoint import default_aux_layers, load_eagle3_head
from specserve.decoding.eagle3_head import Eagle3Head, Eagle3Shape, aux_features
from specserve.decoding.lean_forward import apply_rope, rope_signs
from specserve.decoding.token_map import frequent_tokens
from specserve.training.corpus import iter_stdlib_files, split_corpus
from specserve.training.default_pair import encode_files, lr_at, sample_batch, save_checkpoint


@dataclass
class HeadTrainingConfig:
    target: str = "models/default/target"
    work_dir: str = "/tmp/specserve-eagle3"
    steps: int = 3000
    batch_size: int = 8
    seq_len: int = 128
    ttt_steps: int = 3           # draft depths trained (1 + own-feature steps)
    step_decay: float = 0.8      # loss weight of depth j: decay ** j
    lr: float = 1e-3
    warmup: int = 50
    seed: int = 0
    device: str = "cpu"
    threads: int = 1
    checkpoint_every_s: float = 120.0
    draft_vocab: int = 0         # export drafting only the training stream's most frequent tokens (0: all)
    generated_share: float = 0.0  # share of a batch's windows whose second half the target writes (below)
    generated_temperature: float = 0.7


def new_head(target, aux_layers: tuple[int, int, int]) -> Eagle3Head:
    """A head shaped like the target's layers, its norm and lm_head copied from the target's."""
    config = target.config
    heads = config.num_attention_heads
    shape = Eagle3Shape(hidden_size=config.hidden_size, target_hidden_size=config.hidden_size,
                        intermediate_size=config.intermediate_size, num_heads=heads,
                        num_kv_heads=config.num_key_value_heads, head_dim=config.hidden_size // heads,
                        vocab_size=config.vocab_size, draft_vocab_size=config.vocab_size,
                        rms_norm_eps=config.rms_norm_eps, norm_before_residual=False, rope_config=config)
    head = Eagle3Head(shape, target.get_input_embeddings())
    with torch.no_grad():
        head.norm.copy_(target.model.norm.weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight)
    head.embed.requires_grad_(False)
    head.lm_head.requires_grad_(False)
    return head


def with_vocabulary(head: Eagle3Head, token_ids: torch.Tensor) -> Eagle3Head:
    """The head drafting only token_ids (ascending target ids): its lm_head's rows of them, its
    draft -> target map naming them, every other weight the head's. Its scores at those ids are
    the head's own; its q is theirs renormalised over them."""
    reduced = Eagle3Head(replace(head.shape, draft_vocab_size=len(token_ids)), head.embed)
    state = {name: tensor for name, tensor in head.state_dict().items()
             if not name.startswith(("lm_head.", "embed."))}
    reduced.load_state_dict(state, strict=False)
    with torch.no_grad():
        reduced.lm_head.weight.copy_(head.lm_head.weight[token_ids])
        reduced.draft_to_target.copy_(token_ids)
    return reduced


def trained_parameters(head: Eagle3Head) -> list[torch.nn.Parameter]:
    return [p for p in head.parameters() if p.requires_grad]


def ttt_loss(head: Eagle3Head, features: torch.Tensor, tokens: torch.Tensor, teacher_logits: torch.Tensor,
             ttt_steps: int, step_decay: float) -> tuple[torch.Tensor, list[float]]:
    """features [B, T, 3H] (the target's, positions 0..T-1), tokens [B, T + 1] (the window),
    teacher_logits [B, T, V] (the target's at positions 0..T-1): row i of step j is taught the
    target's row at position i + 1 + j. -> (weighted loss, per-step top-1 agreement with the target)."""
    total = features.new_zeros(())
    agreement = []
    for step, logits in enumerate(ttt_forward(head, features, tokens, ttt_steps)):
        teacher = teacher_logits[:, 1 + step:1 + step + logits.shape[1]].float().log_softmax(-1)
        student = logits.float().log_softmax(-1)
        total = total + step_decay ** step * (teacher.exp() * (teacher - student)).sum(-1).mean()
        agreement.append(float((logits.argmax(-1) == teacher.argmax(-1)).float().mean()))
    return total, agreement


def ttt_forward(head: Eagle3Head, features: torch.Tensor, tokens: torch.Tensor, ttt_steps: int) -> list[torch.Tensor]:
    """The head's scores at every depth over a window: features [B, T, 3H], tokens [B, T + 1].
    Row i of step j sits at position i + j, reads token i + 1 + j and the step-(j - 1) row i's
    pre-norm output (step 0: the target's fused feature at i), and attends to step-0 rows 0..i and
    its own chain (rows i of steps 1..j): what drafting j tokens ahead from committed position i
    computes. -> per step, logits [B, T - 1 - j, V] of the rows whose teacher position exists."""
    shape = head.shape
    batch, length = features.shape[:2]
    rows = length - 1
    hidden = head.fuse(features[:, :rows])
    groups = shape.num_heads // shape.num_kv_heads
    causal = torch.ones(rows, rows, dtype=torch.bool, device=features.device).tril()
    keys0 = values0 = None
    chain_keys, chain_values = [], []
    outputs = []
    for step in range(ttt_steps):
        valid = rows - step              # rows whose teacher position i + 1 + step < T
        token = tokens[:, 1 + step:1 + step + rows]
        if token.shape[1] < rows:
            token = F.pad(token, (0, rows - token.shape[1]))
        positions = torch.arange(step, step + rows, device=features.device)
        embeds = head._rms(head.embed(token).to(hidden.dtype), head.input_layernorm)
        normed = head._rms(hidden, head.hidden_norm)
        residual = normed if shape.norm_before_residual else hidden
        x = torch.cat([embeds, normed], dim=-1)
        q = head.q_proj(x).view(batch, rows, shape.num_heads, shape.head_dim).transpose(1, 2)
        k = head.k_proj(x).view(batch, rows, shape.num_kv_heads, shape.head_dim).transpose(1, 2)
        v = head.v_proj(x).view(batch, rows, shape.num_kv_heads, shape.head_dim).transpose(1, 2)
        cos, sin = head.rotary(x, positions.unsqueeze(0))
        cos, signed_sin = cos.unsqueeze(1), rope_signs(sin).unsqueeze(1)
        q, k = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scale = shape.head_dim ** -0.5
        if step == 0:
            keys0, values0 = k, v
        else:
            chain_keys.append(k)
            chain_values.append(v)
        scores = [(q @ keys0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        scores += [(q * key).sum(-1, keepdim=True) * scale for key in chain_keys]
        weights = torch.cat(scores, dim=-1).softmax(-1)
        attended = weights[..., :rows] @ values0
        for m, value in enumerate(chain_values):
            attended = attended + weights[..., rows + m:rows + m + 1] * value
        hidden = head.o_proj(attended.transpose(1, 2).reshape(batch, rows, -1)) + residual
        mlp_in = head._rms(hidden, head.post_attention_layernorm)
        hidden = hidden + head.down_proj(F.silu(head.gate_proj(mlp_in)) * head.up_proj(mlp_in))
        outputs.append(head.lm_head(head._rms(hidden[:, :valid], head.norm)))
    return outputs


def target_continuations(target, windows: torch.Tensor, keep: int, temperature: float,
                          generator: torch.Generator) -> torch.Tensor:
    """windows [B, T] with positions keep.. replaced by the target's own tokens, sampled at
    temperature from each window's first keep tokens (the target's KV cache, one token a step).

    Why: at serving time the head drafts continuations of the target's own output, which is
    likelier under the target than the corpus text is, so a head taught only on corpus windows
    under-learns exactly the text it is asked about (EAGLE trains on the target's own responses)."""
    written = [windows[:, :keep]]
    with torch.no_grad():
        for step in range(windows.shape[1] - keep):
            output = (target(written[-1], past_key_values=output.past_key_values, use_cache=True) if step
                      else target(written[0], use_cache=True))
            probs = (output.logits[:, -1].float() / temperature).softmax(-1)
            written.append(torch.multinomial(probs.cpu(), 1, generator=generator).to(windows.device))
    return torch.cat(written, dim=1)


def target_features(target, windows: torch.Tensor, aux_layers) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        output = target(windows, output_hidden_states=True)
    return aux_features(output.hidden_states, aux_layers), output.logits


def save_head(head: Eagle3Head, aux_layers, target_dir: str | Path, folder: str | Path) -> Path:
    """The head as a speculators-format folder (config.json + model.safetensors; the target's
    embeddings are not stored: the reader takes the target's)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    shape = head.shape
    layer = {key: target_config[key] for key in ("model_type", "hidden_size", "intermediate_size",
                                                 "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                                 "vocab_size", "max_position_embeddings", "hidden_act")
             if key in target_config}
    layer.update(num_hidden_layers=1, head_dim=shape.head_dim,
                 **{key: target_config[key] for key in ("rope_parameters", "rope_theta", "rope_scaling")
                    if key in target_config})
    config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
              "transformer_layer_config": layer, "draft_vocab_size": shape.draft_vocab_size,
              "norm_before_residual": shape.norm_before_residual, "target_hidden_size": shape.target_hidden_size,
              "eagle_aux_hidden_state_layer_ids": list(aux_layers),
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
                                     "verifier": {"name_or_path": str(target_dir),
                                                  "architectures": target_config.get("architectures")}},
              "torch_dtype": "float32"}
    names = {"input_layernorm": "layers.0.input_layernorm.weight", "hidden_norm": "layers.0.hidden_norm.weight",
             "post_attention_layernorm": "layers.0.post_attention_layernorm.weight",
             "q_proj.weight": "layers.0.self_attn.q_proj.weight", "k_proj.weight": "layers.0.self_attn.k_proj.weight",
             "v_proj.weight": "layers.0.self_attn.v_proj.weight", "o_proj.weight": "layers.0.self_attn.o_proj.weight",
             "gate_proj.weight": "layers.0.mlp.gate_proj.weight", "up_proj.weight": "layers.0.mlp.up_proj.weight",
             "down_proj.weight": "layers.0.mlp.down_proj.weight", "fc.weight": "fc.weight", "norm": "norm.weight",
             "lm_head.weight": "lm_head.weight"}
    state = head.state_dict()
    weights = {saved: state[own].detach().float().contiguous() for own, saved in names.items()}
    weights["d2t"] = (head.draft_to_target - torch.arange(shape.draft_vocab_size, device=head.draft_to_target.device)).cpu()
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def train(cfg: HeadTrainingConfig, export: str | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(cfg.threads)
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32).to(cfg.device).eval()
    target.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    aux_layers = default_aux_layers(target.config.num_hidden_layers)
    head = new_head(target, aux_layers).to(cfg.device)
    optimizer = torch.optim.AdamW(trained_parameters(head), lr=cfg.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(cfg.seed)
    checkpoint = work / "head.pt"
    log: list[dict] = []
    step = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=cfg.device, weights_only=False)
        head.load_state_dict(state["head"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        step, log = state["step"], state["log"]
        print(f"resumed at step {step}", flush=True)
    stream_path = work / "train_stream.pt"
    if stream_path.exists():
        stream = torch.load(stream_path)
    else:
        train_files, _ = split_corpus(iter_stdlib_files())
        stream = encode_files(tokenizer, [f.text for f in train_files])
        torch.save(stream, stream_path)
    head.train()
    last_saved = time.monotonic()
    started = time.monotonic()
    while step < cfg.steps:
        windows = sample_batch(stream, cfg.batch_size, cfg.seq_len, generator).to(cfg.device)
        generated = round(cfg.generated_share * cfg.batch_size)
        if generated:
            windows[:generated] = target_continuations(target, windows[:generated], windows.shape[1] // 2,
                                                       cfg.generated_temperature, generator)
        features, teacher = target_features(target, windows[:, :-1], aux_layers)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.steps, cfg.lr, cfg.warmup)
        loss, agreement = ttt_loss(head, features, windows, teacher, cfg.ttt_steps, cfg.step_decay)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained_parameters(head), 1.0)
        optimizer.step()
        step += 1
        if step % 10 == 0:
            entry = {"step": step, "loss": round(loss.item(), 4), "agreement": [round(a, 3) for a in agreement],
                     "s": round(time.monotonic() - started, 1)}
            log.append(entry)
            print(json.dumps(entry), flush=True)
        if time.monotonic() - last_saved > cfg.checkpoint_every_s or step == cfg.steps:
            save_checkpoint(checkpoint, {"head": head.state_dict(), "optimizer": optimizer.state_dict(),
                                         "generator": generator.get_state(), "step": step, "log": log})
            (work / "training.json").write_text(json.dumps({"config": asdict(cfg), "step": step, "log": log}))
            last_saved = time.monotonic()
    head.eval()
    if export:
        if cfg.draft_vocab:
            head = with_vocabulary(head, frequent_tokens(stream, cfg.draft_vocab, target.config.vocab_size))
        save_head(head, aux_layers, cfg.target, export)
        load_eagle3_head(export, target)   # what was written reads back as a head for this target
    return {"step": step, "log": log}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = HeadTrainingConfig()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--export", default=None, help="write the trained head here (speculators format)")
    args = vars(parser.parse_args(argv))
    export = args.pop("export")
    train(HeadTrainingConfig(**args), export)


if __name__ == "__main__":
    main()
