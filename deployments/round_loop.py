"""One request's speculative rounds: propose -> verify -> accept -> commit, until it finishes.

Per round: the draft engine proposes K tokens -> the target engine scores [last, d1..dK] in one
forward -> `accept_round` (rejection sampling) commits tokens to the request's history -> they
go out as a chunk. Each round ends with one `RoundRecord` handed to the observer
(deployments/round_record.py), which keeps every statistic; this loop keeps none.

Both calls go over this router's channels (deployments/request_engines.py, common/channel.py): the
draft's block comes back here and goes out in the verify, a few hundred bytes each way. While the
target verifies, the draft engine pre-drafts the next block for the verification's likely outcomes
(the speculation cache, decoding/speculation_cache.py); the next propose finds the block of the
actual outcome ready (a hit) or drafts it just in time. The draft engine decides hit or miss;
this loop only says how many blocks to pre-draft (`choose_fan_out`).

A target-only round (no draft engine, or a depth of 0: the policy speculating not at all under
load) queues the next one behind it while the next will be target-only too
(`RequestEngines.continue_round`), so the target decodes on while the answer travels here
(docs/architecture.md, "The round protocol").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from specserve.common.config import SpeculationSpec
from specserve.common.messages import DecodedSteps
from specserve.decoding.capture import captured_block
from specserve.decoding.proposers import Proposal
from specserve.decoding.sequence import RequestState
from specserve.decoding.speculation import LogprobEntries, accept_round, split_logprobs
from specserve.deployments.engine_loop import observed
from specserve.deployments.request_engines import ENGINE_ERRORS, RequestEngines
from specserve.deployments.round_record import RoundObserver, RoundRecord
from specserve.deployments.round_stages import EngineCall, RoundStages
from specserve.deployments.streaming import step_chunk
from specserve.policies.acceptance import count_round_positions
from specserve.policies.depth_chooser import request_class
from specserve.policies.fan_out import FanOut

logger = logging.getLogger("ray.serve")


class RoundLoop:
    """Drives one request. choose_depth(state) -> K for the next round; choose_fan_out(state, K)
    -> what to pre-draft for its outcomes (policies.fan_out.FanOut); num_active() -> the router's
    active requests now; emit(chunk) streams a chunk out."""

    def __init__(self, state: RequestState, engines: RequestEngines, observer: RoundObserver,
                 emit: Callable[[dict], None], choose_depth: Callable[[RequestState], int],
                 num_active: Callable[[], int], speculation: SpeculationSpec, profile: bool = False,
                 choose_fan_out: Callable[[RequestState, int], FanOut] = lambda state, k: FanOut()) -> None:
        self.state = state
        self.engines = engines
        self.observer = observer
        self.emit = emit
        self.choose_depth = choose_depth
        self.choose_fan_out = choose_fan_out
        self.predrafted = False   # the last round's block was given outcomes to pre-draft
        self.num_active = num_active
        self.speculation = speculation
        self.profile = profile
        # The target-only round queued behind the one in flight (RequestEngines.continue_round).
        self.queued: asyncio.Future | None = None

    async def run(self, started_s: float, deadline_s: float, prompt_logprobs: int | None = None) -> None:
        """Prefill (the first token), then rounds until the request finishes or deadline_s passes.
        The target prefills as soon as Serve names its engine; the draft engine's lookup goes on
        beside it and is awaited only once the first token is out."""
        state = self.state
        looking_up = time.perf_counter()
        await self.engines.acquire(state)
        engine_lookup_s = time.perf_counter() - looking_up
        try:
            rows, prefill = await self.engines.verify(state, prompt_logprobs=prompt_logprobs)
            state.num_cached_tokens = prefill.cached_tokens
            prompt_entries = None
            if prompt_logprobs is not None:  # the prefill answered (its usual answer, the prompt's entries)
                rows, prompt_entries = rows
            rows, logprob_rows = split_logprobs(state.params, rows)
            committed = accept_round(state, Proposal([], None), rows)
            self.observer.first_token(time.perf_counter() - started_s,
                                      {"engine_lookup": engine_lookup_s, **prefill.stages("target")}
                                      if self.profile else None)
            chunk = step_chunk(state, committed, logprob_rows)
            if prompt_entries is not None:
                chunk["prompt_logprobs"] = prompt_entries
            self.emit(chunk)
            if not state.finished and not await self.engines.draft_acquired():
                self.observer.draft_lost()
        finally:
            self.engines.abandon_draft()   # the request ended before its draft engine was needed
        try:
            while not state.finished:
                if time.perf_counter() > deadline_s:
                    state.finish_reason = "timeout"
                    break
                await self._round()
        finally:
            self._drop_queued()

    async def _round(self) -> None:
        """One round."""
        state, engines = self.state, self.engines
        round_started = time.perf_counter()
        started_alone = self.num_active() == 1
        stages = RoundStages(self.profile)
        stages.mark("start")
        # A round queued behind the last one is target-only: it is decoding already.
        num_draft = self.choose_depth(state) if engines.draft is not None and self.queued is None else 0
        capture_k = self.observer.capture_top_k() if num_draft > 0 else None  # online training's sample
        stages.mark("depth")
        proposal, draft_s, draft_hops_s, draft_calls = Proposal([], None), 0.0, 0.0, []
        # A request's first round is no steady one: its draft call also fills the draft's cache.
        predrafted_before = self.predrafted if state.stats.rounds else None
        if num_draft > 0:
            try:
                proposal, draft_s, draft_hops_s = await self._propose(num_draft, stages, draft_calls)
            except ENGINE_ERRORS:
                logger.warning("draft engine lost for %s; continuing target-only", state.request_id)
                self.observer.draft_lost()
                state.stats.draft_failures += 1
                engines.lose_draft()
        stages.mark("proposed")
        steps = 1 if proposal.token_ids else self._target_only_steps()
        rows, verify = await self._verify(proposal, capture_k, steps, round_started)
        top, context = None, None
        if capture_k is not None:  # the target also answered its top-k at the block's positions
            rows, top = rows
            context = state.history
        stages.target = verify
        accepted_before, passes_before = state.stats.num_accepted, state.stats.target_passes
        committed, logprob_rows = self._commit(proposal, rows.answers if isinstance(rows, DecodedSteps) else (rows,))
        num_accepted = state.stats.num_accepted - accepted_before
        if proposal.token_ids:
            count_round_positions(state.draft_reached, state.draft_accepted_at, len(proposal.token_ids), num_accepted)
        captured = None if top is None or not proposal.token_ids else captured_block(
            state.request_id, context, proposal.token_ids, num_accepted, *top, proposal.draft_version)
        stages.mark("accepted")
        self.observer.round(RoundRecord(
            request_class=request_class(state), num_drafted=len(proposal.token_ids), num_accepted=num_accepted,
            wall_s=time.perf_counter() - round_started, draft_s=draft_s, target_s=verify.engine_s,
            target_passes=state.stats.target_passes - passes_before,
            hops_s=draft_hops_s + verify.hops_s, alone=started_alone and self.num_active() == 1,
            draft_calls=tuple(draft_calls), draft_version=proposal.draft_version,
            captured=captured, predrafting=self.predrafted if proposal.token_ids and
            self.predrafted == predrafted_before else None))
        stages.mark("recorded")
        if state.finished:
            self._drop_queued()
        self.emit(step_chunk(state, committed, logprob_rows))
        stages.mark("chunked")
        if stages.enabled:
            self.observer.round_stages(stages.stages())

    async def _verify(self, proposal: Proposal, capture_k: int | None, steps: int, round_started: float
                      ) -> tuple[object, EngineCall]:
        """The target's answer to this round: the round queued behind the last one when there is
        one, else this round's verify; a target-only round whose next round will be target-only
        too queues that one behind it at once (`_queue_next`)."""
        queued, self.queued = self.queued, None
        if queued is None:
            if proposal.token_ids or capture_k is not None or not self._next_is_target_only():
                return await self.engines.verify(self.state, proposal, capture_top_k=capture_k, steps=steps)
            # a task: its call goes out before the round queued behind it
            current = asyncio.ensure_future(self.engines.verify(self.state, proposal, steps=steps))
            self._queue_next(steps)
            return await current
        if self._next_is_target_only():
            self._queue_next(steps)
        answer = await queued
        if answer is None:   # the engine could not continue: nor can the round queued behind
            self._drop_queued()
            return await self.engines.verify(self.state, proposal, steps=steps)
        rows, span = answer
        return rows, EngineCall.queued(round_started, span, time.perf_counter())

    def _next_is_target_only(self) -> bool:
        """The round after this target-only one drafts nothing either: the request has no draft
        engine, or its depth is 0 now. A depth that rises meanwhile waits one round: the round
        already queued runs first, as it is (`_round` asks for none while one is queued)."""
        return self.engines.draft is None or self.choose_depth(self.state) == 0

    def _queue_next(self, steps: int) -> None:
        """Queue the target-only round that follows one of `steps` tokens now in flight, unless
        that one may end the request by max_tokens or the context."""
        room = self._room() - steps
        if room > 0:
            self.queued = asyncio.ensure_future(self.engines.continue_round(
                self.state, min(self.speculation.target_only_steps, room)))

    def _drop_queued(self) -> None:
        """Give up the queued round (the request finished): the request's release frees what
        the engine decoded for it."""
        queued, self.queued = self.queued, None
        if queued is not None:
            queued.cancel()
            queued.add_done_callback(observed)

    def _room(self) -> int:
        """Tokens the request may still commit: up to max_tokens and the model's context."""
        state = self.state
        return min(state.params.max_tokens - len(state.output_ids),
                   state.max_context - len(state.prompt_ids) - len(state.output_ids))

    def _target_only_steps(self) -> int:
        """Tokens a round without a block may decode in the target at once: the configured
        number, but none past max_tokens or the model's context."""
        return max(1, min(self.speculation.target_only_steps, self._room()))

    def _commit(self, proposal: Proposal, answers: tuple) -> tuple[list[int], LogprobEntries | None]:
        """Commit a round's answers in order (one; or a target-only round's steps, until the
        request finishes) -> the tokens committed and, for a logprobs request, their entries."""
        committed, entries = [], []
        for answer in answers:
            rows, logprob_rows = split_logprobs(self.state.params, answer)
            committed += accept_round(self.state, proposal, rows, self.speculation.verification)
            entries.append(logprob_rows)
            if self.state.finished:
                break
        if entries[0] is None:
            return committed, None
        return committed, entries[0] if len(entries) == 1 else LogprobEntries.joined(entries)

    async def _propose(self, num_draft: int, stages: RoundStages, draft_calls: list[tuple[float, int]]
                       ) -> tuple[Proposal, float, float]:
        """This round's draft block, the draft engine seconds and the hop seconds the round waited
        on. draft_calls gets (engine seconds, tokens) of a block drafted now, for the draft's cost
        estimate (a pre-drafted block cost the round nothing).

        The draft engine answers from its speculation cache (a hit: Proposal.cached) or drafts now,
        and pre-drafts this block's outcomes while it is verified."""
        state, engines = self.state, self.engines
        sent_s = time.perf_counter()
        fan_out = self.choose_fan_out(state, num_draft)
        answer = await engines.propose(state, num_draft, fan_out)
        reply = None if engines.needs_features(answer) else engines.draft_reply(answer)
        if reply is None and engines.features_from is None:
            # the draft did not hold the history: it drafts again from all of it
            sent_s = time.perf_counter()
            answer = await engines.propose(state, num_draft, fan_out)
            reply = None if engines.needs_features(answer) else engines.draft_reply(answer)
            if reply is None and engines.features_from is None:
                raise RuntimeError(f"draft engine refused {state.request_id}'s whole history")
        if reply is None:   # the head lacks the target's features: this round is target-only
            return Proposal([], None), 0.0, 0.0
        proposal, span = reply
        state.stats.num_discarded_ahead += proposal.predrafted_thrown_away
        self.observer.fan_out(sum(fan_out.blocks))
        call = stages.draft = EngineCall.from_span(sent_s, span, time.perf_counter())
        predrafted, self.predrafted = self.predrafted, bool(fan_out.blocks) and bool(proposal.token_ids)
        if predrafted:
            self.observer.speculation_cache(request_class(state), proposal.cached)
        if proposal.cached:
            state.stats.pipelined_rounds += 1
            return proposal, 0.0, call.hops_s
        state.stats.speculation_cache_misses += predrafted
        draft_calls.append((call.engine_s, len(proposal.token_ids)))
        return proposal, call.engine_s, call.hops_s
