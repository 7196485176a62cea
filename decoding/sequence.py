"""Per-request decoding state shared by the in-process generator and the distributed router:
committed tokens, stop conditions, streamed text, seeded generators and speculation stats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from decoding.sampling import SamplingParams, make_generator

_REPLACEMENT_CHAR = "\ufffd"  # what a detokenizer prints for an incomplete UTF-8 sequence


@dataclass
class SpecStats:
    """Counters of one request's speculative decoding."""

    rounds: int = 0            # target passes that verified at least one draft token
    num_drafted: int = 0       # draft tokens proposed
    num_accepted: int = 0      # draft tokens the target accepted
    num_emitted: int = 0       # tokens committed to the output
    target_passes: int = 0     # target forwards, the prefill pass included
    pipelined_rounds: int = 0  # rounds whose block was drafted during the previous verification
    num_discarded_ahead: int = 0  # draft tokens drafted ahead (pipelining) and thrown away unverified
    draft_failures: int = 0    # draft engines lost mid-request (it then went on target-only)
    target_failovers: int = 0  # target engines lost mid-request (it re-prefilled on another)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_tokens_per_pass(self) -> float:
        return self.num_emitted / self.target_passes if self.target_passes else 0.0

    @property
    def mean_accepted_per_round(self) -> float:
        return self.num_accepted / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate,
                "mean_tokens_per_pass": self.mean_tokens_per_pass,
                "mean_accepted_per_round": self.mean_accepted_per_round}


@dataclass
class RequestState:
    """One request: its prompt, committed output and why it finished.

    The output never exceeds params.max_tokens tokens nor lets prompt + output exceed max_context.
    EOS ends the request without being appended; a stop string ends it after the token that
    completed it (the text is cut before the stop string)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    max_context: int
    detokenize: Callable[[list[int]], str] | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None   # "stop" (EOS or stop string) | "length" | None while running
    stats: SpecStats = field(default_factory=SpecStats)
    generator: torch.Generator | None = field(init=False, repr=False)
    draft_generator: torch.Generator | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_ids = list(self.prompt_ids)
        if not self.prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        if len(self.prompt_ids) >= self.max_context:
            raise ValueError(f"prompt of {len(self.prompt_ids)} tokens leaves no room to generate within "
                             f"the model's context of {self.max_context} tokens")
        if self.params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.params.max_tokens}")
        if self.params.stop and self.detokenize is None:
            raise ValueError("stop strings need a detokenize function to be detected")
        seed = self.params.seed
        self.generator = make_generator(seed)
        # The draft gets its own stream so the target's accept/reject draws do not depend on K.
        self.draft_generator = make_generator(None if seed is None else seed + 1)
        self._text_sent = 0  # characters of output_text already handed out by take_text_delta

    @property
    def history(self) -> list[int]:
        """Prompt followed by the committed output (a new list)."""
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def draft_budget(self, max_k: int) -> int:
        """Most draft tokens this round such that accepted + bonus stays within max_tokens and max_context."""
        remaining_tokens = self.params.max_tokens - len(self.output_ids) - 1
        remaining_context = self.max_context - len(self.prompt_ids) - len(self.output_ids) - 1
        return max(0, min(max_k, remaining_tokens, remaining_context))

    def commit(self, token_ids: list[int]) -> list[int]:
        """Append token_ids in order until a stop condition; return the tokens actually appended."""
        appended: list[int] = []
        for token in token_ids:
            if self.finished:
                break
            if self.eos_token_id is not None and token == self.eos_token_id:
                self.finish_reason = "stop"
                break
            self.output_ids.append(token)
            appended.append(token)
            if self.params.stop and self._find_stop(self.detokenize(self.output_ids)) >= 0:
                self.finish_reason = "stop"
            elif (len(self.output_ids) >= self.params.max_tokens
                  or len(self.prompt_ids) + len(self.output_ids) >= self.max_context):
                self.finish_reason = "length"
        return appended

    def _find_stop(self, text: str) -> int:
        """Index of the earliest stop-string occurrence in text, -1 if none."""
        hits = [i for i in (text.find(stop) for stop in self.params.stop if stop) if i >= 0]
        return min(hits) if hits else -1

    @property
    def output_text(self) -> str:
        """Detokenized output, cut before the first stop string."""
        if self.detokenize is None:
            raise ValueError(f"request {self.request_id!r} has no detokenize function")
        text = self.detokenize(self.output_ids)
        cut = self._find_stop(text) if self.params.stop else -1
        return text if cut < 0 else text[:cut]

    def take_text_delta(self) -> str:
        """Text added since the last call. While running, holds back a trailing incomplete
        character and any tail that could still grow into a stop string."""
        text = self.output_text
        end = len(text)
        if not self.finished:
            end = len(text.rstrip(_REPLACEMENT_CHAR))
            end -= max((self._stop_prefix_size(text, end, stop) for stop in self.params.stop), default=0)
        if end <= self._text_sent:
            return ""
        delta = text[self._text_sent:end]
        self._text_sent = end
        return delta

    @staticmethod
    def _stop_prefix_size(text: str, end: int, stop: str) -> int:
        """Length of the longest proper prefix of stop that text[:end] ends with."""
        for size in range(min(len(stop) - 1, end), 0, -1):
            if text.endswith(stop[:size], 0, end):
                return size
        return 0
