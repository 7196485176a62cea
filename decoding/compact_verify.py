"""Verifying a sampled block on O(K) numbers, so no [K, V] rows cross processes.

`rejection_sample` and `block_verify` (decoding.rejection) take the draft's and the target's dense
rows. Only a few numbers of those rows decide the outcome, and the target engine, which has p,
can compute them where p lives:

- the draft samples each token from a truncated support, the likely tokens of its processed row q
  (at most `max_candidates`, the likeliest) renormalised (`draft_support`; where the request's own
  top-k / top-p already cut the row shorter, that is exactly the processed row), and ships (ids,
  probs), not the [V] row.
  Verification is exact for whatever q the draft sampled from, as long as the verifier uses that
  very q: a truncated q only lowers acceptance by the mass it cut;
- the target computes, per drafted position i (`target_numbers`), p_i(x_i), a token drawn from the
  position's residual norm(max(P_i p_i - q_i, 0)) (P_i = 1 token-wise; block verification's weight
  otherwise), the residual's mass, and a bonus token from p_K, with its own seeded generator;
- the request's owner draws the acceptance uniforms and picks the outcome
  (`compact_rejection_sample`, `compact_block_verify`).

Why it is exact: which position the block is cut at depends only on the uniforms and on p_i(x_i),
q_i(x_i) and the residual masses, never on the residual draws, and the token emitted there is a
draw from that position's residual (or the bonus from p_K), made independently of the uniforms.
So each verifier's output has the distribution its dense form has (the same algorithm, the same
residuals), which is the target's (decoding.rejection's docstrings; tests/test_compact_verify.py).
Drawing every position's residual although one is used costs K samples on the target, and keeps
the router's work O(K).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.decoding.device_copy import host_to_device
from specserve.decoding.rejection import PLACEHOLDER_TOKEN_ID, _block_weights
from specserve.decoding.sampling import inverse_cdf, row_chunks, sample_from_probs


@dataclass(frozen=True)
class DraftSupport:
    """A draft block's q as (ids, probs) per position: ids [..., m], probs [..., m], each row
    summing to 1 over its ids (entries past the row's support have probability 0). Tensors in a
    process; numpy arrays (int32, float32) on the wire (`wire`), read back with `tensors`."""

    ids: torch.Tensor | np.ndarray
    probs: torch.Tensor | np.ndarray

    @staticmethod
    def stack(rows: "list[DraftSupport]") -> "DraftSupport":
        """Per-position supports [m_i] -> one block's [K, max m_i], a narrower row padded with
        probability-0 entries (a cut row's support is as wide as its step's widest kept row:
        `draft_support`)."""
        width = max(row.width for row in rows)
        return DraftSupport(torch.stack([torch.nn.functional.pad(row.ids, (0, width - row.width)) for row in rows]),
                            torch.stack([torch.nn.functional.pad(row.probs, (0, width - row.width)) for row in rows]))

    def wire(self) -> "DraftSupport":
        """As numpy arrays; rows that are whole vocabularies in id order (`draft_support` where nothing
        cut them) travel without their ids, which are 0..V-1: an empty ids array stands for them."""
        ids = torch.as_tensor(self.ids)
        probs = np.asarray(torch.as_tensor(self.probs).cpu(), dtype=np.float32)
        if _in_id_order(ids):
            return DraftSupport(np.zeros((*probs.shape[:-1], 0), dtype=np.int32), probs)
        return DraftSupport(np.asarray(ids.cpu(), dtype=np.int32), probs)

    def tensors(self, device: torch.device | str = "cpu") -> "DraftSupport":
        probs = torch.as_tensor(np.array(self.probs) if isinstance(self.probs, np.ndarray) else self.probs,
                                device=device).float()
        if self.ids.shape[-1] == 0 and probs.shape[-1] > 0:   # whole rows off the wire
            return DraftSupport(torch.arange(probs.shape[-1], device=device).expand_as(probs), probs)
        return DraftSupport(torch.as_tensor(np.array(self.ids) if isinstance(self.ids, np.ndarray) else self.ids,
                                            device=device).long(), probs)

    @property
    def width(self) -> int:
        """Entries a row holds (on the wire too, where whole rows carry no ids)."""
        return self.probs.shape[-1]

    def rows(self, start: int, stop: int) -> "DraftSupport":
        """Positions start..stop - 1 of a block."""
        return DraftSupport(self.ids[start:stop], self.probs[start:stop])

    def dense(self, vocab_size: int) -> torch.Tensor:
        """The rows as [..., V] (zeros off the support)."""
        rows = torch.zeros(*self.ids.shape[:-1], vocab_size, dtype=torch.float32, device=self.ids.device)
        return rows.scatter_add_(-1, self.ids.long(), self.probs.float())

    def probs_of(self, token_ids: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        """q(x) per row [...] for token ids [...]: 0 where x is not in the row's support. Tensors
        in a process; off the wire (numpy, whole rows without their ids) a numpy array, as the
        router's verifiers take it."""
        if isinstance(self.probs, np.ndarray):
            token_ids = np.asarray(token_ids, dtype=np.int64)[..., None]
            if self.ids.shape[-1] == 0:   # whole rows: x is its own index
                return np.take_along_axis(self.probs, token_ids, axis=-1)[..., 0]
            return np.where(self.ids == token_ids, self.probs, np.float32(0)).sum(-1)
        hits = self.ids.long() == torch.as_tensor(token_ids, device=self.ids.device).long().unsqueeze(-1)
        return (hits * self.probs.float()).sum(-1)


def _in_id_order(ids: torch.Tensor) -> bool:
    """Every row is 0..V-1 (a whole vocabulary in id order)."""
    width = ids.shape[-1]
    return width > 1 and ids.numel() > 0 and bool((ids == torch.arange(width, device=ids.device)).all())


# A draft's q leaves out the tokens whose probability is at most this share of its likeliest's.
TAIL_SHARE = 2.0 ** -20
FLAT_SAMPLE_STRIDE = 16   # draft_support looks for flat rows among every this-many-th id


def draft_support(probs: torch.Tensor, max_candidates: int | None, cut: bool = False) -> DraftSupport:
    """The draft's sampling distribution from processed rows probs [..., V]: each row's likely
    tokens, at most min(max_candidates, V) of them (the likeliest), renormalised (None: the whole
    row). Rows already truncated to fewer tokens (top-k, top-p, min-p, a grammar mask) keep exactly
    their distribution.

    Likely: above TAIL_SHARE of the row's likeliest token's probability, or, where some row may be
    truncated (cut), above 0. Why the tail is left out: finding a row's likeliest few thousand
    of a large vocabulary (a top-k over all of it) costs a CPU several times what a pass that
    marks the likely tokens and gathers them does, and the tail tokens among the top
    max_candidates hold at most max_candidates * TAIL_SHARE of the likeliest's mass, which a
    rejection sampler loses as acceptance only: verification is exact for whatever q the draft
    drew from. Where more tokens
    than max_candidates are likely, the likeliest of them are kept (a top-k over those alone, or
    over the whole row where several times max_candidates are likely).

    On a CPU the support is as wide as the row with the most likely tokens (one host read of the
    counts), a narrower row padded with probability-0 entries, so a peaked row's q travels as the
    tokens it holds, not max_candidates of them. On an accelerator a top-k over the row costs
    little and that read would stall the step, so an uncut support is max_candidates wide, its
    tail's entries at probability 0 (a cut one still takes its width from one read, as the kept
    tokens' count). A cut support is in id order, as a whole row is, so a seeded draw from a cut
    row picks the token the same draw picks from the dense row, whatever max_candidates is."""
    probs = probs.float()
    vocab_size = probs.shape[-1]
    width = vocab_size if max_candidates is None else min(max_candidates, vocab_size)
    if width >= vocab_size or not probs.numel():  # the whole row: nothing to find
        return DraftSupport(torch.arange(vocab_size, device=probs.device).expand_as(probs), probs)
    rows = probs.reshape(-1, vocab_size)
    floor = 0.0 if cut else rows.amax(dim=-1, keepdim=True) * TAIL_SHARE
    if rows.device.type == "cpu":
        values, ids = _likeliest_of_likely(rows, floor, width)
    else:
        values, ids = _top_entries_above(rows, floor, width, cut)
    if cut:
        ids, order = ids.sort(dim=-1)
        values = values.gather(-1, order)
    shape = (*probs.shape[:-1], ids.shape[-1])
    return DraftSupport(ids.reshape(shape), (values / values.sum(-1, keepdim=True)).reshape(shape))


def _top_entries_above(rows: torch.Tensor, floor: torch.Tensor | float, width: int,
                       cut: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [n, width] of each row's top width entries, those at or below floor set to
    0: the likely entries without reading a count back (cut rows: width is their widest kept count,
    one read)."""
    if cut:
        width = min(width, max(1, int((rows > 0).sum(dim=-1).max())))
    values, ids = torch.topk(rows, width, dim=-1, sorted=False)
    return values * (values > floor), ids


def _likeliest_of_likely(rows: torch.Tensor, floor: torch.Tensor | float,
                         width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [n, m] of each row's entries above floor, at most width of them, the
    likeliest; m the most any row keeps, the others padded with (0, id 0). Gathered in id order
    where they fit; past that a top-k over them, or over the whole rows where some row has far
    more (`_top_entries_above`). A flat row, most of its ids likely, shows so in every
    FLAT_SAMPLE_STRIDE-th id, read first at a fraction of the cost of marking every id."""
    sampled = (rows[:, ::FLAT_SAMPLE_STRIDE] > floor).sum(dim=-1)
    if int(sampled.max()) * FLAT_SAMPLE_STRIDE > 8 * width:
        return _top_entries_above(rows, floor, width, cut=False)
    likely = rows > floor
    counts = likely.sum(dim=-1)
    widest = max(1, int(counts.max()))
    if widest > 4 * width:
        return _top_entries_above(rows, floor, width, cut=False)
    row_of, ids_of = likely.nonzero(as_tuple=True)   # in row, then id order
    slot = torch.arange(ids_of.numel(), device=rows.device) - (counts.cumsum(0) - counts)[row_of]
    ids = torch.zeros(rows.shape[0], widest, dtype=torch.long, device=rows.device)
    values = torch.zeros(rows.shape[0], widest, device=rows.device)
    ids[row_of, slot] = ids_of
    values[row_of, slot] = rows[row_of, ids_of]
    if widest <= width:
        return values, ids
    values, order = torch.topk(values, width, dim=-1, sorted=False)
    return values, ids.gather(-1, order)


def saguaro_support(support: DraftSupport, num_lowered: int, downweight: float) -> DraftSupport:
    """The draft's q with its num_lowered most likely tokens per row scaled by downweight (< 1)
    and renormalised: Saguaro sampling (Kumar, Dao, May, "Speculative Speculative Decoding",
    2026). The draft samples from, and is verified against, this q. Where the target rejects, it
    emits a token from the residual norm(max(p - q, 0)); taking mass off the draft's top tokens
    puts that residual on them, and those are the tokens the speculation cache pre-drafts for
    (docs/speculation-cache.md). Exact for any downweight, since verification uses the q sampled
    from; it costs acceptance, the mass moved to the tail. downweight 1 or num_lowered 0: q as it is."""
    if downweight >= 1.0 or num_lowered <= 0:
        return support
    if not 0.0 < downweight:
        raise ValueError(f"the Saguaro downweight must be in (0, 1], got {downweight}")
    probs = support.probs.float()
    lowered = torch.topk(probs, min(num_lowered, probs.shape[-1]), dim=-1).indices
    scale = torch.ones_like(probs).scatter_(-1, lowered, downweight)
    scaled = probs * scale
    return DraftSupport(support.ids, scaled / scaled.sum(-1, keepdim=True))


@dataclass(frozen=True)
class TargetNumbers:
    """What the target engine answers for a sampled block of K draft tokens (batch B):
    target_of_draft [B, K]: p_i(x_i); residual_mass [B, K]: sum_x max(P_i p_i(x) - q_i(x), 0);
    recovered [B, K]: a token drawn from norm(max(P_i p_i - q_i, 0)) (p_i if that is empty);
    bonus [B]: a token drawn from p_K. Tensors in a process; a verify answer off the wire holds
    one request's as plain lists and its bonus as an int (decoding.speculation.verify_answers
    brings a batch's numbers to the host in one copy), which the verifiers read as a batch of one."""

    target_of_draft: torch.Tensor | Sequence[float]
    residual_mass: torch.Tensor | Sequence[float]
    recovered: torch.Tensor | Sequence[int]
    bonus: torch.Tensor | int


def log_ratios(target_of_draft: torch.Tensor, draft_of_draft: torch.Tensor) -> torch.Tensor:
    """log p(x)/q(x) float64: +inf where q(x) = 0 < p(x), -inf where p(x) = 0 (as block_verify)."""
    target_of_draft, draft_of_draft = target_of_draft.double(), draft_of_draft.double()
    return torch.where(target_of_draft > 0,
                       torch.where(draft_of_draft > 0, target_of_draft.log() - draft_of_draft.log(), float("inf")),
                       float("-inf"))


def target_numbers(draft_token_ids: torch.Tensor, support: DraftSupport | None, target_probs: torch.Tensor,
                   generator: torch.Generator | None = None, block: bool = False) -> TargetNumbers:
    """The target side of a sampled round. draft_token_ids [B, K]; support: the draft's q rows
    [B, K, m] (None: a deterministic proposer, q one-hot at x); target_probs: processed rows
    [B, K+1, V]; block: weight the residuals for block verification (P_i), else token-wise (P = 1).
    generator: the target's own seeded stream, independent of the uniforms the owner draws: every
    residual draw first, then every bonus draw. (A batch of requests, each with its own K and
    stream, is `ragged_target_numbers`.)"""
    batch_size, num_draft_tokens = draft_token_ids.shape
    draft_ids = draft_token_ids.long()
    target = target_probs.float()
    vocab_size = target.shape[-1]
    if support is None:
        draft = torch.zeros(batch_size, num_draft_tokens, vocab_size, device=target.device).scatter_(
            -1, draft_ids.unsqueeze(-1), 1.0)
    else:
        draft = support.tensors(target.device).dense(vocab_size)
    rows = target[:, :num_draft_tokens]
    target_of_draft = rows.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    if block and num_draft_tokens:
        draft_of_draft = draft.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
        weights = _block_weights(log_ratios(target_of_draft, draft_of_draft))[:, :num_draft_tokens]
    else:
        weights = torch.ones(batch_size, num_draft_tokens, dtype=torch.float64, device=target.device)
    mass, sampled = _residual_rows(weights, rows, draft)
    recovered = sample_from_probs(sampled, generator).reshape(batch_size, num_draft_tokens)
    bonus = sample_from_probs(target[:, num_draft_tokens], generator)
    return TargetNumbers(target_of_draft.double(), mass.double(), recovered, bonus)


@dataclass(frozen=True)
class RaggedNumbers:
    """`ragged_target_numbers`' answer for requests i = 0..B-1 with K_i draft tokens, flat in
    request order: target_of_draft and residual_mass [sum K_i] (float64); tokens [sum (K_i + 1)]:
    request i's K_i residual draws, then its bonus draw."""

    num_draft_tokens: list[int]
    target_of_draft: torch.Tensor
    residual_mass: torch.Tensor
    tokens: torch.Tensor


def ragged_target_numbers(target_probs: torch.Tensor, draft_token_ids: Sequence[Sequence[int]],
                          supports: Sequence[DraftSupport | None], generators: Sequence[torch.Generator | None],
                          block: Sequence[bool]) -> RaggedNumbers:
    """`target_numbers` for a batch of requests, each with its own block length K_i, q (support
    [K_i, m_i], or None for a deterministic proposer), verification and seeded stream, in one pass
    of batched ops: target_probs [sum (K_i + 1), V] holds request i's K_i + 1 processed rows
    consecutively. Request i's numbers equal `target_numbers` on its rows alone with its generator,
    bit for bit on CPU (the same row-wise arithmetic, and its stream draws its K_i residual
    uniforms, then its bonus uniform, as there): a seeded request answers the same whatever shares
    its verify. What runs per request is building index lists and two draws from its generator.

    Every row goes through the residual arithmetic, the bonus rows too, with q = 0 and weight 1
    there: max(1 * p - 0, 0) is p itself, so the bonus is drawn from p as `target_numbers` does,
    and no row is copied out of or back into the batch."""
    device = target_probs.device
    counts = [len(ids) for ids in draft_token_ids]
    target = target_probs.float()
    num_rows, vocab_size = target.shape
    # Host-side layout, one host -> device copy: each draft position's row in target_probs and its
    # place in a [B, max K] padding (for the block weights' running sums), then the drafted ids.
    draft_rows, padded_at, row, width = [], [], 0, max(counts, default=0)
    for i, count in enumerate(counts):
        draft_rows.extend(range(row, row + count))
        padded_at.extend(range(i * width, i * width + count))
        row += count + 1
    if row != num_rows:
        raise ValueError(f"{num_rows} target rows for blocks needing {row}")
    num_positions = len(draft_rows)
    layout = host_to_device(torch.tensor(draft_rows + padded_at + [int(t) for ids in draft_token_ids for t in ids],
                                         dtype=torch.long), device)
    draft_rows_at, padded_at, draft_ids = layout.split([num_positions] * 3)
    support_ids, support_probs = _stacked_supports(supports, draft_token_ids, device)
    target_of_draft = target[draft_rows_at, draft_ids]
    weights = torch.ones(num_rows, dtype=torch.float64, device=device)
    if any(b and count for b, count in zip(block, counts)):
        draft_of_draft = ((support_ids == draft_ids.unsqueeze(-1)) * support_probs).sum(-1)
        ratios = log_ratios(target_of_draft, draft_of_draft)
        padded = torch.zeros(len(counts) * width, dtype=torch.float64, device=device).index_copy_(0, padded_at, ratios)
        block_weights = _block_weights(padded.view(len(counts), width))[:, :width].reshape(-1)[padded_at]
        is_block = host_to_device(torch.tensor([b for b, count in zip(block, counts) for _ in range(count)],
                                               dtype=torch.bool), device)
        weights[draft_rows_at] = torch.where(is_block, block_weights, 1.0)
    uniforms = torch.cat([draw for count, generator in zip(counts, generators) for draw in (
        *((torch.rand(count, generator=generator, dtype=torch.float64, device=device),) if count else ()),
        torch.rand(1, generator=generator, dtype=torch.float64, device=device))])
    mass = torch.empty(num_rows, dtype=torch.float32, device=device)
    tokens = torch.empty(num_rows, dtype=torch.long, device=device)
    for start, stop in row_chunks(num_rows, vocab_size, device):
        first, last = bisect_left(draft_rows, start), bisect_left(draft_rows, stop)
        # max(P p - q, 0) with q sparse: P p everywhere, then q taken off at its support (adding -q
        # is subtracting q, bit for bit; padding entries add -0) and the clamp applied there, the
        # only entries it can change. At a bonus row this leaves p itself (P = 1, no q).
        rows = target[start:stop]
        residual = weights[start:stop].float().unsqueeze(-1) * rows
        ids = support_ids[first:last]
        at_support = ((draft_rows_at[first:last] - start).unsqueeze(-1).expand_as(ids), ids)
        residual.index_put_(at_support, -support_probs[first:last], accumulate=True)
        residual[at_support] = residual[at_support].clamp(min=0.0)
        mass[start:stop] = residual.sum(-1)
        spent = mass[start:stop] <= 0   # p = q at that position: the draw is p's
        # A CPU reads the flags for free and skips the whole-row select when no row needs it.
        if device.type != "cpu" or bool(spent.any()):
            residual = torch.where(spent.unsqueeze(-1), rows, residual)
        tokens[start:stop] = inverse_cdf(residual, uniforms[start:stop])
    return RaggedNumbers(counts, target_of_draft.double(), mass[draft_rows_at].double(), tokens)


def _stacked_supports(supports: Sequence[DraftSupport | None], draft_token_ids: Sequence[Sequence[int]],
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every draft position's q as (ids, probs) [sum K_i, m], padded with probability-0 entries to
    the widest support: a request's support, or (x, 1) for a deterministic proposer's token x."""
    widths = [support.width for support, block in zip(supports, draft_token_ids)
              if support is not None and block]
    width = max(widths, default=1)
    ids, probs = [], []
    for support, block in zip(supports, draft_token_ids):
        if not block:
            continue
        if support is None:
            ids.append(torch.nn.functional.pad(torch.tensor(list(block), dtype=torch.long).view(-1, 1),
                                               (0, width - 1)))
            probs.append(torch.nn.functional.pad(torch.ones(len(block), 1), (0, width - 1)))
            continue
        # Off the wire: numpy, made host tensors here and copied over once for the batch below; in
        # process: tensors, left on their device.
        rows = support.tensors(support.ids.device if isinstance(support.ids, torch.Tensor) else "cpu")
        pad = (0, width - rows.ids.shape[-1])
        ids.append(torch.nn.functional.pad(rows.ids.reshape(len(block), -1), pad))
        probs.append(torch.nn.functional.pad(rows.probs.reshape(len(block), -1), pad))
    if not ids:
        return (torch.zeros(0, width, dtype=torch.long, device=device),
                torch.zeros(0, width, dtype=torch.float32, device=device))
    return _on(ids, device), _on(probs, device)


def _on(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """parts concatenated on device: host parts (off the wire) in one copy that makes the host wait
    for nothing, parts already there (in process) as they are."""
    if all(part.device.type == "cpu" for part in parts):
        return host_to_device(torch.cat(parts), device)
    return torch.cat([part.to(device) for part in parts])


def _residual_rows(weights: torch.Tensor, rows: torch.Tensor, draft: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual mass, the rows to draw recovered tokens from): max(P p - q, 0) and its mass per
    draft position, and where the residual is empty (p = q there) p itself."""
    residual = (weights.float().unsqueeze(-1) * rows - draft).clamp_(min=0.0)
    mass = residual.sum(-1)
    return mass, torch.where((mass <= 0).unsqueeze(-1), rows, residual)


def compact_rejection_sample(draft_token_ids, draft_of_draft, numbers: TargetNumbers,
                             generator: torch.Generator | None = None) -> np.ndarray:
    """Token-wise rejection sampling on the target's numbers (token-wise residuals): output ids
    [B, K+1] as rejection_sample's, a numpy array. draft_token_ids and draft_of_draft [B, K]:
    the drafted ids and their q_i(x_i) under the q the draft sampled from (DraftSupport.probs_of;
    ones for a deterministic proposer); arrays, tensors or lists, as the target's numbers are.

    Why on the host, in numpy: the owner verifies one request's block at a time on a few numbers,
    where each torch op's dispatch would cost more than its arithmetic (docs/sampling.md,
    "Verification on O(K) numbers")."""
    draft_ids, batch_size, num_draft_tokens = _draft_block(draft_token_ids)
    target_of_draft, _, recovered, bonus = _numbers_on_host(numbers, batch_size, num_draft_tokens)
    uniform = acceptance_uniforms(generator, batch_size, num_draft_tokens)
    # u < p/q written as u*q < p: q(x) = 0 < p(x) accepts, p(x) = 0 always rejects, no division.
    accepted = uniform * _on_host(draft_of_draft, np.float64).reshape(batch_size, num_draft_tokens) < target_of_draft
    num_accepted = np.cumprod(accepted, axis=-1).sum(axis=-1)
    return _assembled(draft_ids, num_accepted, recovered, bonus)


def compact_block_verify(draft_token_ids, draft_of_draft, numbers: TargetNumbers,
                         generator: torch.Generator | None = None) -> np.ndarray:
    """Block verification (block_verify's algorithm) on the target's numbers (weighted residuals,
    `target_numbers(..., block=True)`): output ids [B, K+1], a numpy array; arguments as
    compact_rejection_sample's."""
    draft_ids, batch_size, num_draft_tokens = _draft_block(draft_token_ids)
    target_of_draft, residual_mass, recovered, bonus = _numbers_on_host(numbers, batch_size, num_draft_tokens)
    draft_of_draft = _on_host(draft_of_draft, np.float64).reshape(batch_size, num_draft_tokens)
    weights = host_block_weights(host_log_ratios(target_of_draft, draft_of_draft))            # P_0..P_K
    stop = host_stop_probabilities(weights, residual_mass[:, 1:])                               # h_1..h_K
    uniform = acceptance_uniforms(generator, batch_size, num_draft_tokens)
    positions = np.arange(1, num_draft_tokens + 1)
    num_accepted = ((uniform < stop) * positions).max(axis=-1, initial=0)
    return _assembled(draft_ids, num_accepted, recovered, bonus)


def acceptance_uniforms(generator: torch.Generator | None, batch_size: int, num_draft_tokens: int) -> np.ndarray:
    """The owner's acceptance uniforms [B, K] (float64 holding float32 draws), from its generator's
    stream on the generator's device, so a seeded request draws what it always has."""
    device = generator.device if generator is not None else "cpu"
    uniform = torch.rand(batch_size, num_draft_tokens, generator=generator, device=device)
    return uniform.cpu().numpy().astype(np.float64)


def host_log_ratios(target_of_draft: np.ndarray, draft_of_draft: np.ndarray) -> np.ndarray:
    """`log_ratios` on host arrays (float64): +inf where q(x) = 0 < p(x), -inf where p(x) = 0."""
    with np.errstate(divide="ignore"):
        return np.where(target_of_draft > 0,
                        np.where(draft_of_draft > 0, np.log(target_of_draft) - np.log(draft_of_draft), np.inf),
                        -np.inf)


def host_block_weights(log_ratio: np.ndarray) -> np.ndarray:
    """decoding.rejection's `_block_weights` on host arrays: P_0..P_K [B, K+1] (float64) from the
    log ratios [B, K], the same sums, running maxima and sentinels (tests hold the two equal)."""
    finite = np.clip(log_ratio, -1e30, 1e10)
    sums = np.concatenate([np.zeros_like(finite[:, :1]), np.cumsum(finite, axis=-1)], axis=1)
    return np.exp(sums - np.maximum.accumulate(sums, axis=-1))


def host_stop_probabilities(weights: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """decoding.rejection's `stop_probabilities_from_mass` on host arrays: h_1..h_K [B, K]."""
    num_draft_tokens = weights.shape[1] - 1
    inner = weights[:, 1:num_draft_tokens]
    stop = np.where(mass > 0, mass / np.maximum(mass + 1.0 - inner, 1e-300), 0.0)
    return np.concatenate([stop, weights[:, num_draft_tokens:]], axis=1)


def _on_host(values, dtype) -> np.ndarray:
    """A tensor (on any device), an array or a list as a numpy array of dtype."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=dtype)


def _draft_block(draft_token_ids) -> tuple[np.ndarray, int, int]:
    """(draft ids [B, K] int64, B, K)."""
    draft_ids = _on_host(draft_token_ids, np.int64)
    draft_ids = draft_ids.reshape(1, -1) if draft_ids.ndim < 2 else draft_ids
    return draft_ids, draft_ids.shape[0], draft_ids.shape[1]


def _numbers_on_host(numbers: TargetNumbers, batch_size: int, num_draft_tokens: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The target's numbers as host arrays: p_i(x_i) and residual masses [B, K] float64,
    recovered [B, K] and bonus [B] int64 (a verify answer's flat lists are a batch of one)."""
    shape = (batch_size, num_draft_tokens)
    return (_on_host(numbers.target_of_draft, np.float64).reshape(shape),
            _on_host(numbers.residual_mass, np.float64).reshape(shape),
            _on_host(numbers.recovered, np.int64).reshape(shape),
            _on_host(numbers.bonus, np.int64).reshape(batch_size))


def _assembled(draft_ids: np.ndarray, num_accepted: np.ndarray, recovered: np.ndarray,
               bonus: np.ndarray) -> np.ndarray:
    """Output ids [B, K+1]: the first num_accepted draft ids, then the bonus token where every
    draft token was accepted or the recovered one at the cut, then PLACEHOLDER_TOKEN_ID."""
    batch_size, num_draft_tokens = draft_ids.shape
    rows = np.arange(batch_size)
    if num_draft_tokens:
        at_cut = recovered[rows, np.minimum(num_accepted, num_draft_tokens - 1)]
        emitted = np.where(num_accepted == num_draft_tokens, bonus, at_cut)
    else:
        emitted = bonus
    output = np.full((batch_size, num_draft_tokens + 1), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
    output[:, :num_draft_tokens] = np.where(np.arange(num_draft_tokens) < num_accepted[:, None], draft_ids,
                                            PLACEHOLDER_TOKEN_ID)
    output[rows, num_accepted] = emitted
    return output


def sample_from_support(support: DraftSupport, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of support [..., m] -> LongTensor [...], drawn from its probs."""
    pick = sample_from_probs(support.probs, generator)
    return support.ids.long().gather(-1, pick.unsqueeze(-1)).squeeze(-1)
