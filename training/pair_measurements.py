"""What the pair evaluation measures on a draft/target pair, one function per measurement:
speculative runs (acceptance, tokens per pass, losslessness against target-only greedy), greedy
agreement, held-out window loss, and the facts recorded beside them (model shapes, environment)."""

from __future__ import annotations

import math
import os
import platform
import time
from pathlib import Path

import torch

from specserve.policies.acceptance import estimate_acceptance_rate
from specserve.training.default_pair import held_out_loss


def load_runners(models: Path, threads: int):
    """(target, draft, tokenizer) from models/{target,draft}, fp32 on CPU, checked compatible: the
    target and draft as engines (decoding.scheduler.Scheduler over each runner)."""
    from transformers import AutoTokenizer

    from specserve.decoding.batched_runner import BatchedModelRunner
    from specserve.decoding.model_runner import check_compatible
    from specserve.decoding.scheduler import Scheduler

    target = BatchedModelRunner(str(models / "target"), dtype="float32", device="cpu", num_threads=threads)
    draft = BatchedModelRunner(str(models / "draft"), dtype="float32", device="cpu", num_threads=threads)
    tokenizer = AutoTokenizer.from_pretrained(str(models / "target"))
    draft_tokenizer = AutoTokenizer.from_pretrained(str(models / "draft"))
    check_compatible(draft, target, draft_tokenizer, tokenizer)
    return Scheduler(target), Scheduler(draft), tokenizer


def model_info(runner) -> dict:
    config = runner.config
    return {
        "architecture": type(runner.model).__name__,
        "params": sum(p.numel() for p in runner.model.parameters()),
        "hidden_size": config.hidden_size,
        "num_layers": config.num_hidden_layers,
        "num_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": runner.vocab_size,
        "max_context": runner.max_context,
        "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
    }


def _new_state(request_id: str, prompt_ids: list[int], params, target, draft, tokenizer):
    from specserve.decoding.sequence import RequestState

    return RequestState(request_id=request_id, prompt_ids=prompt_ids, params=params,
                        eos_token_id=target.runner.eos_token_id,
                        max_context=min(target.max_context, draft.max_context),
                        detokenize=lambda ids: tokenizer.decode(ids))


def target_greedy(target, draft, tokenizer, prompt_ids: list[int], max_tokens: int, request_id: str) -> list[int]:
    """Plain (target-only) greedy continuation."""
    from specserve.decoding.generate import generate
    from specserve.decoding.sampling import SamplingParams

    state = _new_state(request_id, prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                       target, draft, tokenizer)
    for _ in generate(target, state):
        pass
    return state.output_ids


def speculative_run(target, draft, tokenizer, prompts_ids: list[list[int]], k: int, max_tokens: int,
                    temperature: float, seed: int, tag: str,
                    reference: list[list[int]] | None = None) -> dict:
    """Speculative decoding of every prompt with the draft at depth k; aggregated SpecStats, the
    accepted-length histogram of the verification rounds, and (greedy) how many outputs equal
    the target-only greedy outputs in `reference`."""
    from specserve.decoding.generate import generate
    from specserve.decoding.proposers import DraftModelProposer
    from specserve.decoding.sampling import SamplingParams

    proposer = DraftModelProposer(draft)
    totals = {"rounds": 0, "num_drafted": 0, "num_accepted": 0, "num_emitted": 0, "target_passes": 0}
    histogram = [0] * (k + 1)   # rounds by number of accepted draft tokens (full-depth rounds only)
    rejections = 0              # rounds that stopped at a rejected draft token
    identical = 0
    started = time.perf_counter()
    for index, prompt_ids in enumerate(prompts_ids):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                seed=None if temperature == 0 else seed + index)
        state = _new_state(f"{tag}-{index}", prompt_ids, params, target, draft, tokenizer)
        stats = state.stats
        seen = (0, 0)

        def account() -> None:
            nonlocal seen, rejections
            drafted, accepted = stats.num_drafted - seen[0], stats.num_accepted - seen[1]
            seen = (stats.num_drafted, stats.num_accepted)
            if drafted:
                rejections += accepted < drafted
                if drafted == k:
                    histogram[accepted] += 1

        for _ in generate(target, state, proposer, num_draft_tokens=k):
            account()
        account()  # a last pass that committed nothing (EOS) is not yielded
        for key in totals:
            totals[key] += getattr(stats, key)
        if reference is not None and state.output_ids == reference[index]:
            identical += 1
    result = {
        "k": k,
        "temperature": temperature,
        **totals,
        "acceptance_rate": ratio(totals["num_accepted"], totals["num_drafted"]),
        # Per-token alpha of the geometric model, fitted to the totals as the benchmark and the
        # depth policy do (policies.acceptance; accepted / drafted understates it).
        "alpha": (estimate_acceptance_rate(totals["num_accepted"], totals["num_drafted"], totals["rounds"], 0.0, 0.0)
                  if totals["rounds"] else None),
        "mean_tokens_per_pass": ratio(totals["num_emitted"], totals["target_passes"]),
        # P(draft token accepted | every earlier draft token of its round was): the per-position rate.
        "conditional_acceptance": ratio(totals["num_accepted"], totals["num_accepted"] + rejections),
        "accepted_length_histogram": histogram,
        "wall_s": round(time.perf_counter() - started, 2),
    }
    if reference is not None:
        result["outputs_identical_to_target_greedy"] = identical
        result["num_prompts"] = len(prompts_ids)
    return result


def greedy_agreement(draft, prompts_ids: list[list[int]], continuations: list[list[int]]) -> dict:
    """Fraction of positions of the target's greedy continuation where the draft's argmax (given
    the same prefix) is the target's token."""
    positions = agreed = 0
    for index, (prompt_ids, continuation) in enumerate(zip(prompts_ids, continuations)):
        if not continuation:
            continue
        seq_id = f"agreement-{index}"
        logits = draft.forward(seq_id, prompt_ids + continuation[:-1], num_rows=len(continuation))
        draft.release(seq_id)
        predicted = torch.argmax(logits, dim=-1).tolist()
        positions += len(continuation)
        agreed += sum(int(a == b) for a, b in zip(predicted, continuation))
    return {"positions": positions, "agreed": agreed, "rate": ratio(agreed, positions)}


def window_loss(model, stream: torch.Tensor, seq_len: int, max_windows: int) -> dict:
    """training.default_pair.held_out_loss, as the evaluation JSON records it."""
    loss, windows = held_out_loss(model, stream, seq_len, max_windows)
    return {"windows": windows, "loss": loss, "perplexity": None if loss is None else math.exp(loss)}


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, 0.0 for an empty denominator (as evaluation.json records it)."""
    return numerator / denominator if denominator else 0.0


def runtime_environment(threads: int) -> dict:
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(),
            "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": threads}
