"""Per-token acceptance alpha: the geometric acceptance model and the one estimator of alpha.

Model (docs/depth-and-autoscaling.md): each draft token is accepted independently with probability
alpha until the first rejection, so a round of depth K accepts n = min(G, K) tokens, G geometric.
Its likelihood over rounds is alpha^(accepted tokens) * (1 - alpha)^(rounds cut by a rejection),
so with a Beta(a, b) prior the posterior mean is

    alpha = (accepted + a) / (accepted + rejecting rounds + a + b).

Why not accepted / drafted: after a rejection the rest of the block counts as drafted but can
never be accepted, so that ratio is (E - 1) / K, not alpha (at alpha = 0.93, K = 4 it reads 0.84).
The router and the benchmark keep only totals (accepted, drafted, rounds), not how many rounds
ended in a rejection, so that count is replaced by its expectation under the model fitted to the
totals (tokens per round at the mean depth); with no prior this is exactly that fit.
"""

from __future__ import annotations

PRIOR_ACCEPTED = 3.0  # Beta(3, 1): a new request is assumed to accept ~75% of its draft tokens,
PRIOR_REJECTED = 1.0  # and one unlucky round does not collapse its depth


def expected_tokens_per_round(accept_rate: float, num_draft_tokens: float) -> float:
    """E = 1 + a + ... + a^K: tokens one round emits (accepted draft tokens + the recovered or bonus
    token) when each draft token is accepted with probability a. K may be fractional (a mean depth)."""
    if accept_rate >= 1.0:
        return float(num_draft_tokens + 1)
    return (1.0 - accept_rate ** (num_draft_tokens + 1)) / (1.0 - accept_rate)


def acceptance_from_tokens_per_round(tokens_per_round: float, num_draft_tokens: float) -> float:
    """The a that makes E(a, K) equal a measured tokens-per-verifying-round (bisection: E increases in a)."""
    if num_draft_tokens <= 0:
        raise ValueError(f"num_draft_tokens must be > 0 to fit an acceptance rate, got {num_draft_tokens}")
    if tokens_per_round <= 1.0:
        return 0.0
    if tokens_per_round >= num_draft_tokens + 1.0:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if expected_tokens_per_round(mid, num_draft_tokens) < tokens_per_round:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def acceptance_posterior_mean(num_accepted: float, num_rejecting_rounds: float,
                              prior_accepted: float = PRIOR_ACCEPTED,
                              prior_rejected: float = PRIOR_REJECTED) -> float:
    """Posterior mean of alpha under the truncated-geometric likelihood and a Beta prior, given the
    exact count of rounds that ended in a rejection (rounds that took the whole block add none)."""
    denominator = num_accepted + num_rejecting_rounds + prior_accepted + prior_rejected
    if denominator <= 0:
        raise ValueError("no rounds and no prior: alpha is undefined")
    return (num_accepted + prior_accepted) / denominator


def estimate_acceptance_rate(num_accepted: int, num_drafted: int, num_rounds: int,
                             prior_accepted: float = PRIOR_ACCEPTED,
                             prior_rejected: float = PRIOR_REJECTED) -> float:
    """Per-token acceptance alpha from a request's (or a benchmark row's) totals.

    num_rounds counts rounds that drafted at least one token. The rounds that ended in a rejection
    are estimated as rounds * (1 - a_fit^K) with a_fit the prior-free fit at the mean depth K, then
    the Beta-prior posterior mean is taken. With prior (0, 0) the result equals a_fit exactly; with
    no rounds it is the prior mean."""
    if num_rounds <= 0 or num_drafted <= 0:
        return acceptance_posterior_mean(0.0, 0.0, prior_accepted, prior_rejected)
    if not 0 <= num_accepted <= num_drafted:
        raise ValueError(f"need 0 <= accepted <= drafted, got {num_accepted} of {num_drafted}")
    mean_draft_tokens = num_drafted / num_rounds
    fitted = acceptance_from_tokens_per_round(1.0 + num_accepted / num_rounds, mean_draft_tokens)
    rejecting_rounds = num_rounds * (1.0 - fitted ** mean_draft_tokens)
    return acceptance_posterior_mean(num_accepted, rejecting_rounds, prior_accepted, prior_rejected)


# Acceptance by position. The geometric model assumes the chance that draft position j is
# accepted, given that all before it were, is the same alpha for every j. A pair whose drafts are
# taken in streaks (a repeated line whole, a new identifier missed at once) breaks that, and the
# model then under-rates deep blocks. So rounds are also counted by position: `reached[j]` rounds
# drafted position j+1 with every earlier draft accepted, and `accepted[j]` of them accepted it
# too; with geometric acceptance the rates come out equal and nothing changes (on the shipped pair
# it is close to geometric: docs/depth-and-autoscaling.md). Beware the
# benchmark's "accept" column: it is accepted / drafted, not alpha.
POSITION_PRIOR_WEIGHT = 4.0  # pseudo-rounds: a position's rate leans on the one before until seen this often


def count_round_positions(reached: list[int], accepted: list[int], num_drafted: int, num_accepted: int) -> None:
    """Add one round (num_drafted draft tokens, the first num_accepted of them accepted) to the
    position counters in place, growing them as needed. Called on the round path, so a count out
    of range is clipped rather than raised: a statistic must not fail a request."""
    num_accepted = max(0, min(num_accepted, num_drafted))
    for counters in (reached, accepted):
        counters.extend([0] * (num_drafted - len(counters)))
    for position in range(min(num_accepted + 1, num_drafted)):
        reached[position] += 1
    for position in range(num_accepted):
        accepted[position] += 1


def position_accept_rates(reached: list[float], accepted: list[float], depth: int,
                          first_prior: float = PRIOR_ACCEPTED / (PRIOR_ACCEPTED + PRIOR_REJECTED),
                          weight: float = POSITION_PRIOR_WEIGHT) -> tuple[float, ...]:
    """alpha_j for j = 1..depth: the chance position j is accepted given all before it were.

    Each position's rate is a posterior mean whose prior is the rate of the position before it
    (the first leans on `first_prior`), worth `weight` rounds: a rarely reached deep position
    inherits its neighbour's rate instead of a fixed guess, and a position never drafted (beyond
    the deepest K used so far) continues the trend of the last one measured."""
    rates: list[float] = []
    prior = first_prior
    for position in range(depth):
        prior = _position_posterior(reached, accepted, position, prior, weight)
        rates.append(min(prior, 0.99))
    return tuple(rates)


def request_position_rates(reached: list[int], accepted: list[int], class_rates: tuple[float, ...],
                           weight: float = POSITION_PRIOR_WEIGHT) -> tuple[float, ...]:
    """One request's alpha_j: its own counts, each position leaning on its class's rate there
    (class_rates, from `position_accept_rates` over the class's rounds) with `weight` rounds: an
    easy prompt soon drafts deeper than its class, a hard one shallower."""
    return tuple(min(_position_posterior(reached, accepted, position, prior, weight), 0.99)
                 for position, prior in enumerate(class_rates))


def _position_posterior(reached: list, accepted: list, position: int, prior: float, weight: float) -> float:
    """Posterior mean of one position's rate: its counts (none past the lists' ends) plus `weight`
    pseudo-rounds at `prior`."""
    seen = float(reached[position]) if position < len(reached) else 0.0
    taken = float(accepted[position]) if position < len(accepted) else 0.0
    return (taken + weight * prior) / (seen + weight)


def expected_tokens_by_position(rates: tuple[float, ...], num_draft_tokens: int) -> float:
    """Tokens one round of depth K emits when position j is accepted with chance rates[j-1] given
    the earlier ones were: 1 + sum over k <= K of the chance the first k are all accepted."""
    if num_draft_tokens > len(rates):
        raise ValueError(f"rates cover {len(rates)} positions, asked for K = {num_draft_tokens}")
    tokens, survive = 1.0, 1.0
    for rate in rates[:num_draft_tokens]:
        survive *= rate
        tokens += survive
    return tokens
