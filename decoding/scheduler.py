"""Which waiting engine calls run in the next forward (continuous batching of rounds).

An engine gathers every call that is waiting when its previous forward ends and plans ONE
iteration from them (no timer: a lone call runs at once, so a single stream pays nothing):

- *step calls* (few new tokens: a verify of [last, d1..dK], a draft step) share one forward;
- *prefill calls* (many new tokens) run in a forward of their own, chunked under a token budget,
  so a long prompt never stalls the running rounds: right-padding a 5-token verify to a 300-token
  prompt would cost that verify ~60x its compute, and one chunk per iteration bounds how long
  a running round waits behind a prompt;
- a call for a sequence the engine does not hold yet needs a free KV slot, and every call needs
  the KV blocks its new tokens will fill (decoding.block_manager): while they are not free it waits
  in the queue (the engine answers "overloaded" past a deadline), in arrival order.

`plan_iteration` is pure: it is passed what is known of each call and gives back the plan.
`Scheduler` is the engine's core, Ray-free (nano-vllm's scheduler and engine step): it owns the
KV blocks (decoding.block_manager), plans iterations from what they hold, preempts when nothing can
run, and runs each forward as a fully planned step on its runner (`forward_batch`: the block
manager plans, the runner runs the plan, the block manager records it). The engine actor calls
`schedule` and `forward_batch` (deployments.engine_host); in-process generation and the draft
proposer call `forward_batch` alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.decoding.batched_runner import runner_for_model
from specserve.decoding.target_features import TargetFeatures
from specserve.decoding.block_manager import BlockManager, ForwardCall, StepPlan
from specserve.decoding.errors import SequenceStateError

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


# Batching settings of an engine built without a config (in-process generation, tests, benches):
# common.config's defaults.
DEFAULT_MAX_STEP_TOKENS = 16
DEFAULT_PREFILL_TOKEN_BUDGET = 2048
DEFAULT_MAX_BATCH_ROWS = 64


class Scheduler:
    """One engine's core over its runner: the KV blocks (`blocks`, a BlockManager), the plan of
    each iteration over the waiting calls, and the forwards, each planned in full before the
    runner runs it.

    runner: a decoding.batched_runner.BatchedModelRunner (or a tensor-parallel group's rank 0,
    decoding.tensor_parallel.MirroredRunner), or None for a model-free proposer, whose calls all
    run at once."""

    def __init__(self, runner: Any, max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
                 prefill_token_budget: int = DEFAULT_PREFILL_TOKEN_BUDGET,
                 max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS, name: str = "engine") -> None:
        """name: the engine's, for the log."""
        self.runner = runner
        self.blocks = None if runner is None else BlockManager.for_runner(runner)
        self.name = name
        self.max_step_tokens = max_step_tokens
        self.prefill_token_budget = prefill_token_budget
        self.max_batch_rows = max_batch_rows
        self.preemptions = 0  # sequences whose KV was freed to let older ones grow
        self.last_num_new_tokens = 0   # tokens the last forward computed (prefix-cache hits excluded)

    # The model's facts, read through the engine

    @property
    def paged(self) -> bool:
        """The engine keeps KV in a block pool, so calls wait for blocks."""
        return self.blocks is not None

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.runner.eos_token_ids

    @property
    def free_slots(self) -> int:
        return 1 << 30 if self.blocks is None else self.blocks.num_free_slots

    # The core step

    def forward_batch(self, calls: Sequence[ForwardCall]) -> list[torch.Tensor]:
        """One model forward for every call (distinct seq_ids, each naming its whole history);
        result i is float32 [calls[i].num_rows, V], as a forward of that call alone would give it
        (up to float rounding). The block manager plans the step (checking the whole batch before
        anything changes: ValueError, SequenceStateError, NoFreeSlotError, NoFreeBlocksError), the
        runner runs it, and the blocks then hold what it computed; a forward that raises leaves
        every sequence as it was before (cropped back to what it reused)."""
        return self._run(self.blocks.plan(calls)) if calls else []

    def forward_batch_with_features(self, calls: Sequence[ForwardCall],
                                    features_from: Sequence[int | None] | None = None
                                    ) -> tuple[list[torch.Tensor], list[TargetFeatures | None]]:
        """`forward_batch`, and per call the target's features (decoding.batched_runner.
        TargetFeatures: an EAGLE-3 head's input) of its positions from features_from[i] to its
        last token's (None there: none for that call; no features_from: from the first position
        this forward computed). Positions the forward did not compute (a prefix-cache hit, an
        earlier chunk or round) come from the cache, where every forward stores them. The
        engine's runner must have been built with aux_layers."""
        if not calls:
            return [], []
        plan = self.blocks.plan(calls)
        logits = self._run(plan)
        starts = plan.starts if features_from is None else features_from
        group = self.runner.cache.feature_group
        return logits, [None if start is None else
                        self.runner.features(self.blocks.table(call.seq_id, group), start, len(call.token_ids))
                        for call, start in zip(calls, starts)]

    def _run(self, plan: StepPlan) -> list[torch.Tensor]:
        """The runner runs plan; the block manager commits it (or, when it raises, aborts it)."""
        try:
            result = self.runner.run(plan)
        except BaseException:
            self.blocks.abort(plan)
            raise
        self.blocks.commit(plan)
        self.last_num_new_tokens = plan.num_new_tokens
        return result

    def forward(self, seq_id: str, token_ids: Sequence[int], num_rows: int = 1) -> torch.Tensor:
        """seq_id's cache made to hold exactly token_ids; float32 logits [num_rows, V] for its
        last num_rows positions (`forward_batch` of one call)."""
        return self.forward_batch([ForwardCall(seq_id, token_ids, num_rows)])[0]

    def release(self, seq_id: str) -> None:
        """Forget seq_id (its cache_salt too) and let go of its blocks (idempotent); its full
        blocks stay cached."""
        if self.blocks is not None:
            self.blocks.forget(seq_id)

    def load_weights(self, state, cache_salt: str) -> None:
        """The runner serves `state` from the next forward (BatchedModelRunner.load_weights), and
        every sequence's keys and values, computed by the old weights, are let go; cached blocks
        become unfindable (the hash chain's root is the new cache_salt). ValueError, nothing
        changed, when the weights do not fit the model."""
        self.runner.load_weights(state)
        self.blocks.reset(cache_salt)

    def kv_usage(self) -> dict[str, int]:
        """The block manager's usage and counters, and the bytes the runner's pools reserve."""
        return {**self.blocks.usage(), "kv_bytes_reserved": self.runner.cache.reserved_bytes()}

    # Planning iterations

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
                              free_blocks=self.blocks.num_free_blocks, block_size=self.blocks.block_size)
        if not plan.steps and not plan.prefills and any(waiting[valid[i]].holds_slot for i in plan.waiting):
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
        if self.blocks is None:
            return WaitingCall(shape.seq_id, max(shape.num_rows, len(shape.token_ids)), holds_slot=False,
                               extra_tokens=shape.extra_tokens)
        cached = self.blocks.num_cached(shape.seq_id)
        # Every KV cache group's table has an entry per block of the tokens held (a windowed
        # group's let-go blocks too: they need no new block).
        blocks_held = -(-cached // self.blocks.block_size)
        holds_slot = cached > 0
        if not holds_slot:
            # A new sequence starts from what the prefix cache holds of it: its prefill chunks
            # count from there (its cached blocks still count as blocks needed: an upper bound).
            cached = self.blocks.cached_prefix_length(shape.seq_id, shape.token_ids, shape.num_rows)
        return WaitingCall(shape.seq_id, max(shape.num_rows, len(shape.token_ids) - cached), holds_slot=holds_slot,
                           num_cached=cached, blocks_held=blocks_held, extra_tokens=shape.extra_tokens,
                           kv_groups=self.blocks.num_groups)

    def _preempt_youngest(self) -> None:
        """Nothing can run and a sequence the engine holds waits for KV blocks to grow: free the
        most recently admitted sequence's KV (vLLM's recompute preemption). Its request goes on:
        its engine keeps its history and names all of it again, so it is prefilled again once
        blocks are free, and the older sequences finish first. Without this, sequences that all
        wait to grow would wait each other out until the admission deadline failed them."""
        victim = self.blocks.active_sequences()[-1]
        logger.warning("%s: KV blocks exhausted; preempting %s (it will be prefilled again)", self.name, victim)
        self.blocks.release(victim)
        self.preemptions += 1


def engine_for_model(model, scheduler_options: dict | None = None, **runner_options) -> Scheduler:
    """An engine core over an already built model: a Scheduler over its BatchedModelRunner
    (runner_options: decoding.batched_runner.runner_for_model's; scheduler_options: Scheduler's
    batching settings). In-process generation, benches and tests drive it through forward_batch."""
    return Scheduler(runner_for_model(model, **runner_options), **(scheduler_options or {}))
