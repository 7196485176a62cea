"""In-process rows: target-only and speculative decoding through decoding.generate, and Hugging
Face assisted generation, on the same checkpoints in the same dtype and device (the engines' own
copies of the weights, laid out their way; Hugging Face's as loaded).

Orchestration overhead is measured from the outside, without touching decoding/: forward hooks on
the models time every forward pass, and a round's overhead is its wall time minus the model time
spent inside it (CUDA is synchronised at both ends of a forward so GPU time is not mistaken for
overhead). Round boundaries are where the generator yields (specserve) or where Hugging Face hands
tokens to its streamer.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from specserve.bench.http_rows import TOP_P
from specserve.bench.records import RequestRecord, StepLatency
from specserve.decoding.generate import generate
from specserve.decoding.scheduler import Scheduler, engine_for_model
from specserve.decoding.proposers import DraftModelProposer
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.sequence import RequestState
from specserve.training.step_latency import step_latency_s

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
STEP_CONTEXT_TOKENS = 128


class ForwardClock:
    """Total seconds spent inside the forward passes of some modules (hooks) and inside the model
    calls of some engines (`counting`), nesting-safe: Hugging Face's generate calls the modules,
    while an engine's lean forward reads their weights without calling them."""

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        self.total_s = 0.0
        self._depth = 0
        self._started = 0.0
        self._cuda = any(next(m.parameters()).is_cuda for m in modules)
        self._handles = []
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._exit))

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def _enter(self, *_) -> None:
        if self._depth == 0:
            self._sync()
            self._started = time.perf_counter()
        self._depth += 1

    def _exit(self, *_) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._sync()
            self.total_s += time.perf_counter() - self._started

    def counting(self, engine: Scheduler) -> Scheduler:
        """The engine, its runner's model calls (`_logits`) counted in total_s."""
        runner = engine.runner
        model_call = runner._logits

        def counted(*args, **kwargs):
            self._enter()
            try:
                return model_call(*args, **kwargs)
            finally:
                self._exit()

        runner._logits = counted
        return engine

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class LoadedPair:
    """HF models (for Hugging Face's own rows) and engines over their own copies of the weights."""

    target_model: torch.nn.Module
    draft_model: torch.nn.Module
    target: Scheduler
    draft: Scheduler
    clock: ForwardClock


def load_pair(target_path: str, draft_path: str, device: str = "cpu", dtype: str = "float32") -> LoadedPair:
    """Each model loaded twice, in the same dtype on the same device: once for Hugging Face's rows,
    as a user's `generate` runs it, and once for the engines, which lay its weights out their own
    way (decoding.weight_layout) and would otherwise change what Hugging Face's rows compute."""

    def loaded(path: str) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=_DTYPES[dtype])
        return model.to(torch.device(device)).eval()

    target_model, draft_model = loaded(target_path), loaded(draft_path)
    clock = ForwardClock([target_model, draft_model])
    return LoadedPair(target_model, draft_model, clock.counting(engine_for_model(loaded(target_path))),
                      clock.counting(engine_for_model(loaded(draft_path))), clock)


# -- step latencies -----------------------------------------------------------------------------

def measure_steps(pair: LoadedPair, context_ids: list[int], target_new_tokens: Sequence[int]) -> StepLatency:
    """t_target(n) for each n (1 always included) and t_draft(1), at the given context."""
    sizes = sorted({1, *target_new_tokens})
    return StepLatency(target_s={n: step_latency_s(pair.target, context_ids, n) for n in sizes},
                       draft_s=step_latency_s(pair.draft, context_ids, 1))


def step_context(prompt_ids: Sequence[Sequence[int]], length: int = STEP_CONTEXT_TOKENS) -> list[int]:
    """A realistic context of `length` tokens: the prompts' tokens, concatenated and cut."""
    flat = [t for ids in prompt_ids for t in ids]
    if not flat:
        raise ValueError("need at least one non-empty prompt to build a step-latency context")
    return [flat[i % len(flat)] for i in range(length)]


# -- specserve in-process -----------------------------------------------------------------------

def sampling_params(mode: str, max_tokens: int, seed: int) -> SamplingParams:
    """greedy: temperature 0; sampled: T = 0.8, no top-k/top-p, seeded; top_p: the same with top-p
    0.95 (a cut row: its q is as wide as what the cut keeps)."""
    if mode == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return SamplingParams(temperature=0.8, top_k=0, top_p=TOP_P if mode == "top_p" else 1.0, seed=seed,
                          max_tokens=max_tokens)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_specserve(pair: LoadedPair, prompt_id: str, run: int, prompt_ids: list[int], params: SamplingParams,
                  num_draft_tokens: int, verification: str = "block") -> RequestRecord:
    """One request through decoding.generate; num_draft_tokens 0 = target-only (no proposer);
    verification "block" or "token" (decoding.speculation.accept_round)."""
    proposer = DraftModelProposer(pair.draft) if num_draft_tokens > 0 else None
    state = RequestState(request_id=f"{prompt_id}-{run}", prompt_ids=prompt_ids, params=params,
                         eos_token_id=pair.target.runner.eos_token_id, max_context=pair.target.max_context)
    clock = pair.clock
    overheads: list[float] = []
    ttft_s = None
    started = time.perf_counter()
    last, model_at_last = started, clock.total_s
    for _ in generate(pair.target, state, proposer, num_draft_tokens, verification):
        now = time.perf_counter()
        if ttft_s is None:
            ttft_s = now - started
        else:
            overheads.append((now - last) - (clock.total_s - model_at_last))
        last, model_at_last = now, clock.total_s
    wall_s = time.perf_counter() - started
    stats = state.stats
    return RequestRecord(prompt_id=prompt_id, run=run, num_prompt_tokens=len(prompt_ids),
                         num_output_tokens=len(state.output_ids), wall_s=wall_s, ttft_s=ttft_s,
                         target_passes=stats.target_passes, rounds=stats.rounds, num_drafted=stats.num_drafted,
                         num_accepted=stats.num_accepted, median_overhead_s=_median(overheads),
                         finish_reason=state.finish_reason, output_token_ids=list(state.output_ids))


# -- Hugging Face assisted generation -------------------------------------------------------------

class _RoundStreamer(BaseStreamer):
    """Timestamps every put(): the first is the prompt, each later one ends a target pass."""

    def __init__(self, clock: ForwardClock) -> None:
        self.clock = clock
        self.put_times: list[float] = []
        self.model_times: list[float] = []

    def put(self, value) -> None:
        self.put_times.append(time.perf_counter())
        self.model_times.append(self.clock.total_s)

    def end(self) -> None:
        pass


def hf_generation_overrides(num_draft_tokens: int | None) -> dict:
    """Assistant generation-config fields for a row: None = HF's defaults (its dynamic schedule:
    up to 20 draft tokens, drafting stops early below confidence 0.4); K = exactly K per round."""
    if num_draft_tokens is None:
        return {}
    return {"num_assistant_tokens": num_draft_tokens, "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0}


def run_hf_assisted(pair: LoadedPair, prompt_id: str, run: int, prompt_ids: list[int], mode: str,
                    max_tokens: int, seed: int, num_draft_tokens: int | None) -> RequestRecord:
    """One request through target.generate(assistant_model=draft). Drafted/accepted counts come
    from wrapping the candidate generator's update_candidate_strategy on this instance (HF calls
    it once per pass with the pass's candidate count and matches)."""
    target, draft = pair.target_model, pair.draft_model
    counts = {"drafted": 0, "accepted": 0, "passes": 0}
    original_factory = target._get_candidate_generator

    def counting_factory(*args, **kwargs):
        candidate_generator = original_factory(*args, **kwargs)
        update = candidate_generator.update_candidate_strategy

        def counted_update(input_ids, scores, num_matches):
            counts["passes"] += 1
            counts["drafted"] += int(scores.shape[1]) - 1
            counts["accepted"] += int(num_matches)
            return update(input_ids, scores, num_matches)

        candidate_generator.update_candidate_strategy = counted_update
        return candidate_generator

    saved_config = copy.deepcopy(draft.generation_config)
    for key, value in hf_generation_overrides(num_draft_tokens).items():
        setattr(draft.generation_config, key, value)
    target._get_candidate_generator = counting_factory
    try:
        return _hf_generate(pair, prompt_id, run, prompt_ids, mode, max_tokens, seed, counts, assistant_model=draft)
    finally:
        del target._get_candidate_generator  # back to the class's method
        draft.generation_config = saved_config


def run_hf_target(pair: LoadedPair, prompt_id: str, run: int, prompt_ids: list[int], mode: str,
                  max_tokens: int, seed: int) -> RequestRecord:
    """One request through target.generate alone: Hugging Face's own target-only decoding, one
    pass a token."""
    return _hf_generate(pair, prompt_id, run, prompt_ids, mode, max_tokens, seed, None)


def _hf_generate(pair: LoadedPair, prompt_id: str, run: int, prompt_ids: list[int], mode: str, max_tokens: int,
                 seed: int, counts: dict | None, **generate_kwargs) -> RequestRecord:
    """target.generate over one prompt, streamed to time its passes; counts: the assisted row's
    drafted / accepted / passes (None: no draft, a pass a token)."""
    target = pair.target_model
    sampling = ({"do_sample": True, "temperature": 0.8, "top_k": 0, "top_p": 1.0} if mode == "sampled"
                else {"do_sample": False})
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=target.device)
    streamer = _RoundStreamer(pair.clock)
    torch.manual_seed(seed)
    started = time.perf_counter()
    output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                             streamer=streamer, pad_token_id=pair.target.runner.eos_token_id, **sampling,
                             **generate_kwargs)
    wall_s = time.perf_counter() - started
    num_output = int(output.shape[1]) - len(prompt_ids)
    counts = counts or {"drafted": 0, "accepted": 0, "passes": num_output}
    puts, model = streamer.put_times, streamer.model_times
    # Overheads from the second pass on, as for specserve (the first pass includes both prefills).
    overheads = [(puts[i] - puts[i - 1]) - (model[i] - model[i - 1]) for i in range(2, len(puts))]
    return RequestRecord(prompt_id=prompt_id, run=run, num_prompt_tokens=len(prompt_ids), num_output_tokens=num_output,
                         wall_s=wall_s, ttft_s=puts[1] - started if len(puts) > 1 else None,
                         target_passes=counts["passes"], rounds=counts["passes"], num_drafted=counts["drafted"],
                         num_accepted=counts["accepted"], median_overhead_s=_median(overheads),
                         finish_reason="length" if num_output >= max_tokens else "stop",
                         output_token_ids=output[0, len(prompt_ids):].tolist())


# -- rows -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class InProcessRow:
    key: str
    measure: Callable[[LoadedPair, str, int, list[int], str, int, int], RequestRecord]


def in_process_rows(num_draft_tokens: int) -> list[InProcessRow]:
    """The in-process rows, in table order. measure(pair, prompt_id, run, prompt_ids, mode,
    max_tokens, seed) -> RequestRecord."""
    def specserve(k: int):
        return lambda pair, pid, run, ids, mode, max_tokens, seed: run_specserve(
            pair, pid, run, ids, sampling_params(mode, max_tokens, seed), k)

    def hf(k: int | None):
        return lambda pair, pid, run, ids, mode, max_tokens, seed: run_hf_assisted(
            pair, pid, run, ids, mode, max_tokens, seed, k)

    return [InProcessRow("target-inproc", specserve(0)), InProcessRow("hf-target", run_hf_target),
            InProcessRow("hf-dynamic", hf(None)),
            InProcessRow("hf-constant", hf(num_draft_tokens)),
            InProcessRow("specserve-inproc", specserve(num_draft_tokens))]
