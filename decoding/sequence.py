"""Per-request decoding state shared by the in-process generator and the distributed router:
committed tokens, stop conditions, streamed text, seeded generators and speculation stats."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field

import torch

from specserve.decoding.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from specserve.decoding.sampling import SamplingParams, draft_seed, make_generator, verify_seed


def ending_ids(eos_token_id: int | Collection[int] | None, params: SamplingParams) -> frozenset[int]:
    """The ids whose token ends a request with these params: EOS, one id or a set of them (an
    ordinary token with ignore_eos), and the request's stop token ids (with ignore_eos too, as vLLM)."""
    if params.ignore_eos or eos_token_id is None:
        eos = set()
    elif isinstance(eos_token_id, Collection):
        eos = set(eos_token_id)
    else:
        eos = {eos_token_id}
    return frozenset(int(token) for token in eos | set(params.stop_token_ids))


@dataclass
class SpecStats:
    """Counters of one request's speculative decoding."""

    rounds: int = 0            # target passes that verified at least one draft token
    num_drafted: int = 0       # draft tokens proposed
    num_accepted: int = 0      # draft tokens the target accepted
    num_emitted: int = 0       # tokens committed to the output
    target_passes: int = 0     # target forwards, the prefill pass included
    pipelined_rounds: int = 0  # rounds whose block was ready when the verify answered (speculation cache hits)
    speculation_cache_misses: int = 0  # rounds drafted just in time although the last verify pre-drafted
    num_discarded_ahead: int = 0  # pre-drafted draft tokens thrown away unverified (decoding.speculation_cache)
    draft_failures: int = 0    # draft engines lost mid-request (it then went on target-only)
    target_failovers: int = 0  # target engines lost mid-request (it re-prefilled on another)
    draft_version: int = 0     # the draft weights of the last verified block (docs/online-learning.md)

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
    EOS (any id of eos_token_id: one id or the served set) ends the request without being
    appended (with params.ignore_eos it is an ordinary token); so does a stop token id of
    params.stop_token_ids (also with ignore_eos, as vLLM). A stop string ends it after the token
    that completed it (the text is cut before the stop string). With include_stop_str_in_output
    the stop string stays in the text and a stop token id in the output. Stop strings are looked for once the output is longer than params.min_tokens, as vLLM.

    Text is detokenized incrementally (decoding.detokenizer), and a stop string is looked for only
    in the new text plus the last max(len(stop)) - 1 characters before it, so each token costs the
    same however long the output already is."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_id: int | Collection[int] | None
    max_context: int
    detokenize: Callable[[list[int]], str] | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None   # "stop" (EOS or stop string) | "length" | None while running
    stats: SpecStats = field(default_factory=SpecStats)
    num_cached_tokens: int = 0   # prompt tokens the target found in its prefix cache (usage's cached_tokens)
    cache_salt: str | None = None   # its prefix-cache blocks are keyed under it (tenant isolation); None: shared
    # Rounds by draft position (policies.acceptance.count_round_positions), for this request's depth.
    draft_reached: list[int] = field(default_factory=list)
    draft_accepted_at: list[int] = field(default_factory=list)
    generator: torch.Generator | None = field(init=False, repr=False)
    draft_generator: torch.Generator | None = field(init=False, repr=False)
    verify_generator: torch.Generator | None = field(init=False, repr=False)  # the target's draws, in-process

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
        self._ending_ids = ending_ids(self.eos_token_id, self.params)
        self._stop_token_ids = frozenset(self.params.stop_token_ids)
        seed = self.params.seed
        self.generator = make_generator(seed)
        # The draft gets its own stream so the target's accept/reject draws do not depend on K.
        self.draft_generator = make_generator(draft_seed(seed))
        self.verify_generator = make_generator(verify_seed(seed))
        self._detokenizer = None if self.detokenize is None else IncrementalDetokenizer(self.detokenize)
        self._tail_chars = max((len(stop) for stop in self.params.stop), default=1) - 1
        self._text_pieces: list[str] = []    # emitted text: complete characters only, while running
        self._unsent_pieces: list[str] = []  # emitted text from character _unsent_from on
        self._unsent_from = 0
        self._tail = ""                      # its last _tail_chars characters: where a stop string may begin
        self._held = ""                      # decoded text held back as maybe an incomplete character
        self._stop_at: int | None = None     # where the stop string begins in the full text
        self._text_len = 0                   # characters emitted
        self._text_sent = 0                  # characters handed out by take_text_delta
        self._text_final = False             # text flushed (and cut) after the request finished

    @property
    def history(self) -> list[int]:
        """Prompt followed by the committed output (a new list)."""
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def next_output_index(self) -> int:
        """Output position of the first row of the next verify call (its rows score positions
        next_output_index, next_output_index + 1, ...): what `target_rows` needs for min_tokens."""
        return len(self.output_ids)

    def engine_streams_on(self, device: torch.device | str) -> None:
        """Move the draft's and the target's streams to device (in process: where the runners are),
        seeded as before: an engine draws with a generator on its own device. A CPU stream and a
        CUDA one of one seed give different numbers, each reproducible."""
        if self.draft_generator.device != torch.device(device):
            self.draft_generator = make_generator(draft_seed(self.params.seed), device)
            self.verify_generator = make_generator(verify_seed(self.params.seed), device)

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
            if token in self._ending_ids:
                self.finish_reason = "stop"
                if token in self._stop_token_ids and self.params.include_stop_str_in_output:
                    self.output_ids.append(token)
                    appended.append(token)
                break
            self.output_ids.append(token)
            appended.append(token)
            if self.params.stop and self._stop_string_completed():
                self.finish_reason = "stop"
            elif (len(self.output_ids) >= self.params.max_tokens
                  or len(self.prompt_ids) + len(self.output_ids) >= self.max_context):
                self.finish_reason = "length"
        return appended

    def _stop_string_completed(self) -> bool:
        """Detokenize the new token; True (and remember where to cut) if it completed a stop string."""
        tail, text_len = self._tail, self._text_len
        piece = self._detokenizer.step(self.output_ids)
        self._emit(piece)
        self._held = self._detokenizer.held_text
        if len(self.output_ids) <= self.params.min_tokens:
            return False
        # The held text counts: a token may complete a stop string and begin a character at once.
        window = tail + piece + self._held
        hits = [(i, len(stop)) for i, stop in ((window.find(stop), stop) for stop in self.params.stop) if i >= 0]
        if not hits:
            return False
        start, length = min(hits)
        self._stop_at = text_len - len(tail) + start + (length if self.params.include_stop_str_in_output else 0)
        return True

    def _emit(self, piece: str) -> None:
        if piece:
            self._text_pieces.append(piece)
            self._unsent_pieces.append(piece)
            self._text_len += len(piece)
            self._tail = (self._tail + piece)[-self._tail_chars:] if self._tail_chars else ""

    def _catch_up(self) -> None:
        """Bring the text up to the committed tokens (flushed and cut once finished)."""
        if self._detokenizer is None:
            raise ValueError(f"request {self.request_id!r} has no detokenize function")
        if self._text_final:
            return
        if not self.finished:
            self._emit(self._detokenizer.step(self.output_ids))
            return
        if self._stop_at is None:
            self._emit(self._detokenizer.flush(self.output_ids))
            text = "".join(self._text_pieces)
        else:  # the stop string may begin in held text (the token also began a character)
            text = ("".join(self._text_pieces) + self._held)[:self._stop_at]
        self._text_pieces, self._text_len = [text], len(text)
        self._unsent_from = min(self._text_sent, len(text))
        self._unsent_pieces = [text[self._unsent_from:]]
        self._text_final = True

    @property
    def output_text(self) -> str:
        """Detokenized output, cut before the first stop string (while running: the complete
        characters so far)."""
        self._catch_up()
        return "".join(self._text_pieces)

    def take_text_delta(self) -> str:
        """Text added since the last call. While running, holds back a trailing incomplete
        character and any tail that could still grow into a stop string."""
        self._catch_up()
        emitted_unsent = "".join(self._unsent_pieces)   # emitted text from _unsent_from on
        text, tail = emitted_unsent, self._tail
        if not self.finished:  # held text up to its incomplete character may go out already
            provisional = self._detokenizer.held_text.rstrip(REPLACEMENT_CHAR)
            text, tail = text + provisional, tail + provisional
        end = len(text)
        if not self.finished:
            end -= max((self._stop_prefix_size(tail, stop) for stop in self.params.stop), default=0)
        start = self._text_sent - self._unsent_from
        if end <= start:
            return ""
        delta = text[start:end]
        self._text_sent += len(delta)
        sent_emitted = min(self._text_sent, self._text_len) - self._unsent_from
        self._unsent_pieces = [emitted_unsent[sent_emitted:]] if sent_emitted < len(emitted_unsent) else []
        self._unsent_from += max(0, sent_emitted)
        return delta

    @staticmethod
    def _stop_prefix_size(text: str, stop: str) -> int:
        """Length of the longest proper prefix of stop that text ends with (text: a tail is enough)."""
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                return size
        return 0
