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

The bonus outcome's t is not known before one more draft step, so each of its blocks is drafted
from h + d1..dK with one token more: its first token is a guess of the bonus token (the draft's
i-th most likely there, `Predraft.guess_rank`), the rest the block, as SSD's bonus pre-drafts do.
Which outcomes get blocks is policies.fan_out.share_fan_out's choice, from the draft's own numbers.

Everything here is pure: the draft engine (deployments/draft_worker.py) runs the drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from specserve.decoding.proposers import Proposal


@dataclass(frozen=True)
class Predraft:
    """One outcome's block to draft: the history it continues (committed + accepted drafts +
    the emitted token; for the bonus outcome, committed + the whole block, and its first drafted
    token is the guess of the bonus token: the draft's guess_rank-th most likely there)."""

    history: tuple[int, ...]
    guess_rank: int | None = None

    @property
    def guesses_next(self) -> bool:
        return self.guess_rank is not None


def predrafts(history: Sequence[int], block: Sequence[int], picks: Sequence[tuple[int, int]]) -> list[Predraft]:
    """The blocks to draft for picks' outcomes of verifying block after history: (a, t) with
    a < len(block) is the outcome that keeps block[:a] and emits t (never block[a]: a rejected
    token is not emitted there); (len(block), i) is the bonus outcome, its token guessed as the
    draft's i-th most likely (policies.fan_out.share_fan_out picks them)."""
    history, block = tuple(history), tuple(block)
    wanted: list[Predraft] = []
    for outcome, token in picks:
        if outcome < len(block) and token != block[outcome]:
            wanted.append(Predraft(history + block[:outcome] + (token,)))
        elif outcome == len(block) and block:
            wanted.append(Predraft(history + block, guess_rank=token))
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
    rows, candidates and odds cut alike (the next pre-drafts start from its candidates)."""
    start = 1 if predraft.guesses_next else 0
    stop = min(len(drafted.token_ids), start + num_tokens)
    support = None if drafted.support is None else drafted.support.rows(start, stop)
    candidates = None if drafted.candidates is None else drafted.candidates[start:stop]
    odds = None if drafted.odds is None else drafted.odds[start:stop]
    return replace(drafted, token_ids=list(drafted.token_ids[start:stop]), support=support, candidates=candidates,
                   odds=odds)


def tokens_thrown_away(predraft: Predraft, drafted: Proposal | None, used: Proposal | None) -> int:
    """Pre-drafted tokens never verified: all of an unused block's (its guess included: drafted
    work), the tail past what a hit used (a bonus guess that came true is not thrown away)."""
    if drafted is None:
        return 0
    if used is None:
        return len(drafted.token_ids)
    return len(drafted.token_ids) - len(used.token_ids) - (1 if predraft.guesses_next else 0)
