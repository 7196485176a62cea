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

`plan_iteration` is pure: it is passed what is known of each call and gives back the plan.
`Scheduler` asks a runner what it holds, plans with it, and preempts when nothing can run; the
engine actor only calls `schedule` (deployments.engine_host).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specserve.decoding.model_runner import SequenceStateError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WaitingCall:
    """What the planner needs to know about one queued call."""

    seq_id: str
    num_new_tokens: int   # history tokens the engine's cache does not hold yet
    holds_slot: bool      # the engine already holds this sequence's KV cache
    num_cached: int = 0   # tokens the cache holds for it, in blocks_held table entries per KV cache group
    blocks_held: int = 0
    extra_tokens: int = 0  # tokens it adds after this forward in the same iteration (a draft's steps)
    kv_groups: int = 1     # the runner's KV cache groups: each takes a block per block of new tokens

    def blocks_needed(self, tokens_run: int, block_size: int) -> int:
        """New KV blocks for running tokens_run of its new tokens now (an upper bound: a call
        that recomputes cached rows crops first, and a windowed group lets blocks go after it)."""
        extra = self.extra_tokens if tokens_run >= self.num_new_tokens else 0
        return self.kv_groups * max(0, -(-(self.num_cached + tokens_run + extra) // block_size) - self.blocks_held)

    def chunk_end(self, chunk: int) -> int | None:
        """The history length a prefill chunk of this many tokens fills the cache up to, or None
        when the chunk completes the call."""
        return None if chunk >= self.num_new_tokens else self.num_cached + chunk


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


@dataclass(frozen=True)
class CallShape:
    """What one engine call asks of the runner: its history, the rows it wants back, and the
    tokens it adds after its forward in the same iteration (a draft's later decode steps)."""

    seq_id: str
    token_ids: Sequence[int]
    num_rows: int = 1
    extra_tokens: int = 0


@dataclass
class Schedule:
    """One iteration over an engine's calls: the plan (indices into the calls), what was known of
    each call when it was made, and the calls answered with an error instead of failing the batch."""

    plan: IterationPlan
    calls: list[WaitingCall]
    errors: dict[int, Exception] = field(default_factory=dict)


class Scheduler:
    """Plans an engine's iterations over its runner's state (free slots, cached tokens, KV blocks).

    runner: a decoding runner (BatchedModelRunner or ModelRunner), or None for a model-free
    proposer, whose calls all run at once."""

    def __init__(self, runner: Any, max_step_tokens: int, prefill_token_budget: int, max_batch_rows: int,
                 name: str = "engine") -> None:
        """name: the engine's, for the log."""
        self.runner = runner
        self.name = name
        self.max_step_tokens = max_step_tokens
        self.prefill_token_budget = prefill_token_budget
        self.max_batch_rows = max_batch_rows
        self.preemptions = 0  # sequences whose KV was freed to let older ones grow

    @property
    def paged(self) -> bool:
        """The runner keeps KV in a block pool (BatchedModelRunner), so calls wait for blocks."""
        return hasattr(self.runner, "blocks_held")

    @property
    def free_slots(self) -> int:
        return 1 << 30 if self.runner is None else self.runner.num_free_slots

    def schedule(self, shapes: Sequence[CallShape]) -> Schedule:
        """This iteration's plan over the waiting calls. A call that cannot run (too long, bad row
        count) is answered with its error instead of failing the batch."""
        waiting = [self._waiting_call(shape) for shape in shapes]
        if self.runner is None:
            return Schedule(IterationPlan(steps=list(range(len(shapes)))), waiting)
        errors: dict[int, Exception] = {}
        valid = []
        for index, shape in enumerate(shapes):
            error = self.check(shape)
            if error is None:
                valid.append(index)
            else:
                errors[index] = error
        plan = plan_iteration([waiting[index] for index in valid], self.free_slots, self.max_step_tokens,
                              self.prefill_token_budget, self.max_batch_rows,
                              free_blocks=self.runner.num_free_blocks if self.paged else None,
                              block_size=self.runner.block_size if self.paged else 1)
        if self.paged and not plan.steps and not plan.prefills and any(waiting[valid[i]].holds_slot
                                                                       for i in plan.waiting):
            self._preempt_youngest()
        plan = IterationPlan(steps=[valid[i] for i in plan.steps],
                             prefills=[(valid[i], chunk) for i, chunk in plan.prefills],
                             waiting=[valid[i] for i in plan.waiting])
        return Schedule(plan, waiting, errors)

    def check(self, shape: CallShape) -> SequenceStateError | None:
        """The error a call would raise in a batched forward, found before it can fail the batch."""
        if len(shape.token_ids) > self.runner.max_context:
            return SequenceStateError(f"{len(shape.token_ids)} tokens exceed the model's context of "
                                      f"{self.runner.max_context}")
        if not 1 <= shape.num_rows <= len(shape.token_ids):
            return SequenceStateError(f"num_rows={shape.num_rows} must be between 1 and the history length "
                                      f"{len(shape.token_ids)}")
        return None

    def _waiting_call(self, shape: CallShape) -> WaitingCall:
        cached = self.runner.num_cached(shape.seq_id) if self.runner is not None else 0
        # Every KV cache group's table has an entry per block of the tokens held (a windowed
        # group's let-go blocks too: they need no new block).
        blocks_held = -(-cached // self.runner.block_size) if self.paged else 0
        holds_slot = cached > 0
        if not holds_slot and self.paged:
            # A new sequence starts from what the prefix cache holds of it: its prefill chunks
            # count from there (its cached blocks still count as blocks needed: an upper bound).
            cached = self.runner.cached_prefix_length(shape.seq_id, shape.token_ids, shape.num_rows)
        return WaitingCall(shape.seq_id, max(shape.num_rows, len(shape.token_ids) - cached), holds_slot=holds_slot,
                           num_cached=cached, blocks_held=blocks_held, extra_tokens=shape.extra_tokens,
                           kv_groups=self.runner.num_kv_groups if self.paged else 1)

    def _preempt_youngest(self) -> None:
        """Nothing can run and a sequence the engine holds waits for KV blocks to grow: free the
        most recently admitted sequence's KV (vLLM's recompute preemption). Its request goes on:
        its engine keeps its history and names all of it to the runner, so it is prefilled again
        once blocks are free, and the older sequences finish first. Without this, sequences that all wait to grow would
        wait each other out until the admission deadline failed them."""
        victim = self.runner.active_sequences()[-1]
        logger.warning("%s: KV blocks exhausted; preempting %s (it will be prefilled again)", self.name, victim)
        self.runner.release(victim)
        self.preemptions += 1
