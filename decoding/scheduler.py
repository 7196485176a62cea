"""Which waiting engine calls run in the next forward (continuous batching of rounds).

An engine gathers every call that is waiting when its previous forward ends and plans ONE
iteration from them (no timer: a lone call runs at once, so a single stream pays nothing):

- *step calls* (few new tokens: a verify of [last, d1..dK], a draft step) share one forward;
- *prefill calls* (many new tokens) run in a forward of their own, chunked under a token budget,
  so a long prompt never stalls the running rounds: right-padding a 5-token verify to a 300-token
  prompt would cost that verify ~60x its compute, and one chunk per iteration bounds how long
  a running round waits behind a prompt;
- a call for a sequence the engine does not hold yet needs a free KV slot, and every call needs
  the KV blocks its new tokens will fill (decoding.paged_cache): while they are not free it waits
  in the queue (the engine answers "overloaded" past a deadline), in arrival order.

Pure: the engine passes what it knows of each call and gets back the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WaitingCall:
    """What the planner needs to know about one queued call."""

    seq_id: str
    num_new_tokens: int   # history tokens the engine's cache does not hold yet
    holds_slot: bool      # the engine already holds this sequence's KV cache
    num_cached: int = 0   # tokens the cache holds for it, in blocks_held blocks
    blocks_held: int = 0
    extra_tokens: int = 0  # tokens it adds after this forward in the same iteration (a draft's steps)

    def blocks_needed(self, tokens_run: int, block_size: int) -> int:
        """New KV blocks for running tokens_run of its new tokens now (an upper bound: a call
        that recomputes cached rows crops first)."""
        extra = self.extra_tokens if tokens_run >= self.num_new_tokens else 0
        return max(0, -(-(self.num_cached + tokens_run + extra) // block_size) - self.blocks_held)


@dataclass
class IterationPlan:
    """Indices into the waiting list: run now as steps, run now as (chunked) prefills, or wait."""

    steps: list[int] = field(default_factory=list)
    prefills: list[tuple[int, int]] = field(default_factory=list)  # (index, new tokens to run now)
    waiting: list[int] = field(default_factory=list)


def plan_iteration(calls: Sequence[WaitingCall], free_slots: int, max_step_tokens: int,
                   prefill_token_budget: int, max_batch_rows: int, free_blocks: int | None = None,
                   block_size: int = 1) -> IterationPlan:
    """Split waiting calls into this iteration's step batch, prefill chunk batch and the rest.

    max_step_tokens: a call with at most this many new tokens is a step (set it to the deepest
        block + 1, so verifies and draft steps always batch together).
    prefill_token_budget: new tokens all prefill chunks of one iteration may add up to.
    max_batch_rows: most rows in either forward.
    free_blocks: KV blocks (of block_size tokens) free for the calls' new tokens; None: unlimited
        (a runner without a block pool).
    Calls are taken in arrival order; a sequence appears at most once per iteration (a second
    call for it waits for the next one, so its cache is never written twice in one forward)."""
    plan = IterationPlan()
    seen: set[str] = set()
    budget_left = prefill_token_budget
    for index, call in enumerate(calls):
        if call.seq_id in seen:
            plan.waiting.append(index)
            continue
        if not call.holds_slot:
            if free_slots <= 0:
                plan.waiting.append(index)
                continue
        step = call.num_new_tokens <= max_step_tokens
        if len(plan.steps if step else plan.prefills) >= max_batch_rows or (not step and budget_left <= 0):
            plan.waiting.append(index)
            continue
        tokens_run = call.num_new_tokens if step else min(call.num_new_tokens, budget_left)
        if free_blocks is not None:
            needed = call.blocks_needed(tokens_run, block_size)
            if needed > free_blocks:
                plan.waiting.append(index)
                continue
            free_blocks -= needed
        if step:
            plan.steps.append(index)
        else:
            budget_left -= tokens_run
            plan.prefills.append((index, tokens_run))
        if not call.holds_slot:
            free_slots -= 1
        seen.add(call.seq_id)
    return plan
