"""Verifying a sampled block on O(K) numbers, so no [K, V] rows cross processes.

`rejection_sample` and `block_verify` (decoding.rejection) take the draft's and the target's dense
rows. Only a few numbers of those rows decide the outcome, and the target engine, which has p,
can compute them where p lives:

- the draft samples each token from a truncated support, the top `max_candidates` of its
  processed row q renormalised (`draft_support`; where the request's own top-k / top-p already cut
  the row shorter, that is exactly the processed row), and ships (ids, probs), not the [V] row.
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

from dataclasses import dataclass

import numpy as np
import torch

from specserve.decoding.rejection import _assemble, _block_weights, stop_probabilities_from_mass
from specserve.decoding.sampling import sample_from_probs


@dataclass(frozen=True)
class DraftSupport:
    """A draft block's q as (ids, probs) per position: ids [..., m], probs [..., m], each row
    summing to 1 over its ids (entries past the row's support have probability 0). Tensors in a
    process; numpy arrays (int32, float32) on the wire (`wire`), read back with `tensors`."""

    ids: torch.Tensor | np.ndarray
    probs: torch.Tensor | np.ndarray

    @staticmethod
    def stack(rows: "list[DraftSupport]") -> "DraftSupport":
        """Per-position supports [m] -> one block's [K, m]."""
        return DraftSupport(torch.stack([row.ids for row in rows]), torch.stack([row.probs for row in rows]))

    def wire(self) -> "DraftSupport":
        return DraftSupport(np.asarray(torch.as_tensor(self.ids).cpu(), dtype=np.int32),
                            np.asarray(torch.as_tensor(self.probs).cpu(), dtype=np.float32))

    def tensors(self, device: torch.device | str = "cpu") -> "DraftSupport":
        return DraftSupport(torch.as_tensor(np.array(self.ids) if isinstance(self.ids, np.ndarray) else self.ids,
                                            device=device).long(),
                            torch.as_tensor(np.array(self.probs) if isinstance(self.probs, np.ndarray)
                                            else self.probs, device=device).float())

    def rows(self, start: int, stop: int) -> "DraftSupport":
        """Positions start..stop - 1 of a block."""
        return DraftSupport(self.ids[start:stop], self.probs[start:stop])

    def dense(self, vocab_size: int) -> torch.Tensor:
        """The rows as [..., V] (zeros off the support)."""
        rows = torch.zeros(*self.ids.shape[:-1], vocab_size, dtype=torch.float32, device=self.ids.device)
        return rows.scatter_add_(-1, self.ids.long(), self.probs.float())

    def probs_of(self, token_ids: torch.Tensor) -> torch.Tensor:
        """q(x) per row [...] for token ids [...]: 0 where x is not in the row's support."""
        hits = self.ids.long() == token_ids.long().unsqueeze(-1)
        return (hits * self.probs.float()).sum(-1)


def draft_support(probs: torch.Tensor, max_candidates: int | None) -> DraftSupport:
    """The draft's sampling distribution from processed rows probs [..., V]: their top
    min(max_candidates, V) entries renormalised (None: the whole row). Rows already truncated to
    fewer tokens (top-k, top-p, min-p, a grammar mask) keep exactly their distribution."""
    probs = probs.float()
    if max_candidates is None or max_candidates >= probs.shape[-1]:  # the whole row: no sort needed
        return DraftSupport(torch.arange(probs.shape[-1], device=probs.device).expand_as(probs), probs)
    top = torch.topk(probs, max_candidates, dim=-1)
    return DraftSupport(top.indices, top.values / top.values.sum(-1, keepdim=True))


@dataclass(frozen=True)
class TargetNumbers:
    """What the target engine answers for a sampled block of K draft tokens (batch B):
    target_of_draft [B, K]: p_i(x_i); residual_mass [B, K]: sum_x max(P_i p_i(x) - q_i(x), 0);
    recovered [B, K]: a token drawn from norm(max(P_i p_i - q_i, 0)) (p_i if that is empty);
    bonus [B]: a token drawn from p_K."""

    target_of_draft: torch.Tensor
    residual_mass: torch.Tensor
    recovered: torch.Tensor
    bonus: torch.Tensor

    def tensors(self, device: torch.device | str = "cpu") -> "TargetNumbers":
        """A verify answer's plain lists (and the bonus an int: decoding.speculation.verify_answers
        brings a batch's numbers to the host in one copy) back as a batch of one."""
        return TargetNumbers(torch.tensor([self.target_of_draft], dtype=torch.float64, device=device),
                             torch.tensor([self.residual_mass], dtype=torch.float64, device=device),
                             torch.tensor([self.recovered], dtype=torch.long, device=device).reshape(1, -1),
                             torch.tensor([self.bonus], dtype=torch.long, device=device))


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
    generator: the target's own seeded stream, independent of the uniforms the owner draws."""
    batch_size, num_draft_tokens = draft_token_ids.shape
    draft_ids = draft_token_ids.long()
    target = target_probs.float()
    vocab_size = target.shape[-1]
    if support is None:
        draft = torch.zeros(batch_size, num_draft_tokens, vocab_size, device=target.device).scatter_(
            -1, draft_ids.unsqueeze(-1), 1.0)
    else:
        draft = support.tensors(target.device).dense(vocab_size)
    target_of_draft = target[:, :num_draft_tokens].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    if block and num_draft_tokens:
        draft_of_draft = draft.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
        weights = _block_weights(log_ratios(target_of_draft, draft_of_draft))[:, :num_draft_tokens]
    else:
        weights = torch.ones(batch_size, num_draft_tokens, dtype=torch.float64, device=target.device)
    rows = target[:, :num_draft_tokens]
    residual = (weights.float().unsqueeze(-1) * rows - draft).clamp_(min=0.0)
    mass = residual.sum(-1)
    recovered = sample_from_probs(torch.where((mass <= 0).unsqueeze(-1), rows, residual), generator).reshape(
        batch_size, num_draft_tokens)
    bonus = sample_from_probs(target[:, num_draft_tokens], generator)
    return TargetNumbers(target_of_draft.double(), mass.double(), recovered, bonus)


def compact_rejection_sample(draft_token_ids: torch.Tensor, draft_of_draft: torch.Tensor,
                             numbers: TargetNumbers, generator: torch.Generator | None = None) -> torch.Tensor:
    """Token-wise rejection sampling on the target's numbers (token-wise residuals): output ids
    [B, K+1] as rejection_sample's. draft_of_draft [B, K]: q_i(x_i) of the q the draft sampled
    from (DraftSupport.probs_of; ones for a deterministic proposer)."""
    batch_size, num_draft_tokens = draft_token_ids.shape
    uniform = torch.rand(batch_size, num_draft_tokens, generator=generator, device=draft_token_ids.device)
    accepted = uniform * draft_of_draft.double() < numbers.target_of_draft.double()   # u < p/q, no division
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
    return _assemble(draft_token_ids.long(), num_accepted, _emitted(numbers, num_accepted))


def compact_block_verify(draft_token_ids: torch.Tensor, draft_of_draft: torch.Tensor,
                         numbers: TargetNumbers, generator: torch.Generator | None = None) -> torch.Tensor:
    """Block verification (block_verify's algorithm) on the target's numbers (weighted residuals,
    `target_numbers(..., block=True)`): output ids [B, K+1]."""
    batch_size, num_draft_tokens = draft_token_ids.shape
    weights = _block_weights(log_ratios(numbers.target_of_draft, draft_of_draft))            # P_0..P_K
    stop = stop_probabilities_from_mass(weights, numbers.residual_mass[:, 1:])                  # h_1..h_K
    uniform = torch.rand(batch_size, num_draft_tokens, generator=generator, device=draft_token_ids.device)
    positions = torch.arange(1, num_draft_tokens + 1, device=draft_token_ids.device)
    num_accepted = ((uniform.double() < stop).long() * positions).max(dim=-1).values if num_draft_tokens else (
        torch.zeros(batch_size, dtype=torch.long, device=draft_token_ids.device))
    return _assemble(draft_token_ids.long(), num_accepted, _emitted(numbers, num_accepted))


def _emitted(numbers: TargetNumbers, num_accepted: torch.Tensor) -> torch.Tensor:
    """The bonus token where every draft token was accepted, else the recovered one at the cut."""
    num_draft_tokens = numbers.recovered.shape[1]
    if num_draft_tokens == 0:
        return numbers.bonus.long()
    at_cut = numbers.recovered.long().gather(1, num_accepted.clamp(max=num_draft_tokens - 1).unsqueeze(1)).squeeze(1)
    return torch.where(num_accepted == num_draft_tokens, numbers.bonus.long(), at_cut)


def sample_from_support(support: DraftSupport, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of support [..., m] -> LongTensor [...], drawn from its probs."""
    pick = sample_from_probs(support.probs, generator)
    return support.ids.long().gather(-1, pick.unsqueeze(-1)).squeeze(-1)
