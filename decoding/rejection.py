"""Speculative-decoding rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

Vocabulary (as in vLLM's rejection sampler):
- draft tokens: the K ids x_1..x_K a proposer guessed, with their processed draft rows q_i
  (or no rows at all for a deterministic proposer such as n-gram lookup: q_i is one-hot at x_i).
- accepted tokens: the longest prefix of draft tokens that survives the test u_i < p_i(x_i)/q_i(x_i).
- recovered token: at the first rejected position i, a token drawn from norm(max(0, p_i - q_i)).
- bonus token: when all K draft tokens are accepted, a token drawn from the target's row K.
- output tokens: accepted tokens, then exactly one recovered or bonus token, then
  PLACEHOLDER_TOKEN_ID (-1) for the unused slots, so every row of a batch has width K + 1.

Why it is lossless: a draft token x ~ q is kept with probability min(1, p(x)/q(x)), so it is
emitted with probability min(p(x), q(x)); a rejection happens with probability
sum_y max(0, p(y) - q(y)) and then emits y with probability proportional to max(0, p(y) - q(y)).
The two add up to p(x) exactly. Position i's row p_i is the target's distribution given the prefix
including the accepted x_1..x_{i-1}, so every emitted token follows the target's conditional.
"""

from __future__ import annotations

import torch

from decoding.sampling import sample_from_probs

PLACEHOLDER_TOKEN_ID = -1


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Verify a block of draft tokens against the target; returns output token ids [B, K+1].

    draft_token_ids: LongTensor [B, K] (K may be 0: then one token is sampled from target row 0,
        which is how the first token after prefill is drawn).
    draft_probs: processed draft rows q [B, K, V], or None for a deterministic proposer (q one-hot
        at the draft token: accept iff u < p(x); the residual is p with x removed).
    target_probs: processed target rows p [B, K+1, V]; row K is for the bonus token.
    generator: torch.Generator on target_probs' device; the same seed gives the same output.

    Row b of the result holds n_b accepted draft tokens, then one recovered token (first
    rejection at position n_b < K) or the bonus token (n_b == K), then -1 padding. Rows need not
    be normalised but must be non-negative. If a residual max(0, p - q) is all zero (only possible
    when the draft proposed a token both p and q give zero mass), p itself is used instead.
    """
    _check_shapes(draft_token_ids, draft_probs, target_probs)
    batch_size, num_draft_tokens = draft_token_ids.shape
    device = target_probs.device
    if num_draft_tokens == 0:
        return sample_from_probs(target_probs[:, 0], generator).unsqueeze(1)

    draft_ids = draft_token_ids.long().unsqueeze(-1)
    target_of_draft = target_probs[:, :num_draft_tokens].gather(-1, draft_ids).squeeze(-1).float()
    if draft_probs is None:
        draft_of_draft = torch.ones_like(target_of_draft)
    else:
        draft_of_draft = draft_probs.gather(-1, draft_ids).squeeze(-1).float()

    # u < p/q written as u*q < p: q(x) = 0 < p(x) accepts, p(x) = 0 always rejects, no division.
    uniform = torch.rand(batch_size, num_draft_tokens, generator=generator, device=device)
    accepted = uniform * draft_of_draft < target_of_draft                      # [B, K]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)                 # [B], in 0..K

    # One row per sequence to sample the emitted token from: position n_b of the target, minus
    # the draft's mass there when n_b < K (recovered); the plain target row when n_b == K (bonus).
    rows = torch.arange(batch_size, device=device)
    all_accepted = num_accepted == num_draft_tokens
    target_row = target_probs[rows, num_accepted].float()                      # [B, V]
    rejected_position = num_accepted.clamp(max=num_draft_tokens - 1)
    if draft_probs is None:
        draft_row = torch.zeros_like(target_row).scatter_(
            -1, draft_token_ids[rows, rejected_position].long().unsqueeze(-1), 1.0)
    else:
        draft_row = draft_probs[rows, rejected_position].float()
    draft_row = draft_row.masked_fill(all_accepted.unsqueeze(-1), 0.0)
    residual = (target_row - draft_row).clamp_(min=0.0)
    residual_is_empty = residual.sum(dim=-1, keepdim=True) <= 0
    emitted = sample_from_probs(torch.where(residual_is_empty, target_row, residual), generator)

    positions = torch.arange(num_draft_tokens + 1, device=device)
    output = torch.full((batch_size, num_draft_tokens + 1), PLACEHOLDER_TOKEN_ID,
                        dtype=torch.long, device=device)
    output[:, :num_draft_tokens] = torch.where(
        positions[:num_draft_tokens] < num_accepted.unsqueeze(-1), draft_token_ids.long(),
        PLACEHOLDER_TOKEN_ID)
    output[rows, num_accepted] = emitted
    return output


def greedy_verify(draft_token_ids: torch.Tensor, target_token_ids: torch.Tensor) -> torch.Tensor:
    """Greedy fast path: draft ids [B, K] vs target argmax ids [B, K+1] -> output ids [B, K+1].

    Draft tokens are accepted while they equal the target's argmax; the token emitted at the first
    mismatch (recovered) or after all K (bonus) is the target's id; -1 after that. Identical to
    rejection_sample with one-hot draft and target rows, without drawing random numbers.
    """
    if draft_token_ids.dim() != 2 or target_token_ids.dim() != 2:
        raise ValueError("greedy_verify expects draft_token_ids [B, K] and target_token_ids [B, K+1]; "
                         f"got {tuple(draft_token_ids.shape)} and {tuple(target_token_ids.shape)}")
    batch_size, num_draft_tokens = draft_token_ids.shape
    if tuple(target_token_ids.shape) != (batch_size, num_draft_tokens + 1):
        raise ValueError(f"target_token_ids must be [B, K+1] = [{batch_size}, {num_draft_tokens + 1}], "
                         f"got {tuple(target_token_ids.shape)}")
    matches = draft_token_ids.long() == target_token_ids[:, :num_draft_tokens].long()
    num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1, keepdim=True)   # [B, 1]
    # Accepted draft ids equal the target's ids, so the whole emitted prefix is the target's.
    positions = torch.arange(num_draft_tokens + 1, device=target_token_ids.device)
    return torch.where(positions <= num_accepted, target_token_ids.long(), PLACEHOLDER_TOKEN_ID)


def _check_shapes(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                  target_probs: torch.Tensor) -> None:
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [B, K], got shape {tuple(draft_token_ids.shape)}")
    if draft_token_ids.dtype.is_floating_point:
        raise ValueError(f"draft_token_ids must be integer token ids, got dtype {draft_token_ids.dtype}")
    batch_size, num_draft_tokens = draft_token_ids.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (batch_size, num_draft_tokens + 1):
        raise ValueError(f"target_probs must be [B, K+1, V] = [{batch_size}, {num_draft_tokens + 1}, V], "
                         f"got {tuple(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (
            batch_size, num_draft_tokens, target_probs.shape[-1]):
        raise ValueError(f"draft_probs must be [B, K, V] = [{batch_size}, {num_draft_tokens}, "
                         f"{target_probs.shape[-1]}] or None, got {tuple(draft_probs.shape)}")
