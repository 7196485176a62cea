"""Sampling parameters and the logits -> probabilities processing shared by draft and target.

Speculative decoding preserves whatever distribution the target rows p describe. Draft and target
rows therefore go through the same `logits_to_probs` with the same `SamplingParams`; the
*processed* target distribution (temperature, top-k, top-p applied) is the one a request samples
from, with or without a draft.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import torch
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from specserve.decoding.device_copy import host_to_device
from specserve.decoding.grammar import GrammarSpec

# The limits OpenAI's API documents; the HTTP models (deployments/openai_protocol.py) use these
# very constants, so what the ingress admits and what a request may carry cannot disagree.
MIN_TEMPERATURE = 0.0
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4
# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): logits / 1e-162 overflow to inf and
# softmax turns them into NaN, which a fuzzer found as an HTTP 500.
GREEDY_BELOW_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes a 64-bit seed; the draft's stream comes from draft_seed.
MAX_SEED = 2**63 - 1
DRAFT_SEED_MULTIPLIER = 0x9E3779B97F4A7C15  # odd: the golden-ratio constant of splitmix64
DRAFT_SEED_OFFSET = 0x632BE59BD9B4E019
VERIFY_SEED_OFFSET = 0x2545F4914F6CDD1D  # the target's residual draws: a third stream (verify_seed)
MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (vLLM's default cap)
# Presence and frequency penalties: OpenAI's documented range. repetition_penalty (HF/vLLM) must be
# positive; 1 is neutral. min_p (vLLM/HF) is a fraction of the most likely token's probability.
MIN_PRESENCE_PENALTY, MAX_PRESENCE_PENALTY = -2.0, 2.0
MIN_FREQUENCY_PENALTY, MAX_FREQUENCY_PENALTY = -2.0, 2.0
MIN_P_RANGE = (0.0, 1.0)
# logit_bias: OpenAI's documented range of a token's bias (added to its logit before sampling).
MIN_LOGIT_BIAS, MAX_LOGIT_BIAS = -100.0, 100.0
# bad_words (vLLM): how many words a request may ban, and their tokens in all (vLLM's own bounds).
MAX_BAD_WORDS, MAX_BAD_WORDS_TOKENS = 128, 1024
# Top-k / top-p look for their cut among a row's most likely tokens, this many first, then this
# many for the rows whose cut is not there (sampling.truncate_rows), and sort the whole row only
# where it is in neither. The widest covers the top_k values requests use; a peaked row's top-p
# nucleus mostly lies within the narrowest, which torch.topk finds at a fraction of the widest's
# cost over a large vocabulary (docs/sampling.md).
CANDIDATE_RUNGS = (256, 1024)
TOP_CANDIDATES = CANDIDATE_RUNGS[-1]

def stop_as_list(value: object) -> object:
    """OpenAI's `stop` takes a single string, a list of strings, or null: as a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return value


def check_stop_strings(value: list[str]) -> list[str]:
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(value)}")
    if any(s == "" for s in value):
        raise ValueError("stop strings must be non-empty")
    return value


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    """The ingress checks it against the max_tokens it settles on (a default, or the request's)."""
    if min_tokens > max_tokens:
        raise ValueError(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})")


def structured_conflict(structured, ignore_eos: bool, allowed_token_ids) -> tuple[str, str] | None:
    """(the field, why) when structured outputs come with a field that excludes them, else None:
    the HTTP request models answer it as a 400 naming the field, SamplingParams refuses the same."""
    if structured is None:
        return None
    if ignore_eos:
        return "ignore_eos", ("ignore_eos cannot be combined with structured outputs: the request ends when its "
                              "grammar does")
    if allowed_token_ids is not None:
        return "allowed_token_ids", ("allowed_token_ids cannot be combined with structured outputs: the grammar "
                                     "says which tokens may come, and the two could leave none")
    return None


# Field types shared with the HTTP request models (theirs holds stop strings as checked Text).
StopStrings = Annotated[list[str], BeforeValidator(stop_as_list), AfterValidator(check_stop_strings)]
Temperature = Annotated[float, Field(ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
PresencePenalty = Annotated[float, Field(ge=MIN_PRESENCE_PENALTY, le=MAX_PRESENCE_PENALTY, allow_inf_nan=False)]
FrequencyPenalty = Annotated[float, Field(ge=MIN_FREQUENCY_PENALTY, le=MAX_FREQUENCY_PENALTY, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=MIN_P_RANGE[0], le=MIN_P_RANGE[1], allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0)]
LogitBias = dict[TokenId, Annotated[float, Field(ge=MIN_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]]
AllowedTokenIds = Annotated[list[TokenId], Field(min_length=1)]


def check_bad_words_tokens(words: list[list[int]]) -> list[list[int]]:
    if any(not word for word in words):
        raise ValueError("a bad word's token sequence must not be empty")
    if len(words) > 2 * MAX_BAD_WORDS or sum(len(word) for word in words) > MAX_BAD_WORDS_TOKENS:
        raise ValueError(f"bad words may take at most {MAX_BAD_WORDS_TOKENS} tokens in all")
    return words


BadWordsTokenIds = Annotated[list[list[TokenId]], AfterValidator(check_bad_words_tokens)]


class SamplingParams(BaseModel):
    """Per-request sampling parameters, validated at the edge.

    temperature == 0 (or below GREEDY_BELOW_TEMPERATURE) means greedy. top_k <= 0 disables top-k;
    top_p == 1 disables top-p; min_p == 0 disables min-p.
    repetition_penalty (1 = off), presence_penalty and frequency_penalty (0 = off) depend on the
    tokens before a row (decoding.row_processors); greedy decoding applies them too. The order and
    semantics follow vLLM (docs/sampling.md).
    `stop` accepts a string or a list of strings (stored as a list). `seed` makes sampling
    reproducible. `ignore_eos` and `min_tokens` are vLLM's extensions (fixed-length benchmarks
    send them): with `ignore_eos` EOS is committed as an ordinary token instead of ending the
    request; for output positions below `min_tokens` the target's logits of the ids that would
    end the request are masked (`decoding.speculation.target_rows`, `decoding.sequence.ending_ids`)
    and stop strings are not yet looked for.
    `structured` constrains the output to a grammar (docs/structured-outputs.md): draft and target
    rows are masked to what it allows after each row's history; it cannot go with ignore_eos
    (the request ends when the grammar does).
    `logit_bias` (OpenAI's) adds a bias to the logits of the tokens it names and vLLM's
    `allowed_token_ids` keeps only the tokens it lists, before penalties, on draft and target rows
    alike (decoding.row_processors.LogitBias); greedy decoding applies them too. vLLM's bad_words
    arrive tokenized (`bad_words_token_ids`, decoding.row_processors.bad_words_token_ids): a
    word's last token is banned where the output so far ends with the rest of it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: Temperature = Field(default=1.0, description="0 = greedy; otherwise logits are divided by it")
    top_k: int = Field(default=0, description="keep the k most likely tokens; <= 0 disables")
    top_p: TopP = Field(default=1.0, description="nucleus: keep the smallest set with cumulative prob >= top_p")
    seed: Seed | None = Field(default=None, description="seed for a reproducible request")
    max_tokens: int = Field(default=16, ge=1, le=1_000_000, description="tokens to generate at most")
    stop: StopStrings = Field(default_factory=list, description=f"up to {MAX_STOP_STRINGS} non-empty stop strings")
    ignore_eos: bool = Field(default=False, description="EOS is an ordinary token: it does not end the request")
    min_tokens: int = Field(default=0, ge=0, description="EOS is masked for output positions below this")
    repetition_penalty: RepetitionPenalty = Field(
        default=1.0, description="logits of tokens seen in prompt or output: positive ones divided by it, "
                                 "negative ones multiplied (HF/vLLM); 1 = off")
    presence_penalty: PresencePenalty = Field(default=0.0, description="subtracted from the logit of every "
                                                                       "token already in the output")
    frequency_penalty: FrequencyPenalty = Field(default=0.0, description="subtracted once per occurrence of "
                                                                         "a token in the output")
    min_p: MinP = Field(default=0.0, description="drop tokens less likely than min_p times the most likely "
                                                 "one (after temperature); 0 = off")
    stop_token_ids: list[int] = Field(default_factory=list, description="vLLM extension: these ids end the "
                                      "request as EOS does (also with ignore_eos); masked below min_tokens")
    include_stop_str_in_output: bool = Field(default=False, description="vLLM extension: the stop string (or "
                                             "stop token) that ended the request stays in the output")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                 description="return the target's raw log-probability of every emitted token "
                                             "and this many most likely alternatives; None: none")
    structured: GrammarSpec | None = Field(default=None, description="the grammar the output must follow "
                                           "(response_format / structured_outputs); None: unconstrained")
    logit_bias: LogitBias = Field(default_factory=dict, description="token id -> a bias added to its logit "
                                  f"before sampling ({MIN_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g})")
    allowed_token_ids: AllowedTokenIds | None = Field(default=None, description="vLLM extension: only these "
                                                      "token ids may be generated; None: every token")
    bad_words_token_ids: BadWordsTokenIds = Field(default_factory=list, description="vLLM's bad_words, "
                                                  "tokenized: the output never ends with one of these sequences")

    @model_validator(mode="after")
    def _min_tokens_within_max(self) -> "SamplingParams":
        check_min_tokens(self.min_tokens, self.max_tokens)
        conflict = structured_conflict(self.structured, self.ignore_eos, self.allowed_token_ids)
        if conflict is not None:
            raise ValueError(conflict[1])
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        """True when a row's logits depend on the tokens before it (repetition/presence/frequency)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def biases_logits(self) -> bool:
        """True when a row's logits are biased or restricted to some tokens (logit_bias, allowed_token_ids)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def uses_history(self) -> bool:
        """True when rows need a row processor (decoding.row_processors): penalties, a grammar, bad
        words, or a logit bias (which needs no history, but is applied before the penalties, in
        the same pass)."""
        return (self.uses_penalties or self.structured is not None or self.biases_logits
                or bool(self.bad_words_token_ids))


def penalize(logits: torch.Tensor, output_counts: torch.Tensor, seen: torch.Tensor,
             repetition_penalty: torch.Tensor | float, frequency_penalty: torch.Tensor | float,
             presence_penalty: torch.Tensor | float) -> torch.Tensor:
    """Penalized logits (a new float32 tensor), vLLM's `apply_penalties` on entries of any shape:
    each penalty is a float or a tensor broadcasting against logits (one value per entry or per
    row), so one call serves a batch whose requests have different penalties. A neutral penalty
    (1, 0, 0) leaves its entries exactly as they were.

    output_counts: how often each entry's token occurs in its row's output so far (float); seen
    (bool): whether it occurs in the prompt or the output. Repetition divides the positive logits
    of seen tokens by repetition_penalty and multiplies the others (HF's
    RepetitionPenaltyLogitsProcessor); then frequency_penalty * count and presence_penalty *
    (count > 0) are subtracted (OpenAI's definition: output tokens only)."""
    logits = logits.float()
    penalty = torch.where(seen, repetition_penalty, 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return logits - frequency_penalty * output_counts - presence_penalty * (output_counts > 0).float()


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, seen: torch.Tensor,
                    params: SamplingParams) -> torch.Tensor:
    """`penalize` with one request's penalties: logits [..., V], output_counts and seen alike."""
    return penalize(logits, output_counts, seen, params.repetition_penalty, params.frequency_penalty,
                    params.presence_penalty)


@dataclass(frozen=True)
class RowParams:
    """The per-row sampling parameters of a batch of rows [N], as tensors on the rows' device, so
    rows of requests with different temperatures, top-k, top-p and min-p are processed by the same
    tensor ops (`process_rows`). Disabled settings hold their neutral value (top_k = V, top_p and
    min_p thresholds that keep everything); the uses_* flags, known on the host, skip a stage no
    row needs (top-k / top-p, above all)."""

    greedy: torch.Tensor        # bool [N]
    temperature: torch.Tensor   # float32 [N] (1 on greedy rows, which do not use it)
    min_p: torch.Tensor         # float32 [N]
    top_k: torch.Tensor         # long [N]
    top_p: torch.Tensor         # float64 [N]: +inf where top-p is off (a cumulative sum may round past 1)
    truncating: torch.Tensor    # long: the rows top-k or top-p cut
    all_greedy: bool
    any_greedy: bool
    all_truncating: bool        # every row is cut (no plain softmax row to compute beside them)
    uses_min_p: bool
    uses_top_k: bool
    uses_top_p: bool

    @staticmethod
    def of(params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str = "cpu") -> "RowParams":
        """One row per entry of params (repeat a request's params for each of its rows). Built once
        per rows' settings and vocabulary and then reused (`row_params_of_settings`): a batch's rows
        ask for the same ones step after step, and building six small tensors costs a draft step
        about what its sampling does. Nothing writes into them."""
        settings = tuple((p.is_greedy, p.temperature, p.top_k, p.top_p, p.min_p) for p in params)
        return row_params_of_settings(settings, vocab_size, torch.device(device))


@functools.lru_cache(maxsize=256)
def row_params_of_settings(settings: tuple[tuple[bool, float, int, float, float], ...], vocab_size: int,
                           device: torch.device) -> RowParams:
    """RowParams of rows whose (greedy, temperature, top_k, top_p, min_p) are settings."""
    greedy = [g for g, *_ in settings]
    top_k = [k if 0 < k < vocab_size and not g else vocab_size for g, _, k, _, _ in settings]
    top_p = [p if p < 1.0 and not g else float("inf") for g, _, _, p, _ in settings]
    min_p = [0.0 if g else m for g, _, _, _, m in settings]
    on_device = functools.partial(host_to_device, device=device)
    truncating = [i for i, (k, p) in enumerate(zip(top_k, top_p)) if k < vocab_size or p < 1.0]
    return RowParams(
        greedy=on_device(torch.tensor(greedy, dtype=torch.bool)),
        temperature=on_device(torch.tensor([1.0 if g else t for g, t, *_ in settings], dtype=torch.float32)),
        min_p=on_device(torch.tensor(min_p, dtype=torch.float32)),
        top_k=on_device(torch.tensor(top_k, dtype=torch.long)),
        top_p=on_device(torch.tensor(top_p, dtype=torch.float64)),
        truncating=on_device(torch.tensor(truncating, dtype=torch.long)),
        all_greedy=bool(greedy) and all(greedy), any_greedy=any(greedy),
        all_truncating=bool(greedy) and len(truncating) == len(greedy), uses_min_p=any(m > 0.0 for m in min_p),
        uses_top_k=any(k < vocab_size for k in top_k), uses_top_p=any(p < 1.0 for p in top_p))


# greedy_ids on a CPU: each row's maxima per block of this many logits first, from this many logits
# in all (fewer: torch.argmax, whose one pass costs less than the blocked pass's extra ops).
ARGMAX_BLOCK = 128
BLOCKED_ARGMAX_FROM = 4 * 8192


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The argmax ids [...] (int64) of logits [..., V], ties to the lowest index, as torch.argmax.

    Why not torch.argmax on a CPU: its kernel is a scalar loop, several times slower there than
    the vectorised max reduction, and a step argmaxes every greedy row it answers (a verify's K+1
    per request, a batch's draft rows). So each row's maxima per block of ARGMAX_BLOCK logits come
    first, in one reduction; the first block holding the row's maximum is found among those, and
    the first maximum within it; a tail past the last whole block is compared apart. The same ids
    as torch.argmax for rows without NaN (tests/test_sampling.py). On other devices, torch.argmax."""
    vocab_size = logits.shape[-1]
    if logits.device.type != "cpu" or logits.numel() < BLOCKED_ARGMAX_FROM or vocab_size < 2 * ARGMAX_BLOCK:
        return logits.argmax(dim=-1)
    leading = logits.shape[:-1]
    logits = logits.reshape(-1, vocab_size) if logits.stride(-1) == 1 else logits.contiguous().view(-1, vocab_size)
    num_rows = logits.shape[0]
    whole = vocab_size // ARGMAX_BLOCK * ARGMAX_BLOCK
    blocks = logits[:, :whole].view(num_rows, whole // ARGMAX_BLOCK, ARGMAX_BLOCK)
    block_max = blocks.amax(dim=-1)                            # [N, V / block]
    block = block_max.argmax(dim=-1)                           # the first block holding the row's maximum
    rows = torch.arange(num_rows, device=logits.device)
    ids = block * ARGMAX_BLOCK + blocks[rows, block].argmax(dim=-1)
    if whole < vocab_size:   # a tail's maximum wins only above every whole block's (ties: the earlier)
        tail_max, tail_ids = logits[:, whole:].max(dim=-1)
        ids = torch.where(tail_max > block_max[rows, block], whole + tail_ids, ids)
    return ids.view(leading)


def process_rows(logits: torch.Tensor, row_params: RowParams, exact_cut: bool = True) -> torch.Tensor:
    """Processed probabilities [N, V] (float32) from logits [N, V], each row under its own
    parameters, in batched tensor ops.

    Temperature, then min-p, then top-k, then top-p, renormalised (vLLM's order). Min-p drops the
    tokens whose probability is below min_p times the row's largest. A greedy row is one-hot at its
    argmax (ties: the lowest index, as torch.argmax). Top-k ties are broken towards the lowest index
    too, so exactly k tokens survive. Top-p keeps the smallest set of most likely tokens (of the
    top-k renormalised distribution) whose cumulative probability reaches top_p; the top token
    always survives. The processed target distribution is the one speculative decoding
    preserves; a draft's rows go through the same code (exact_cut below aside). Truncating rows
    go through `truncate_rows` (on a CPU, one host sync per call: which rows' cut fits among their
    top candidates; none on an accelerator).

    exact_cut False: a row whose cut does not fit among its first CANDIDATE_RUNGS[0] candidates
    is cut there instead (its top-k / top-p kept set within those candidates, renormalised). A
    draft's rows are processed so: any q is exact as long as the verifier gets the q drawn from,
    and a nucleus that long (a flat row) is costly to find exactly on a CPU, where it sorts the
    whole row, while the mass past the candidates only costs acceptance (docs/sampling.md)."""
    logits = logits.float()
    vocab_size = logits.shape[-1]
    one_hot = None
    if row_params.any_greedy:
        one_hot = torch.nn.functional.one_hot(greedy_ids(logits), vocab_size).float()
        if row_params.all_greedy:
            return one_hot

    logits = logits / row_params.temperature.unsqueeze(-1)
    if row_params.uses_min_p:
        probs = torch.softmax(logits, dim=-1)
        threshold = row_params.min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if row_params.all_truncating:
        probs = truncate_rows(logits, row_params.top_k, row_params.top_p, exact_cut, row_params.uses_top_k)
    else:
        probs = torch.softmax(logits, dim=-1)
        if row_params.uses_top_k or row_params.uses_top_p:
            # Only the rows that truncate go through top-k / top-p; the others keep the plain softmax.
            rows = row_params.truncating
            probs = probs.index_copy(0, rows, truncate_rows(logits[rows], row_params.top_k[rows], row_params.top_p[rows],
                                                            exact_cut, row_params.uses_top_k))
    if one_hot is not None:
        probs = torch.where(row_params.greedy.unsqueeze(-1), one_hot, probs)
    return probs


def truncate_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  exact: bool = True, cuts_top_k: bool = True) -> torch.Tensor:
    """Top-k then top-p of float32 logits [n, V] (top_k long [n], V where off; top_p float64 [n], +inf
    where off), renormalised: probabilities [n, V] (float32). cuts_top_k False: the caller knows
    that no row's top_k is below V (RowParams.uses_top_k), so the cut skips top-k's arithmetic.

    Both cuts keep a prefix of the row's tokens in descending order, ties towards the lowest index
    (a stable sort). Sorting all V ids is the costly part over a large vocabulary, and a peaked row's
    cut lies within its few most likely tokens. So each row first takes its CANDIDATE_RUNGS[0] most
    likely ids (`candidate_prefix`), and where the cut lies among those known to be the sorted row's
    own first ids, the row is cut there; the other rows try the next rung, and only those that fit
    in none (flat rows, top_k past the candidates) sort everything (`sorted_prefix`). Every way
    decides the kept set with the same float operations on the same numbers (`cut_by_prefix`), so a
    row's result does not depend on the way it took (tests/test_top_p_candidates.py, on CPU, whose
    cumulative sum runs in order; a device's parallel scan may round a prefix's sums differently,
    which moves only a token whose mass before it is within rounding of top_p). Deciding which rows
    go on is one host sync per rung tried, so on an accelerator, where sorting whole rows is cheap
    (vLLM's sampler sorts them) and a sync stalls the step, an exact cut sorts whole rows at once.
    exact False: every row is cut among its first rung's candidates, whether its cut fits there or
    not (process_rows' exact_cut), which nothing checks; no host sync on any device."""
    probs, rest = None, None   # rest: the rows not cut yet (None: every row)
    rungs = exact_cut_rungs(logits.device) if exact else CANDIDATE_RUNGS[:1]

    def remaining() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (logits, top_k, top_p) if rest is None else (logits[rest], top_k[rest], top_p[rest])

    for width in rungs:
        if logits.shape[0] == 0 or width >= logits.shape[-1]:
            break
        rows, k, p = remaining()
        prefix_ids, exact_length, holds_every_finite = candidate_prefix(rows, width)
        fits, cut = cut_by_prefix(rows, prefix_ids, k, p, exact_length if exact else None, cuts_top_k)
        fits |= holds_every_finite
        probs = cut if probs is None else probs.index_copy(0, rest, cut)
        if not exact or bool(fits.all()):   # inexact: the first rung's cut, fitting or not
            return probs
        missed = (~fits).nonzero().squeeze(-1)
        rest = missed if rest is None else rest[missed]
    rows, k, p = remaining()
    cut = cut_by_prefix(rows, sorted_prefix(rows), k, p, cuts_top_k=cuts_top_k)[1]
    return cut if probs is None else probs.index_copy(0, rest, cut)


def exact_cut_rungs(device: torch.device) -> tuple[int, ...]:
    """The candidate widths an exact cut tries on this device before sorting whole rows:
    CANDIDATE_RUNGS on a CPU, none on an accelerator (truncate_rows says why)."""
    return CANDIDATE_RUNGS if device.type == "cpu" else ()


def sorted_prefix(logits: torch.Tensor) -> torch.Tensor:
    """All ids of each row of logits [n, V], descending, ties towards the lowest index."""
    ids = torch.arange(logits.shape[-1], device=logits.device).expand_as(logits)
    return ids.gather(-1, torch.sort(descending_keys(logits, ids), dim=-1, descending=True).indices)


def candidate_prefix(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's `width` most likely ids [n, width] in the stable descending order; how many of
    them are surely the sorted row's first ids (long [n]); whether they hold every finite logit of
    the row (bool [n]).

    Every id whose logit is above the last candidate's is a candidate, so ordering the candidates
    by (value descending, id ascending) puts those in the sorted row's own order. Ids tied with
    the last candidate may continue past the candidates (bf16 logits tie often), and torch.topk
    picks among a tie in no stated order: those positions hold the right values, maybe not the
    right ids. If the last value is -inf, every finite logit is a candidate, and past those every
    order gives the same result (probability 0, kept or not)."""
    values, ids = torch.topk(logits, width, dim=-1, sorted=False)
    order = torch.sort(descending_keys(values, ids), dim=-1, descending=True).indices
    last = values.amin(dim=-1, keepdim=True)
    return ids.gather(-1, order), (values > last).sum(dim=-1), last.squeeze(-1) == float("-inf")


def descending_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is values' descending order, ties towards the lowest id:
    a float32 value's bits, made to order as the floats do, above the id's complement. One sort of
    distinct keys in place of two stable ones (ids, then values), and an integer sort is the
    cheaper on a CPU. -0.0 keys as +0.0, as a float comparison ties them; ids below 2**32."""
    if values.dtype != torch.float32:
        raise TypeError(f"descending_keys orders float32 values, not {values.dtype}")
    bits = (values + 0.0).view(torch.int32)   # x + 0.0 turns -0.0 into +0.0
    # Negative floats order by their magnitude bits reversed: flip those, keep the sign.
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
    return ordered * (1 << 32) + ((1 << 32) - 1 - ids)


def cut_by_prefix(logits: torch.Tensor, prefix_ids: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  exact_length: torch.Tensor | None = None, cuts_top_k: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p of logits [n, V] from prefix_ids [n, L], each row's first L ids in the stable
    descending order (L = V: the whole sorted row), of which the first exact_length (long [n];
    None: all L) are surely the right ids and the rest at least the right values:
    (fits bool [n], probabilities [n, V]).

    A row fits when its cut is decided by its exact ids: top_k <= exact_length, or top-k off and
    top-p already cutting the first inexact position (every later one then has at least as much mass
    before it). Where a row does not fit its probabilities mean nothing. cuts_top_k as truncate_rows'.

    Only the row's softmax reads all V logits; everything else runs over the L prefix positions, then
    one scatter writes the kept tokens' probabilities into zeros. The top-k-cut row's masses are the
    softmax's divided by the mass of its k most likely tokens (a prefix of the ids when k <= L), and
    the kept set's total is the cumulative sum where it ends: running sums in float64 in prefix
    order, so a row's result is the same numbers whatever its prefix's length (on CPU, whose
    cumulative sum runs in order), and no token crosses the top-p boundary through rounding. (Masking
    the V - L tokens outside the cut and taking a second softmax, as a plain implementation does,
    costs several times the whole cut: an exp of -inf is slow on CPU.)"""
    num_rows, vocab_size = logits.shape
    length = prefix_ids.shape[-1]
    sorted_probs = torch.softmax(logits, dim=-1).gather(-1, prefix_ids).double()
    mass = sorted_probs.cumsum(dim=-1)
    if cuts_top_k:   # (False: every k is V, and the masses stay as they are)
        # Where k < V and k <= L the top-k tokens are the prefix's first k: renormalise over their
        # mass. Otherwise the row is uncut by top-k (k = V) or does not fit.
        k = top_k.unsqueeze(-1)
        positions = torch.arange(length, device=logits.device)
        top_k_mass = mass.gather(-1, (k.clamp(max=length) - 1))
        cut_by_top_k = (k <= length) & (k < vocab_size)
        sorted_probs = torch.where(cut_by_top_k, torch.where(positions < k, sorted_probs / top_k_mass, 0.0),
                                   sorted_probs)
        mass = sorted_probs.cumsum(dim=-1)
    # Token j survives iff the mass strictly before it is still short of top_p; the top token always does.
    outside_nucleus = (mass - sorted_probs) >= top_p.unsqueeze(-1)
    outside_nucleus[:, 0] = False
    if exact_length is None:
        fits = torch.ones(num_rows, dtype=torch.bool, device=logits.device)
    else:
        cut_at_inexact = outside_nucleus.gather(-1, exact_length.clamp(max=length - 1).unsqueeze(-1)).squeeze(-1)
        fits = (top_k <= exact_length) | ((top_k == vocab_size) & cut_at_inexact)
    # The kept tokens are a prefix (the mass before a token only grows): their total is the mass where it ends.
    num_kept = (~outside_nucleus).sum(dim=-1, keepdim=True)
    kept_mass = mass.gather(-1, num_kept - 1)
    kept = sorted_probs.masked_fill(outside_nucleus, 0.0) / kept_mass
    return fits, torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, prefix_ids, kept.float())


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed probabilities [..., V] (float32) from logits [..., V], every row under one
    request's params: `process_rows` (whose docstring says what processing means)."""
    vocab_size = logits.shape[-1]
    flat = logits.reshape(-1, vocab_size)
    probs = process_rows(flat, RowParams.of([params] * flat.shape[0], vocab_size, logits.device))
    return probs.reshape(logits.shape)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token id per row of probs [N, V] for uniforms [N] in [0, 1): the first id whose running
    sum exceeds the uniform times the row's sum. Rows need not be normalised (non-negative weights
    with a positive sum); a zero-weight id is never picked (its sum equals the one before it). One
    cumulative sum per row: on a CPU target with a 128k vocabulary torch.multinomial was the
    sampled round's largest cost. Rows are taken a cache-sized chunk at a time (`row_chunks`)."""
    vocab_size = probs.shape[-1]
    token_ids = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for start, stop in row_chunks(probs.shape[0], vocab_size, probs.device):
        cumulative = probs[start:stop].double().cumsum(-1)
        token_ids[start:stop] = torch.searchsorted(
            cumulative, uniforms[start:stop].double().reshape(-1, 1) * cumulative[:, -1:], right=True).reshape(-1)
    return token_ids.clamp_(max=vocab_size - 1)


# Elements per chunk of rows on a CPU: a chunk's float64 running sums (2 MiB) stay in a core's
# cache, where a whole batch's would stream through memory once per operation.
CPU_CHUNK_ELEMENTS = 2 ** 18


def row_chunks(num_rows: int, row_width: int, device: torch.device | str) -> list[tuple[int, int]]:
    """(start, stop) runs of rows to process a batch of wide rows in: on a CPU, as many rows as fit
    CPU_CHUNK_ELEMENTS (at least one); on an accelerator the whole batch at once, since there one
    kernel launch per operation is what costs."""
    if torch.device(device).type != "cpu" or num_rows == 0:
        return [(0, num_rows)]
    step = max(1, CPU_CHUNK_ELEMENTS // max(row_width, 1))
    return [(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]


def row_uniforms(generators: Sequence[torch.Generator | None], device: torch.device | str = "cpu") -> torch.Tensor:
    """One uniform (float64 [N]) per row, each from its row's generator (None: torch's default
    one), where the rows live: a seeded request draws the same numbers whatever shares its batch.
    One small generator call per row, each a device op: nothing waits for the device."""
    if not generators:
        return torch.empty(0, dtype=torch.float64, device=device)
    return torch.cat([torch.rand(1, generator=generator, dtype=torch.float64, device=device)
                      for generator in generators])


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of probs [N, V] (LongTensor [N], on probs' device), row i drawn with
    generators[i] (which must live on probs' device)."""
    return inverse_cdf(probs, row_uniforms(generators, probs.device))


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token id per row of probs [..., V] -> LongTensor [...], every row with one
    generator (`inverse_cdf`; deterministic under a seeded `generator`, which must live on probs'
    device)."""
    leading_shape, vocab_size = probs.shape[:-1], probs.shape[-1]
    flat = probs.reshape(-1, vocab_size)
    if flat.shape[0] == 0:
        return torch.empty(leading_shape, dtype=torch.long, device=probs.device)
    uniforms = torch.rand(flat.shape[0], generator=generator, dtype=torch.float64, device=probs.device)
    return inverse_cdf(flat, uniforms).view(leading_shape)


def draft_seed(seed: int | None) -> int | None:
    """The draft's random stream of a seeded request: reproducible, and unlike the streams of the
    same request's other choices (seed + j for choice j, as vLLM). Torch's CPU generator keeps only
    a seed's low 32 bits, so the map must scramble those: an odd multiplier and an offset (a
    bijection on seeds) put the draft stream far from seed + j. If draft and target drew the same
    numbers, acceptance would correlate with the draft's choice and the output would be biased."""
    return None if seed is None else (seed * DRAFT_SEED_MULTIPLIER + DRAFT_SEED_OFFSET) % (MAX_SEED + 1)


def verify_seed(seed: int | None) -> int | None:
    """The target's stream of a seeded request (its residual and bonus draws,
    decoding.compact_verify.target_numbers): reproducible, and unlike the draft's stream and the
    request's own (the acceptance uniforms), which it must not correlate with. draft_seed's
    bijection with another offset."""
    return None if seed is None else (seed * DRAFT_SEED_MULTIPLIER + VERIFY_SEED_OFFSET) % (MAX_SEED + 1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator seeded with `seed`, or with 63 random bits from os.urandom when None."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
