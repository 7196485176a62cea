"""What a draft engine knows of each position it drafted, for guessing how its verification ends.

Why a module of its own: the fan-out policy (policies.fan_out) shares the speculation cache's
pre-drafts out by these numbers, and a policy imports no engine code (the Serve controller and
the policy actor import the policies); the proposers that make them are engine code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftOdds:
    """One drafted position's numbers, for guessing the verification's outcome there: the
    draft's own probability (its processed row, the target's stand-in) of each candidate
    (`Proposal.candidates`, best first) and of the drafted token, and the probability the draft
    drew them with (the Saguaro-lowered q; None when greedy: the argmax, no draw)."""

    candidate_q: tuple[float, ...]
    candidate_drawn: tuple[float, ...] | None
    drafted_q: float
    drafted_drawn: float | None
    # sum over the vocabulary of max(own - drawn, 0): where a rejection's residual would be if the
    # target were the draft (0 when greedy, or when the draft draws from its own row).
    residual_mass: float = 0.0
