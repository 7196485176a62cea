"""History-dependent row processing: logits changed by the tokens *before* each row.

Temperature, min-p, top-k and top-p (decoding.sampling.logits_to_probs) look at one row alone.
Penalties and structured-output grammar masks also depend on the row's history, and in a
speculative block that history differs row by row: target row i of a verify over [last, d1..dK]
conditions on committed + d1..d_i, and draft step i conditions on the same tokens. Rejection
sampling is lossless only if the q and p rows at each position are processed for that same prefix,
so draft and target both go through this module.

A `HistoryProcessor` is one request's state for one call, built from the token history the call
carries (prompt + committed output, nothing kept across calls, so a cropped or re-prefilled history
needs no rollback; penalties touch only the columns of tokens in that history).
`contribute(batch, first_row, num_rows, block)` adds the request's rows of a batch, row i seeing
the history plus block[:i], to a `RowBatch`, which processes every request's rows of an engine
step in one pass on the rows' device; `process(logits, block)` is that for one request alone.
`advance(tokens)` appends tokens to the history (a draft step). A verify adds its K+1 rows with
block = d1..dK; a drafter adds one row per step and advances by the token it drew.

A logit bias (`LogitBias`: logit_bias, allowed_token_ids) depends on no history; it is a processor
here so that it is applied in the same pass, first, as vLLM's sampler applies it before penalties
(a repetition penalty scales a logit, so the order changes the result).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specserve.decoding.device_copy import host_to_device, index_on
from specserve.decoding.grammar import GrammarMatcher, mask_logits
from specserve.decoding.sampling import SamplingParams, penalize


class RowBatch:
    """History-dependent processing of a batch of rows, gathered request by request and applied in
    one pass (`apply`), in vLLM's order: every allowed-tokens mask in one masked fill, every bad
    word's ban in one scatter, every logit bias in one scatter-add, every request's penalized
    entries in one gather and scatter, every grammar mask in one masked fill, every min_tokens
    stop-token mask in one masked fill. A request
    adds its rows with its processor's `contribute`; rows nobody adds are left alone. Nothing here
    reads a value back from the device."""

    def __init__(self) -> None:
        self._penalty_rows: list[torch.Tensor] = []
        self._penalty_columns: list[torch.Tensor] = []
        self._penalty_counts: list[torch.Tensor] = []
        self._penalty_seen: list[torch.Tensor] = []
        self._penalty_values: list[tuple[int, float, float, float]] = []
        self._mask_rows: list[int] = []
        self._masks: list[torch.Tensor] = []
        self._stop_rows: list[int] = []
        self._stop_ids: list[list[int]] = []
        self._bias_rows: list[torch.Tensor] = []
        self._bias_columns: list[torch.Tensor] = []
        self._bias_values: list[torch.Tensor] = []
        self._allow_rows: list[torch.Tensor] = []
        self._allow_columns: list[torch.Tensor] = []
        self._allowing_rows: list[int] = []
        self._ban_rows: list[int] = []
        self._ban_columns: list[int] = []

    def ban(self, row: int, columns: Sequence[int]) -> None:
        """Row `row` loses the tokens columns (bad words), unless nothing else is left in it."""
        self._ban_rows.extend([row] * len(columns))
        self._ban_columns.extend(columns)

    def bias(self, first_row: int, num_rows: int, columns: torch.Tensor, values: torch.Tensor) -> None:
        """Rows first_row.. (num_rows of them) get values [c] added at columns [c] (distinct)."""
        self._bias_rows.append(torch.arange(first_row, first_row + num_rows,
                                            device=columns.device).repeat_interleave(len(columns)))
        self._bias_columns.append(columns.repeat(num_rows))
        self._bias_values.append(values.repeat(num_rows))

    def allow(self, first_row: int, num_rows: int, columns: torch.Tensor) -> None:
        """Rows first_row.. (num_rows of them) keep only the logits at columns; the rest become
        -inf. A row none of whose columns is finite stays as it was: a draft's row that cannot
        propose any of them (an EAGLE-3 head's reduced vocabulary) only proposes worse, and a
        target's row always can (the ingress admits only ids of its vocabulary)."""
        local = len(self._allowing_rows)
        self._allow_rows.append(torch.arange(local, local + num_rows,
                                             device=columns.device).repeat_interleave(len(columns)))
        self._allow_columns.append(columns.repeat(num_rows))
        self._allowing_rows.extend(range(first_row, first_row + num_rows))

    def penalize(self, first_row: int, columns: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
                 params: SamplingParams) -> None:
        """Rows first_row.. (one per row of counts [n, c]) get `penalize`d at columns [c]."""
        num_rows, num_columns = counts.shape
        rows = torch.arange(first_row, first_row + num_rows, device=columns.device).repeat_interleave(num_columns)
        self._penalty_rows.append(rows)
        self._penalty_columns.append(columns.repeat(num_rows))
        self._penalty_counts.append(counts.reshape(-1))
        self._penalty_seen.append(seen.reshape(-1))
        self._penalty_values.append((num_rows * num_columns, params.repetition_penalty, params.frequency_penalty,
                                     params.presence_penalty))

    def mask(self, first_row: int, allowed: torch.Tensor) -> None:
        """Rows first_row.. keep only the tokens allowed [n, V'] (bool, on the host) allows."""
        self._mask_rows.extend(range(first_row, first_row + allowed.shape[0]))
        self._masks.append(allowed)

    def forbid_stops(self, first_row: int, num_rows: int, stop_ids: Sequence[int]) -> None:
        """Rows first_row.. lose stop_ids (min_tokens), unless nothing else is left in a row (a
        grammar that is complete allows only EOS: the grammar wins over min_tokens)."""
        self._stop_rows.extend(range(first_row, first_row + num_rows))
        self._stop_ids.extend([list(stop_ids)] * num_rows)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits [N, V] float32: a new tensor where anything applies, else the
        logits themselves (no copy of a vocabulary-wide batch a step; callers only read it)."""
        logits = logits.float()
        if not (self._penalty_rows or self._masks or self._stop_rows or self._bias_rows or self._allowing_rows
                or self._ban_rows):
            return logits
        logits = logits.clone()
        device, vocab_size = logits.device, logits.shape[-1]
        if self._allowing_rows:
            rows = index_on(self._allowing_rows, device)
            kept = torch.zeros(len(self._allowing_rows), vocab_size, dtype=torch.bool, device=device)
            kept[torch.cat(self._allow_rows).to(device), torch.cat(self._allow_columns).to(device)] = True
            rows_logits = logits[rows]
            logits[rows] = unless_emptied(rows_logits.masked_fill(~kept, float("-inf")), rows_logits)
        if self._ban_rows:
            banning = sorted(set(self._ban_rows))
            rows, local = index_on(banning, device), {row: index for index, row in enumerate(banning)}
            kept = logits[rows]
            banned = kept.index_put((index_on([local[row] for row in self._ban_rows], device),
                                     index_on(self._ban_columns, device)), kept.new_full((), float("-inf")))
            logits[rows] = unless_emptied(banned, kept)
        if self._bias_rows:
            logits.index_put_((torch.cat(self._bias_rows).to(device), torch.cat(self._bias_columns).to(device)),
                              torch.cat(self._bias_values).to(device), accumulate=True)
        if self._penalty_rows:
            rows, columns = torch.cat(self._penalty_rows).to(device), torch.cat(self._penalty_columns).to(device)
            values = [host_to_device(torch.tensor([value[j] for value in self._penalty_values]), device)
                      for j in (1, 2, 3)]
            sizes = index_on([value[0] for value in self._penalty_values], device)
            repetition, frequency, presence = (value.repeat_interleave(sizes) for value in values)
            logits[rows, columns] = penalize(logits[rows, columns], torch.cat(self._penalty_counts).to(device),
                                             torch.cat(self._penalty_seen).to(device), repetition, frequency,
                                             presence)
        if self._masks:
            allowed = torch.cat([mask[:, :vocab_size] for mask in self._masks]).to(device, non_blocking=True)
            rows = index_on(self._mask_rows, device)
            logits[rows] = mask_logits(logits[rows], allowed)
        if self._stop_rows:
            rows = index_on(self._stop_rows, device)
            local = [i for i, ids in enumerate(self._stop_ids) for _ in ids]
            stops = [token for ids in self._stop_ids for token in ids]
            kept = logits[rows]
            others = kept.index_put((index_on(local, device), index_on(stops, device)), kept.new_full((), float("-inf")))
            logits[rows] = unless_emptied(others, kept)
        return logits


def unless_emptied(masked: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """masked's rows, except where masking left a row no finite logit: there the row as it was."""
    return torch.where(torch.isfinite(masked).any(dim=-1, keepdim=True), masked, rows)


class HistoryProcessor(Protocol):
    def contribute(self, batch: RowBatch, first_row: int, num_rows: int, block: Sequence[int] = ()) -> None:
        """Add this request's rows first_row .. first_row + num_rows - 1 of a batch to it: row i
        conditions on the history + block[:i] (len(block) >= num_rows - 1)."""

    def process(self, logits: torch.Tensor, block: Sequence[int] = ()) -> torch.Tensor:
        """Processed logits [n, V] from logits [n, V] (`contribute` for a batch of these rows alone)."""

    def advance(self, token_ids: Sequence[int]) -> None:
        """The history grows by token_ids (appended after it, in the output)."""


def _process_alone(processor: HistoryProcessor, logits: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    batch = RowBatch()
    processor.contribute(batch, 0, logits.shape[0], block)
    return batch.apply(logits)


class LogitBias:
    """A request's logit_bias and allowed_token_ids (decoding.sampling.SamplingParams), the same
    on every row whatever came before it. Ids past the rows' width are left out: the target's rows
    cover every id the ingress admits, and a draft with a smaller vocabulary only proposes worse
    (verification stays lossless); a draft row that has none of the allowed ids is left unmasked
    (`RowBatch.allow`)."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device | str = "cpu") -> None:
        biased = sorted((token, bias) for token, bias in params.logit_bias.items() if token < vocab_size)
        self.columns = torch.tensor([token for token, _ in biased], dtype=torch.long).to(device)
        self.values = torch.tensor([bias for _, bias in biased], dtype=torch.float32).to(device)
        allowed = sorted({token for token in params.allowed_token_ids or () if token < vocab_size})
        self.allowed = torch.tensor(allowed, dtype=torch.long).to(device) if allowed else None

    def contribute(self, batch: RowBatch, first_row: int, num_rows: int, block: Sequence[int] = ()) -> None:
        if self.allowed is not None:
            batch.allow(first_row, num_rows, self.allowed)
        if len(self.columns):
            batch.bias(first_row, num_rows, self.columns, self.values)

    def process(self, logits: torch.Tensor, block: Sequence[int] = ()) -> torch.Tensor:
        return _process_alone(self, logits, block)

    def advance(self, token_ids: Sequence[int]) -> None:
        """Nothing: the bias does not depend on the history."""


def bad_words_token_ids(words: Sequence[str], encode) -> list[list[int]]:
    """vLLM's tokenization of bad_words: each word as written (leading spaces dropped) and, where
    a leading space makes other tokens of the same count (a word in mid-text), that way too.
    encode(text) -> token ids without special tokens."""
    sequences = []
    for word in words:
        bare = encode(word.lstrip())
        if bare:
            sequences.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            sequences.append(spaced)
    return sequences


class BadWords:
    """vLLM's bad_words for one request, tokenized (SamplingParams.bad_words_token_ids): a row
    loses each word's last token where the output before it (committed output + the block's
    earlier tokens) ends with the rest of the word; a one-token word is banned everywhere. Only
    the output counts, not the prompt, as in vLLM."""

    def __init__(self, params: SamplingParams, token_ids: Sequence[int], prompt_len: int, vocab_size: int) -> None:
        self.words = [list(word) for word in params.bad_words_token_ids if word[-1] < vocab_size]
        self.longest = max((len(word) for word in self.words), default=1)
        self.output = list(token_ids[prompt_len:])

    def _banned(self, output: Sequence[int]) -> list[int]:
        return sorted({word[-1] for word in self.words
                       if len(word) == 1 or (len(output) >= len(word) - 1
                                             and list(output[len(output) - len(word) + 1:]) == word[:-1])})

    def contribute(self, batch: RowBatch, first_row: int, num_rows: int, block: Sequence[int] = ()) -> None:
        if len(block) < num_rows - 1:
            raise ValueError(f"{num_rows} rows need a block of at least {num_rows - 1} tokens, got {len(block)}")
        tail = self.output[len(self.output) - self.longest + 1:] if self.longest > 1 else []
        for row in range(num_rows):
            banned = self._banned(tail + list(block[:row]))
            if banned:
                batch.ban(first_row + row, banned)

    def process(self, logits: torch.Tensor, block: Sequence[int] = ()) -> torch.Tensor:
        return _process_alone(self, logits, block)

    def advance(self, token_ids: Sequence[int]) -> None:
        self.output.extend(token_ids)


class Penalties:
    """repetition / presence / frequency penalties (decoding.sampling.penalize) for one
    request. Only the columns of tokens the history holds can change, so the state is those
    distinct token ids and their output counts, and a call touches [rows, distinct tokens]
    instead of [rows, vocabulary]: its cost follows the history, not the vocabulary size."""

    def __init__(self, params: SamplingParams, token_ids: Sequence[int], prompt_len: int, vocab_size: int,
                 device: torch.device | str = "cpu") -> None:
        if not 0 <= prompt_len <= len(token_ids):
            raise ValueError(f"prompt_len {prompt_len} outside a history of {len(token_ids)} tokens")
        self.params = params
        self.vocab_size = vocab_size
        self.device = device
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device)
        self.seen_ids = torch.empty(0, dtype=torch.long, device=device)      # distinct, sorted
        self.output_counts = torch.empty(0, dtype=torch.float32, device=device)
        self._merge(ids[:prompt_len], counted=False)
        self._merge(ids[prompt_len:], counted=True)

    def _merge(self, ids: torch.Tensor, counted: bool) -> None:
        """Add ids to the seen tokens (and to the output counts when counted)."""
        merged, inverse = torch.unique(torch.cat([self.seen_ids, ids]), return_inverse=True)
        counts = torch.zeros(len(merged), device=merged.device)
        counts.index_add_(0, inverse[:len(self.seen_ids)], self.output_counts)
        if counted:
            counts.index_add_(0, inverse[len(self.seen_ids):], torch.ones(len(ids), device=merged.device))
        self.seen_ids, self.output_counts = merged, counts

    def contribute(self, batch: RowBatch, first_row: int, num_rows: int, block: Sequence[int] = ()) -> None:
        block_ids = torch.as_tensor(list(block[:num_rows - 1]), dtype=torch.long, device=self.seen_ids.device)
        if block_ids.numel() != num_rows - 1:
            raise ValueError(f"{num_rows} rows need a block of at least {num_rows - 1} tokens, got {len(block)}")
        columns = torch.unique(torch.cat([self.seen_ids, block_ids]))
        in_history = torch.isin(columns, self.seen_ids)
        counts = torch.zeros(num_rows, len(columns), device=columns.device)
        counts[:, torch.searchsorted(columns, self.seen_ids)] = self.output_counts
        seen = in_history.expand(num_rows, -1)
        if num_rows > 1:
            # Row i adds the block's first i tokens: a cumulative sum of their one-hot rows.
            added = torch.zeros_like(counts)
            positions = torch.searchsorted(columns, block_ids)
            added[1:] = torch.nn.functional.one_hot(positions, len(columns)).float().cumsum(dim=0)
            counts, seen = counts + added, seen | (added > 0)
        batch.penalize(first_row, columns, counts, seen, self.params)

    def process(self, logits: torch.Tensor, block: Sequence[int] = ()) -> torch.Tensor:
        return _process_alone(self, logits.to(self.seen_ids.device), block)

    def advance(self, token_ids: Sequence[int]) -> None:
        self._merge(torch.as_tensor(list(token_ids), dtype=torch.long, device=self.seen_ids.device), counted=True)


class GrammarMask:
    """A structured output's masks (decoding.grammar): row i keeps only the tokens the grammar
    allows after the history + block[:i], every other logit -inf. The matcher holds the history
    (the call's committed output, `GrammarMatchers.synced`); `advance` consumes drafted tokens
    into it, and the engine's next sync rolls them back. As in `GrammarMatcher.block_masks`, a
    forbidden token or EOS stops the walk and later rows repeat the last mask, so draft step i
    and target row i are masked alike. A row that allows nothing raises GrammarDeadEndError."""

    def __init__(self, matcher: GrammarMatcher) -> None:
        self.matcher = matcher
        self.stuck = False  # a token the grammar did not take was appended: the mask stays put

    def contribute(self, batch: RowBatch, first_row: int, num_rows: int, block: Sequence[int] = ()) -> None:
        if self.stuck:
            masks = self.matcher.allowed().expand(num_rows, -1)
        else:
            masks = self.matcher.block_masks(list(block[:num_rows - 1]))
        self.matcher.check_alive(masks)
        batch.mask(first_row, masks)

    def process(self, logits: torch.Tensor, block: Sequence[int] = ()) -> torch.Tensor:
        return _process_alone(self, logits, block)

    def advance(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            if self.stuck or not self.matcher.step(token):
                self.stuck = True


class Composed:
    """Several processors' rows added to one batch, which applies them in its own order
    (`RowBatch.apply`); each processor advances with the history."""

    def __init__(self, processors: Sequence[HistoryProcessor]) -> None:
        self.processors = list(processors)

    def contribute(self, batch: RowBatch, first_row: int, num_rows: int, block: Sequence[int] = ()) -> None:
        for processor in self.processors:
            processor.contribute(batch, first_row, num_rows, block)

    def process(self, logits: torch.Tensor, block: Sequence[int] = ()) -> torch.Tensor:
        return _process_alone(self, logits, block)

    def advance(self, token_ids: Sequence[int]) -> None:
        for processor in self.processors:
            processor.advance(token_ids)


def history_processor(params: SamplingParams, token_ids: Sequence[int], prompt_len: int | None,
                      vocab_size: int, device: torch.device | str = "cpu",
                      grammar: GrammarMatcher | None = None) -> HistoryProcessor | None:
    """The request's row processor for a call over token_ids (prompt + committed output;
    prompt_len tokens of prompt), or None when it has none, so that requests without a logit
    bias, penalties or a grammar pay nothing. grammar: the request's matcher synced to the committed
    output (needed when params.structured is set; None there leaves the rows unmasked, which
    only a draft may do: its proposals are then merely worse, verification stays lossless)."""
    processors: list[HistoryProcessor] = []
    if params.biases_logits:
        processors.append(LogitBias(params, vocab_size, device))
    if params.bad_words_token_ids:
        if prompt_len is None:
            raise ValueError("bad words need the prompt's length to find the output")
        processors.append(BadWords(params, token_ids, prompt_len, vocab_size))
    if params.uses_penalties:
        if prompt_len is None:
            raise ValueError("penalties need the prompt's length to tell output tokens from prompt tokens")
        processors.append(Penalties(params, token_ids, prompt_len, vocab_size, device))
    if grammar is not None:
        processors.append(GrammarMask(grammar))
    if len(processors) > 1:
        return Composed(processors)
    return processors[0] if processors else None
