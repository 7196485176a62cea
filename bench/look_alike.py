"""Models the step and round benches measure on when a trained one cannot show the cost: the
default pair's architecture at Llama 3's vocabulary width with random weights, made peaked like a
trained model's next-token rows; and a scheduler whose model calls are timed apart from the rest
of its step.

Why peaked: random weights alone give next-token rows nearly uniform over the 128k ids, which no
trained model has (a 0.95 nucleus would hold most of the vocabulary), so the final norm is scaled
until the rows' mean entropy is a trained model's. The lm_head is untied from the embeddings:
tied, a random model scores its input token far above the rest (the residual stream carries its
embedding), one spike over a flat tail.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specserve.decoding.scheduler import Scheduler

DEFAULT_PAIR = Path(__file__).resolve().parents[1] / "models" / "default"
VOCAB_SIZE = 128_256
TARGET_ENTROPY_NATS = 2.5
ENTROPY_POSITIONS = 100  # rows measured per prompt: the last this many of each


def look_alike(role: str, seed: int, prompts: list[torch.Tensor], max_context: int):
    """models/default/<role>'s architecture, 128k vocabulary, a context of max_context, random
    weights, made `peaked` over prompts: (model, mean entropy in nats of its next-token rows there)."""
    config = AutoConfig.from_pretrained(DEFAULT_PAIR / role, local_files_only=True)
    config.vocab_size, config.max_position_embeddings = VOCAB_SIZE, max_context
    config.tie_word_embeddings = False
    torch.manual_seed(seed)
    # float32, as a CPU engine serves it (from_config would take config.json's float16).
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return model, peaked(model, prompts)


def mean_entropy_nats(logits: torch.Tensor) -> float:
    log_probs = torch.log_softmax(logits, dim=-1)
    return float(-(log_probs.exp() * log_probs).sum(-1).mean())


@torch.inference_mode()
def peaked(model, prompts: list[torch.Tensor]) -> float:
    """Scale the model's final norm (which only feeds lm_head: the logits scale with it; the
    embeddings, untied from lm_head, stay) so that the mean entropy of its next-token
    distributions at the last ENTROPY_POSITIONS positions of each prompt is TARGET_ENTROPY_NATS
    (bisection on the scale); returns the entropy reached."""
    logits = torch.cat([model(input_ids=prompt[None], logits_to_keep=ENTROPY_POSITIONS).logits[0].float()
                        for prompt in prompts])
    low, high = 1.0, 1.0
    while mean_entropy_nats(logits * high) > TARGET_ENTROPY_NATS:
        low, high = high, high * 2
    for _ in range(20):
        middle = (low + high) / 2
        low, high = (middle, high) if mean_entropy_nats(logits * middle) > TARGET_ENTROPY_NATS else (low, middle)
    model.model.norm.weight.mul_(high)
    return mean_entropy_nats(logits * high)


def timed_forwards(engine: Scheduler, seconds: list[float], each: list[float] | None = None) -> Scheduler:
    """The engine, its runner's model calls (`_logits`) adding their wall time to seconds[0]
    (and appending each call's to `each`, where given); on CUDA synchronised at both ends, so a
    call's time is its kernels' and not their launches'. `del engine.runner._logits` undoes it."""
    runner = engine.runner
    model_call = runner._logits
    cuda = runner.device.type == "cuda"

    def timed(*args, **kwargs):
        if cuda:
            torch.cuda.synchronize(runner.device)
        started = time.perf_counter()
        try:
            return model_call(*args, **kwargs)
        finally:
            if cuda:
                torch.cuda.synchronize(runner.device)
            elapsed = time.perf_counter() - started
            seconds[0] += elapsed
            if each is not None:
                each.append(elapsed)

    runner._logits = timed
    return engine
