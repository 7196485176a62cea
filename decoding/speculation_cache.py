"""Speculative speculative decoding's speculation cache: blocks drafted for the verification
outcomes a round is likely to have, while the target verifies it (Kumar, Dao, May, "Speculative
Speculative Decoding", 2026; docs/speculation-cache.md).

A round drafts block d1..dK after the committed history h. The target's verify ends in one of
these outcomes: it keeps the first a draft tokens (a in 0..K) and emits one more token t: the
recovered token where it rejected d_{a+1} (never d_{a+1} itself: greedy, the target's argmax
differs from it; sampled, a rejected token has residual mass 0), the bonus token after all K. The
next round continues h + d1..da + t. While the verify runs, the draft engine drafts a block for
each outcome it expects, t among the draft's own most likely tokens at that position
(`Proposal.candidates`), and keeps them here; the next round asks for the block continuing the
history it then has: a hit answers at once, a miss drafts just in time.

Exact, because a pre-drafted block is a draft sample conditioned on exactly the history it
continues: each is drawn with a stream of its own (seeded from the request's draft stream in an
order that does not depend on the verification), and it carries the q rows (and the draft version)
it was drawn from, which the owner verifies it against. Which block is used depends on the
verification; what is in the chosen block does not.

The bonus outcome's t is not known before one more draft step, so that block is drafted from
h + d1..dK with one token more: its first token is the guess of the bonus token, the rest the block
(`Predraft.guesses_next`), as SSD's bonus pre-draft and the draft-ahead path this replaces did.

Everything here is pure: the draft engine (deployments/draft_worker.py) runs the drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from specserve.decoding.proposers import Proposal

# How much likelier the draft's i-th candidate is to be the target's token than its (i+1)-th, when
# the fan-out is shared out (`allocate_fan_out`): a prior, not a measurement (docs/speculation-cache.md).
CANDIDATE_DECAY = 0.5


@dataclass(frozen=True)
class Predraft:
    """One outcome's block to draft: the history it continues (committed + accepted drafts +
    the emitted token; for the bonus outcome, committed + the whole block, and its first drafted
    token is the guess of the bonus token)."""

    history: tuple[int, ...]
    guesses_next: bool = False


def outcome_probabilities(accept_rates: Sequence[float], num_drafted: int) -> list[float]:
    """P(the target keeps exactly a draft tokens), a = 0..K, from per-position acceptance rates
    (policies.acceptance's by-position rates: position j's rate given the first j were kept)."""
    probabilities, reached = [], 1.0
    for position in range(num_drafted):
        rate = min(max(accept_rates[position] if position < len(accept_rates) else accept_rates[-1], 0.0), 1.0)
        probabilities.append(reached * (1.0 - rate))
        reached *= rate
    probabilities.append(reached)
    return probabilities


def allocate_fan_out(accept_rates: Sequence[float], num_drafted: int, fan_out: int,
                     decay: float = CANDIDATE_DECAY) -> tuple[int, ...]:
    """How many blocks to pre-draft for each accepted length a = 0..K: fan_out blocks in all,
    each to the (outcome, candidate rank) most likely to be the one that happens. Candidate i at
    outcome a is assumed to be the emitted token with probability P(a) (1 - decay) decay^i, a
    geometric prior over the draft's ranking (SSD's geometric fan-out); the bonus outcome has one
    block (its guess is the draft's own next token). A request whose drafts are mostly kept puts
    its blocks on the bonus and late rejections, one whose drafts fail early on the first positions."""
    counts = [0] * (num_drafted + 1)
    if fan_out <= 0 or num_drafted <= 0:
        return tuple(counts)
    probabilities = outcome_probabilities(accept_rates, num_drafted)
    options = [(probabilities[num_drafted], num_drafted, 0)]
    for outcome in range(num_drafted):
        options += [(probabilities[outcome] * (1.0 - decay) * decay ** rank, outcome, rank)
                    for rank in range(fan_out)]
    options.sort(key=lambda option: (-option[0], option[1], option[2]))
    for _, outcome, _ in options[:fan_out]:
        counts[outcome] += 1
    return tuple(counts)


def predrafts(history: Sequence[int], block: Sequence[int], candidates: Sequence[Sequence[int]] | None,
              allocation: Sequence[int]) -> list[Predraft]:
    """The blocks to draft for allocation's outcomes of verifying block after history: for a < K,
    the first allocation[a] of the draft's candidates at position a (its ranking, most likely
    first) other than block[a]; for a = K, the bonus block if allocation[K] > 0."""
    history, block = tuple(history), tuple(block)
    wanted: list[Predraft] = []
    for outcome, count in enumerate(allocation[:len(block)]):
        if count <= 0 or candidates is None or outcome >= len(candidates):
            continue
        others = [token for token in candidates[outcome] if token != block[outcome]][:count]
        wanted += [Predraft(history + block[:outcome] + (token,)) for token in others]
    if len(allocation) > len(block) and allocation[len(block)] > 0 and block:
        wanted.append(Predraft(history + block, guesses_next=True))
    return wanted


def continues(predraft: Predraft, drafted: Proposal | None, history: Sequence[int]) -> bool:
    """Does predraft's block (drafted: its answer, needed for a bonus guess) continue history?"""
    if not predraft.guesses_next:
        return len(history) == len(predraft.history) and tuple(history) == predraft.history
    return (drafted is not None and len(drafted.token_ids) >= 2 and len(history) == len(predraft.history) + 1
            and history[-1] == drafted.token_ids[0] and tuple(history[:-1]) == predraft.history)


def may_continue(predraft: Predraft, history: Sequence[int]) -> bool:
    """continues, before the draft is known: a bonus block may, if the guess holds."""
    if predraft.guesses_next:
        return len(history) == len(predraft.history) + 1 and tuple(history[:-1]) == predraft.history
    return continues(predraft, None, history)


def block_of(predraft: Predraft, drafted: Proposal, num_tokens: int) -> Proposal:
    """The proposal a hit answers: predraft's block cut to num_tokens (without its guess), its q
    rows and candidates cut alike (the next pre-drafts start from its candidates)."""
    start = 1 if predraft.guesses_next else 0
    stop = min(len(drafted.token_ids), start + num_tokens)
    support = None if drafted.support is None else drafted.support.rows(start, stop)
    candidates = None if drafted.candidates is None else drafted.candidates[start:stop]
    return replace(drafted, token_ids=list(drafted.token_ids[start:stop]), support=support, candidates=candidates)


def tokens_thrown_away(predraft: Predraft, drafted: Proposal | None, used: Proposal | None) -> int:
    """Pre-drafted tokens never verified: all of an unused block's (its guess included: drafted
    work), the tail past what a hit used (a bonus guess that came true is not thrown away)."""
    if drafted is None:
        return 0
    if used is None:
        return len(drafted.token_ids)
    return len(drafted.token_ids) - len(used.token_ids) - (1 if predraft.guesses_next else 0)
