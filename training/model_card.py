"""The default pair's model card (models/default/README.md), rendered from evaluation.json and
training.json alone, so `specserve eval-pair --card-only` re-renders it without measuring again."""

from __future__ import annotations

import math

from specserve.training.corpus import HELD_OUT_EVERY

CARD_COMMAND = ".venv/bin/specserve eval-pair --card"
ACCEPTANCE_THRESHOLD = 0.6  # the bar: greedy per-token acceptance at K=4 on held-out prompts
DEFAULT_NUM_PROMPTS = 16  # a full evaluation; fewer prompts or tokens mark the card preliminary
DEFAULT_MAX_TOKENS = 96
# How evaluations before prompt sets (evaluation.json without settings.prompt_set) chose prompts.
LINE_CHUNK_PROMPTS = (
    "On the first {num_prompts} held-out prompts: held-out files cut at line starts into chunks of\n"
    "{min_chars}-{max_chars} characters that start on a non-blank line and end at a line boundary "
    "(newline dropped), in a\nfixed pseudo-random order (SHA-256 of `path:line`), i.e. a uniform sample "
    "of held-out code.")


CARD_TEMPLATE = """\
# specserve default pair: `target` + `draft`

A tiny Python-code **target** language model and a much smaller **draft** distilled from it, the
default pair of specserve's lossless speculative decoding. The draft only proposes tokens; every
token served is verified by the target, so outputs follow the target's distribution exactly
(greedy outputs are identical to plain target decoding). What the draft buys is speed: the
fraction of its guesses the target accepts.

> The numbers below are filled in by `training/evaluate.py` from `evaluation.json` and
> `training.json`. Rerun the evaluation and refresh this card with
> `{command}` (it took {eval_time} last time, {eval_threads} CPU thread(s)); `--card-only` re-renders it
> from the existing `evaluation.json`. Last evaluated {created} on {eval_cpu}.
{status_note}
## Summary

| | value |
|---|---|
| greedy per-token acceptance, K=4 (bar: >= {threshold:.2f}) | **{k4_acceptance}** ({criterion}) |
| greedy mean tokens per target pass, K=4 / K=8 | {k4_tpp} / {k8_tpp} |
| greedy per-token acceptance, K=8 | {k8_acceptance} |
| sampled (T={temperature}) per-token acceptance, K={sampled_k} | {sampled_acceptance} |
| greedy agreement (draft argmax = target greedy token) | {agreement} |
| held-out loss / perplexity, target | {target_loss} / {target_ppl} |
| held-out loss / perplexity, draft | {draft_loss} / {draft_ppl} |
| per-step CPU latency, target / draft (1 token, context {latency_context}) | {target_ms} ms / {draft_ms} ms (ratio {latency_ratio}) |

## Files

- `target/`, `draft/`: Hugging Face `LlamaForCausalLM` checkpoints (fp16 safetensors), each with
  the shared tokenizer beside it; load them with `AutoModelForCausalLM.from_pretrained(path)`.
- `tokenizer/`: the tokenizer alone. `training.json`: training config, parameter counts, tokens,
  held-out loss, loss log. `evaluation.json`: everything measured below, with the prompts.
- `draft/token_map.json`: the 2048 most frequent tokens of the training corpus, which the served
  draft scores alone in greedy steps (`draft.token_map: auto`, docs/token-map.md; written by
  `python -m specserve.training.token_map --tokenizer models/default/tokenizer --size 2048 --out
  models/default/draft/token_map.json`).

## Training data

The `.py` files of the Python {python} standard library that the training interpreter ships
(`{stdlib_root}`): {files} files after skipping `test`/`tests` packages, `site-packages` and files
over 200 kB, nothing downloaded. A file is **held out** when {held_out_rule} (one in
{held_out_every}): {train_files} training files ({train_tokens} tokens), {held_out_files} held-out
files ({held_out_tokens} tokens), never seen in training. Files are joined into one stream,
separated by `<|endoftext|>`.

## Tokenizer

Byte-level BPE (Hugging Face `tokenizers`) trained on the training files only, vocabulary
{vocab_size} including the single special token `<|endoftext|>` (id 0: BOS, EOS and padding).
Byte-level, so any text round-trips.

## Architecture

Both are Llama decoders (RMSNorm, SwiGLU MLP, rotary positions, tied input/output embeddings),
sharing the tokenizer so draft tokens are target tokens.

| | target | draft |
|---|---|---|
| parameters | {target_params} | {draft_params} |
| hidden size | {target_hidden} | {draft_hidden} |
| layers | {target_layers} | {draft_layers} |
| attention heads | {target_heads} | {draft_heads} |
| MLP size | {target_intermediate} | {draft_intermediate} |
| context (positions) | {target_context} | {draft_context} |

## Training recipe

`.venv/bin/specserve train-default` (`training/default_pair.py`), deterministic given the seed
({seed}), resumable from `.train-work/`:

1. **Joint phase**, {joint_steps} steps: each step the target takes an AdamW step on next-token
   cross-entropy (peak lr {target_lr}), and the draft, in the same step and on the same batch, an
   AdamW step on the forward KL(p_target || q_draft) against the target's *detached* logits
   (peak lr {draft_lr}): online distillation that reuses the target forward training already pays for.
2. **Distillation phase**, {distill_steps} steps: the target is frozen and the draft keeps
   distilling from it, so it matches the *final* target rather than its earlier selves.
{distillation_step}

Batches of {batch_size} random windows of {seq_len} tokens; warmup {warmup_steps} steps then cosine
decay to 10 %; weight decay 0.1, gradient clipping 1.0. Tokens seen: {tokens_seen} per model.
Final logged training loss: target {final_target_loss}, draft KL {final_draft_kl}.
Training wall time: {train_wall}. Hardware: {train_hardware}.

## Evaluation

{prompt_description} Each
prompt is continued for up to {max_tokens} tokens, fp32 on CPU, {threads} torch thread(s).

| decoding | K | per-token acceptance | mean tokens / target pass | P(accept \\| earlier accepted) | output = target greedy |
|---|---|---|---|---|---|
{spec_rows}

- *per-token acceptance* = accepted draft tokens / drafted tokens (the issue's metric);
  *tokens per target pass* counts the prefill pass too; *P(accept | earlier accepted)* is
  accepted / (accepted + rejections), the per-position acceptance. Greedy agreement along the
  target's own greedy continuations: {agreement} ({agreement_positions} positions).
- Sampled: T={temperature}, no top-k/top-p, seed {eval_seed} + prompt index. The speculative
  output still follows the target's T={temperature} distribution exactly (rejection sampling).
- Held-out loss (nats/token) over {loss_windows} consecutive {loss_seq_len}-token windows from
  the start of the held-out stream. {held_out_detail}
- Per-step latency: one single-token forward through `decoding.model_runner.ModelRunner` on top of a
  warm KV cache of {latency_context} tokens (including the cache rollback a speculative step does),
  fp32, {latency_threads} thread, median of {latency_steps} steps: target {target_ms} ms
  (p10-p90 {target_p10}-{target_p90}), draft {draft_ms} ms (p10-p90 {draft_p10}-{draft_p90});
  draft/target cost ratio {cost_ratio}. Measured on {eval_cpu} ({eval_cpus} cores, shared);
  wall-clock numbers move with machine load.

## Sample completions

Target alone, greedy, up to {sample_tokens} tokens (speculative decoding gives the same text):

{samples}

## License

Trained on the source code of the Python standard library, distributed under the Python Software
Foundation License; the weights are a derivative of that code and are shipped for testing and
demonstrating specserve. The models can reproduce fragments of that PSF-licensed code.

## Limitations

- Tiny ({target_params_short} / {draft_params_short} parameters) and trained on CPU for minutes to hours: expect
  plausible-looking but frequently wrong Python, repetition and invented names. Not for any real use.
- Code only: trained on the standard library, nothing else; prose, other languages and chat
  prompts are out of distribution.
- Context {target_context} positions but trained on {seq_len}-token windows: quality beyond ~{seq_len}
  tokens of context is untested.
- Acceptance depends on the text: repetitive code (tables, boilerplate) is accepted far more
  often than novel logic, so the per-prompt spread is large. The target's greedy output often
  falls into loops (see the samples), which a draft trained on its continuations predicts well:
  greedy acceptance here is higher than a stronger, less repetitive target would see with a
  draft this small; the sampled row is the more conservative figure.
"""


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return "n/a"
        return f"{value:.{digits}f}"
    return str(value)


def _count(value) -> str:
    return "n/a" if value is None else f"{int(value):,}"


def _short(params) -> str:
    if params is None:
        return "n/a"
    return f"{params / 1e6:.1f}M"


def _duration(seconds) -> str | None:
    if seconds is None:
        return None
    seconds = float(seconds)
    hours, rest = divmod(int(round(seconds)), 3600)
    minutes = rest // 60
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _fence(text: str) -> str:
    return "````" if "```" in text else "```"


def _samples_markdown(samples: list[dict]) -> str:
    blocks = []
    for sample in samples:
        prompt_lines = sample["prompt"].count("\n") or 1
        source = f" (from `{sample['source']}`)" if sample.get("source") else ""
        body = sample["prompt"] + sample["completion"]
        fence = _fence(body)
        blocks.append(f"**{sample['name']}**{source}: the first {prompt_lines} line(s) are the prompt, "
                      f"then {sample['tokens']} generated tokens.\n\n{fence}python\n{body.rstrip()}\n{fence}")
    return "\n\n".join(blocks)


def _distillation_step(training: dict) -> str:
    """The card's third recipe step, from training.json's ``draft_distillation`` (written by
    training/distill.py); empty when the draft was never distilled on target generations."""
    run = training.get("draft_distillation")
    if not run:
        return ""
    cfg, agreement = run["config"], run["held_out_greedy_agreement"]
    return (
        f"3. **On-policy distillation**, {_count(cfg['steps'])} steps (`.venv/bin/specserve distill-draft`, "
        f"`training/distill.py`, resumable from `.distill-work/`): the target writes its own continuations "
        f"of {cfg['prompt_tokens']}-token prompts cut from the training files, "
        f"{_count(cfg['greedy_sequences'])} greedy and {_count(cfg['sampled_sequences'])} sampled at "
        f"T={cfg['temperature']}, {cfg['new_tokens']} tokens each, and the draft learns the forward KL to the "
        f"target's distributions along them (one batch in {cfg['corpus_every']} is a plain corpus window"
        f"; batch {cfg['batch_size']}, peak lr {cfg['lr']}, cosine). Speculative decoding asks the "
        f"draft to predict the target *while the target generates*, so that is the text it trains on "
        f"(DistillSpec's teacher-generated data). Greedy agreement on held-out target continuations: "
        f"{_fmt(agreement['before'])} before, {_fmt(agreement['after'])} after. "
        f"{_count(run['tokens_seen'])} tokens, {_duration(run['train_seconds'])} on {run['hardware']} "
        f"({run['torch_threads']} torch threads).")


def _prompt_description(settings: dict) -> str:
    prompt_set = settings.get("prompt_set")
    if prompt_set is None:
        return LINE_CHUNK_PROMPTS.format(num_prompts=settings["num_prompts"],
                                         min_chars=settings["min_prompt_chars"], max_chars=settings["max_prompt_chars"])
    return (f"On {settings['num_prompts']} prompts of prompt set `{prompt_set['name']}` v{prompt_set['version']}\n"
            f"(`{prompt_set['path']}`, shared with `specserve bench`): {prompt_set['description']}.")


def card_fields(evaluation: dict, training: dict | None) -> dict:
    """The template's fields from evaluation.json and training.json (None: not trained yet)."""
    training = training or {}
    config = training.get("config", {})
    settings = evaluation["settings"]
    corpus = evaluation["corpus"]
    target_info, draft_info = evaluation["models_info"]["target"], evaluation["models_info"]["draft"]
    greedy, sampled, latency = evaluation["greedy"], evaluation["sampled"], evaluation["latency"]
    k4, k8 = greedy.get("k4", {}), greedy.get("k8", {})
    criterion = evaluation.get("criterion", {})
    held = evaluation.get("held_out", {})
    recomputed = held.get("recomputed") or {}
    from_training = held.get("from_training") or {}

    def loss_of(name: str) -> tuple[float | None, float | None]:
        if name in from_training:
            return from_training[name]["loss"], from_training[name].get("perplexity")
        if recomputed.get(name):
            return recomputed[name]["loss"], recomputed[name]["perplexity"]
        return None, None

    detail = []
    if from_training:
        detail.append("Summary values are training's own (fp32 weights before the fp16 export).")
    if recomputed:
        detail.append("Recomputed here from the fp16 checkpoints in fp32: target "
                      f"{_fmt(recomputed['target']['loss'])} (ppl {_fmt(recomputed['target']['perplexity'], 2)}), "
                      f"draft {_fmt(recomputed['draft']['loss'])} (ppl {_fmt(recomputed['draft']['perplexity'], 2)}) "
                      f"over {recomputed['target']['windows']} windows.")
    if not detail:
        detail.append("Not available.")

    spec_rows = []
    for run in list(greedy.values()) + [sampled]:
        mode = "greedy" if run["temperature"] == 0 else f"sampled T={run['temperature']}"
        identical = (f"{run['outputs_identical_to_target_greedy']}/{run['num_prompts']}"
                     if "outputs_identical_to_target_greedy" in run else "n/a")
        spec_rows.append(f"| {mode} | {run['k']} | {_fmt(run['acceptance_rate'])} | "
                         f"{_fmt(run['mean_tokens_per_pass'], 2)} | {_fmt(run['conditional_acceptance'])} | {identical} |")

    log = training.get("log") or []
    last = log[-1] if log else {}
    # The last logged target loss of the joint phase (the distillation phase logs NaN for it).
    target_losses = [r["target_loss"] for r in log if isinstance(r.get("target_loss"), float)
                     and not math.isnan(r["target_loss"])]
    wall = _duration(training.get("train_seconds"))  # written by training/default_pair.py
    if wall and training.get("train_seconds_note"):
        wall += f" ({training['train_seconds_note']})"
    hardware = training.get("hardware")
    if hardware is None and training:
        hardware = f"device `{training.get('device', '?')}`, {training.get('torch_threads', '?')} torch thread(s)"
    target_loss, target_ppl = loss_of("target")
    draft_loss, draft_ppl = loss_of("draft")
    met = criterion.get("met")
    notes = []
    if not training:
        notes.append("there was no `training.json` beside the models when this card was rendered: the "
                     "pair was evaluated from an unfinished training checkpoint, and the training details "
                     "below are missing")
    if settings["num_prompts"] < DEFAULT_NUM_PROMPTS or settings["max_tokens"] < DEFAULT_MAX_TOKENS:
        notes.append(f"this is a reduced evaluation ({settings['num_prompts']} prompts, up to "
                     f"{settings['max_tokens']} tokens each; the defaults are {DEFAULT_NUM_PROMPTS} and "
                     f"{DEFAULT_MAX_TOKENS})")
    status_note = ""
    if notes:
        status_note = ("\n> **Preliminary numbers**: " + "; ".join(notes)
                       + f". Rerun `{CARD_COMMAND}` on the finished pair.\n")
    return {
        "status_note": status_note,
        "distillation_step": _distillation_step(training),
        "command": CARD_COMMAND,
        "eval_time": _duration(evaluation.get("wall_s")) or "n/a",
        "eval_threads": settings["threads"],
        "created": evaluation.get("created", "n/a"),
        "eval_cpu": evaluation["environment"].get("cpu", "n/a"),
        "eval_cpus": evaluation["environment"].get("cpu_count", "n/a"),
        "threshold": criterion.get("threshold", ACCEPTANCE_THRESHOLD),
        "criterion": "met" if met else ("not met" if met is False else "n/a"),
        "k4_acceptance": _fmt(k4.get("acceptance_rate")),
        "k8_acceptance": _fmt(k8.get("acceptance_rate")),
        "k4_tpp": _fmt(k4.get("mean_tokens_per_pass"), 2),
        "k8_tpp": _fmt(k8.get("mean_tokens_per_pass"), 2),
        "temperature": sampled["temperature"],
        "sampled_k": sampled["k"],
        "sampled_acceptance": _fmt(sampled["acceptance_rate"]),
        "agreement": _fmt(evaluation["greedy_agreement"]["rate"]),
        "agreement_positions": _count(evaluation["greedy_agreement"]["positions"]),
        "target_loss": _fmt(target_loss), "target_ppl": _fmt(target_ppl, 2),
        "draft_loss": _fmt(draft_loss), "draft_ppl": _fmt(draft_ppl, 2),
        "latency_context": latency["context"],
        "latency_threads": latency["threads"],
        "latency_steps": latency["steps"],
        "target_ms": _fmt(latency["target"]["median_ms"], 2),
        "draft_ms": _fmt(latency["draft"]["median_ms"], 2),
        "target_p10": _fmt(latency["target"]["p10_ms"], 2), "target_p90": _fmt(latency["target"]["p90_ms"], 2),
        "draft_p10": _fmt(latency["draft"]["p10_ms"], 2), "draft_p90": _fmt(latency["draft"]["p90_ms"], 2),
        "latency_ratio": _fmt(latency["target_over_draft"], 1),
        "cost_ratio": _fmt(latency["draft_over_target"], 3),
        "python": corpus["python"],
        "stdlib_root": corpus["stdlib_root"],
        "files": _count(corpus["files"]),
        "train_files": _count(corpus["train_files"]),
        "held_out_files": _count(corpus["held_out_files"]),
        "held_out_rule": f"`{corpus['held_out_rule']}`",
        "held_out_every": HELD_OUT_EVERY,
        "train_tokens": _count(training.get("train_tokens")),
        "held_out_tokens": _count(training.get("held_out_tokens")),
        "vocab_size": _count(target_info["vocab_size"]),
        "target_params": _count(target_info["params"]), "draft_params": _count(draft_info["params"]),
        "target_params_short": _short(target_info["params"]), "draft_params_short": _short(draft_info["params"]),
        "target_hidden": target_info["hidden_size"], "draft_hidden": draft_info["hidden_size"],
        "target_layers": target_info["num_layers"], "draft_layers": draft_info["num_layers"],
        "target_heads": target_info["num_heads"], "draft_heads": draft_info["num_heads"],
        "target_intermediate": target_info["intermediate_size"],
        "draft_intermediate": draft_info["intermediate_size"],
        "target_context": target_info["max_context"], "draft_context": draft_info["max_context"],
        "seed": config.get("seed", "n/a"),
        "eval_seed": settings.get("seed", "n/a"),
        "joint_steps": _count(config.get("joint_steps")),
        "distill_steps": _count(config.get("distill_steps")),
        "target_lr": config.get("target_lr", "n/a"),
        "draft_lr": config.get("draft_lr", "n/a"),
        "batch_size": config.get("batch_size", "n/a"),
        "seq_len": config.get("seq_len", "n/a"),
        "warmup_steps": config.get("warmup_steps", "n/a"),
        "tokens_seen": _count(training.get("tokens_seen")),
        "final_target_loss": _fmt(target_losses[-1] if target_losses else None),
        "final_draft_kl": _fmt(last.get("draft_kl")),
        "train_wall": wall or "not recorded in training.json",
        "train_hardware": hardware or "not recorded (no training.json)",
        "prompt_description": _prompt_description(settings),
        "max_tokens": settings["max_tokens"],
        "threads": settings["threads"],
        "spec_rows": "\n".join(spec_rows),
        "loss_windows": recomputed.get("target", {}).get("windows", settings.get("loss_windows", "n/a")),
        "loss_seq_len": recomputed.get("seq_len", config.get("seq_len", "n/a")),
        "held_out_detail": " ".join(detail),
        "sample_tokens": settings.get("sample_tokens", "n/a"),
        "samples": _samples_markdown(evaluation.get("samples", [])),
    }


def render_card(evaluation: dict, training: dict | None) -> str:
    return CARD_TEMPLATE.format(**card_fields(evaluation, training))
