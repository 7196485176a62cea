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

`block_verify` (Sun et al., ICLR 2025) decides the block jointly instead of stopping at the first
rejection: same inputs, same output contract, never fewer accepted tokens in expectation, and the
emitted sequence still follows the target exactly (docs/block-verification.md).
"""

from __future__ import annotations

import torch

from specserve.decoding.sampling import sample_from_probs

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

    return _assemble(draft_token_ids.long(), num_accepted, emitted)


def block_verify(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Block verification (Sun et al., ICLR 2025, Algorithm 2); same arguments and output as
    rejection_sample: n accepted draft tokens, one recovered or bonus token, then -1.

    Token-wise verification gives up at the first rejection. Here the decision is joint: with
    x_1..x_K the draft tokens, p_i and q_i the target and draft rows at position i (0-based rows,
    row i scores x_{i+1}) and a weight carried along the block,
        P_0 = 1,  P_i = min(1, P_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i)),
        r_i = sum_x max(P_i p_i(x) - q_i(x), 0)                      (i < K),
        h_i = r_i / (r_i + 1 - P_i) for 0 < i < K,  h_K = P_K,
    one uniform u_i per position 1..K, and the block is cut at tau = the last i with u_i < h_i
    (0 when none passes). x_1..x_tau are accepted; then a bonus token from p_K when tau = K, else a
    recovered token from norm(max(P_tau p_tau - q_tau, 0)) (at tau = 0: max(p_0 - q_0, 0), the
    token-wise residual). A later position can keep tokens an earlier test would have cut. Where
    this departs from the paper (u < h rather than <=, conventions for zeros): docs/block-verification.md.

    Rows must be probability distributions (processed rows sum to 1). P is carried in log space so
    a long block of small ratios does not underflow into 0 * inf. q(x) = 0 < p(x) counts as ratio
    infinity (P back to 1 unless already 0); p(x) = 0 sets P to 0, so x and what follows it are
    never emitted; h_i = 0 where r_i = 0 (a position with nothing to recover from never ends the
    block). draft_probs None is a one-hot q (a deterministic proposer), for which the result has
    token-wise's distribution; one-hot p and q give exactly token-wise's (greedy) output. If the
    residual at tau is empty (a draft token neither p nor q supports), p_tau is used, as in
    rejection_sample.
    """
    _check_shapes(draft_token_ids, draft_probs, target_probs)
    batch_size, num_draft_tokens = draft_token_ids.shape
    device = target_probs.device
    if num_draft_tokens == 0:
        return sample_from_probs(target_probs[:, 0], generator).unsqueeze(1)

    draft_ids, draft, target, log_ratio = _block_inputs(draft_token_ids, draft_probs, target_probs)
    weights = _block_weights(log_ratio)                                             # P_0..P_K [B, K+1]
    uniform = torch.rand(batch_size, num_draft_tokens, generator=generator, device=device)
    passes = uniform.double() < _stop_probabilities(weights, target, draft)         # u_i < h_i, i = 1..K
    positions = torch.arange(1, num_draft_tokens + 1, device=device)
    num_accepted = (passes.long() * positions).max(dim=-1).values                   # tau [B], in 0..K

    # The emitted token: bonus from p_K (tau = K), else from the weighted residual at tau.
    rows = torch.arange(batch_size, device=device)
    all_accepted = num_accepted == num_draft_tokens
    target_row = target[rows, num_accepted]
    draft_row = draft[rows, num_accepted.clamp(max=num_draft_tokens - 1)].masked_fill(all_accepted.unsqueeze(-1), 0.0)
    weight = weights[rows, num_accepted].masked_fill(all_accepted, 1.0)
    residual = _weighted_residual(weight, target_row, draft_row)
    residual_is_empty = residual.sum(dim=-1, keepdim=True) <= 0
    emitted = sample_from_probs(torch.where(residual_is_empty, target_row, residual), generator)
    return _assemble(draft_ids, num_accepted, emitted)


def expected_num_accepted(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                          target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expected accepted draft tokens per row [B] (float64), over the verifier's own draws, for
    token-wise verification and for block verification: (token_wise, block). Same inputs as the
    verifiers, K >= 1.

    Averaged over rounds whose drafts were sampled from q, each is that verifier's mean accepted
    count; on the same rows the pair compares the two without the verifiers' sampling noise. For
    one fixed draft block, block can be below token-wise (its optimality is in expectation over
    the drafts; docs/block-verification.md)."""
    _check_shapes(draft_token_ids, draft_probs, target_probs)
    _, draft, target, log_ratio = _block_inputs(draft_token_ids, draft_probs, target_probs)
    token_wise = log_ratio.clamp(max=0.0).exp().cumprod(dim=-1).sum(dim=-1)
    stop = _stop_probabilities(_block_weights(log_ratio), target, draft)             # h_1..h_K
    survive = (1.0 - stop).flip(-1).cumprod(-1).flip(-1)                             # prod_{j >= i} (1 - h_j)
    after = torch.cat([survive[:, 1:], torch.ones_like(survive[:, :1])], dim=1)       # prod_{j > i}
    positions = torch.arange(1, stop.shape[1] + 1, device=stop.device, dtype=stop.dtype)
    return token_wise, (positions * stop * after).sum(dim=-1)


def _block_inputs(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor):
    """(draft ids long [B, K], draft rows q float32 [B, K, V] (one-hot when None), target rows p
    float32 [B, K+1, V], log p(x)/q(x) per draft token float64 [B, K]); q = 0 < p gives +inf,
    p = 0 gives -inf."""
    draft_ids = draft_token_ids.long()
    target = target_probs.float()
    if draft_probs is None:
        draft = torch.zeros(*draft_ids.shape, target.shape[-1], device=target.device).scatter_(
            -1, draft_ids.unsqueeze(-1), 1.0)
    else:
        draft = draft_probs.float()
    target_of_draft = target[:, :draft_ids.shape[1]].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1).double()
    draft_of_draft = draft.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1).double()
    log_ratio = torch.where(target_of_draft > 0,
                            torch.where(draft_of_draft > 0, target_of_draft.log() - draft_of_draft.log(),
                                        float("inf")),
                            float("-inf"))
    return draft_ids, draft, target, log_ratio


def _block_weights(log_ratio: torch.Tensor) -> torch.Tensor:
    """log p_i(x)/q_i(x) per draft token [B, K] -> P_0..P_K [B, K+1] (float64), P_0 = 1 and
    P_i = min(1, P_{i-1} * ratio_i), carried in log space: with S the running sums of the log
    ratios (S_0 = 0), log P_i = S_i - max_{j <= i} S_j, one cumsum and one cummax instead of a loop.
    Infinite ratios become finite sentinels so the sums stay defined: p = 0 (-1e30) leaves P at 0
    for good, even where a later q = 0 < p (+1e10, i.e. back to 1 otherwise) follows."""
    finite = log_ratio.clamp(min=-1e30, max=1e10)
    sums = torch.cat([torch.zeros_like(finite[:, :1]), finite.cumsum(dim=-1)], dim=1)
    return (sums - sums.cummax(dim=-1).values).exp()


def _weighted_residual(weight: torch.Tensor, target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """max(P p - q, 0) rowwise: weight [...] (float64), target and draft rows [..., V] -> [..., V]."""
    return (weight.float().unsqueeze(-1) * target - draft).clamp_(min=0.0)


def _stop_probabilities(weights: torch.Tensor, target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """h_1..h_K [B, K] (float64): h_i = r_i / (r_i + 1 - P_i) with r_i the weighted residual mass
    at position i, for 0 < i < K; h_K = P_K. h_i = 0 where r_i = 0, including the 0/0 of P_i = 1."""
    num_draft_tokens = draft.shape[1]
    inner = weights[:, 1:num_draft_tokens]
    mass = _weighted_residual(inner, target[:, 1:num_draft_tokens], draft[:, 1:num_draft_tokens]).sum(-1).double()
    return stop_probabilities_from_mass(weights, mass)


def stop_probabilities_from_mass(weights: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """h_1..h_K [B, K] (float64) from P_0..P_K [B, K+1] and the weighted residual masses r_1..r_{K-1}
    [B, K-1]: h_i = r_i / (r_i + 1 - P_i), 0 where r_i = 0; h_K = P_K. The compact verifier
    (decoding.compact_verify), which gets the masses from the target engine, computes the same on
    host arrays."""
    num_draft_tokens = weights.shape[1] - 1
    inner = weights[:, 1:num_draft_tokens]
    mass = mass.double()
    stop = torch.where(mass > 0, mass / (mass + 1.0 - inner).clamp(min=1e-300), torch.zeros_like(mass))
    return torch.cat([stop, weights[:, num_draft_tokens:]], dim=1)


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


def _assemble(draft_ids: torch.Tensor, num_accepted: torch.Tensor, emitted: torch.Tensor) -> torch.Tensor:
    """Output ids [B, K+1]: the first num_accepted draft ids, the emitted token, then -1."""
    batch_size, num_draft_tokens = draft_ids.shape
    positions = torch.arange(num_draft_tokens + 1, device=draft_ids.device)
    output = torch.full((batch_size, num_draft_tokens + 1), PLACEHOLDER_TOKEN_ID,
                        dtype=torch.long, device=draft_ids.device)
    output[:, :num_draft_tokens] = torch.where(
        positions[:num_draft_tokens] < num_accepted.unsqueeze(-1), draft_ids, PLACEHOLDER_TOKEN_ID)
    output[torch.arange(batch_size, device=draft_ids.device), num_accepted] = emitted
    return output
