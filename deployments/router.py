"""Router: owns each request's committed history and drives its speculative rounds.

Per round: draft engine proposes K tokens -> target engine scores [last, d1..dK] in one forward
-> ``accept_round`` (rejection sampling) commits tokens here -> they stream out. Engines are
plain Ray actors reached directly (see engine_host.py); Serve picks which replica's engine a
request uses, once, at its start. Every engine call carries the full history, so a replacement
engine re-prefills by itself: a dead target is swapped for another replica's engine, a dead
draft makes the request continue target-only. Nothing committed is lost.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle
from transformers import AutoTokenizer

from cluster.config import SpecServeConfig
from decoding.checkpoint import eos_token_ids, max_model_len
from decoding.proposers import Proposal
from decoding.sampling import SamplingParams, draft_seed
from decoding.sequence import RequestState
from decoding.speculation import accept_round, discarded_ahead, drafted_ahead, token_logprobs
from deployments.admission import Admission, ServerOverloadedError
from deployments.engine_loop import EngineOverloadedError
from deployments.metrics import RouterMetrics
from deployments.naming import current_replica_id
from deployments.pool_health import PoolHealth
from deployments.round_stages import EngineCall, RoundStages, profiling_enabled
from policies.acceptance import count_round_positions, position_accept_rates, request_position_rates
from policies.load import REQUEST_CLASSES, accept_rate_from_rounds
from policies.depth import RoundCosts, RoundWallFit, best_depth_by_position, choose_draft_depth, should_draft_ahead

logger = logging.getLogger("ray.serve")
TARGET_RECOVERY_S = 60.0  # how long a request waits for a replacement target engine
POLICY_INTERVAL_S = 1.0  # how often a router reports load to the policy actor and reads its decision
POLICY_STALE_S = 30.0  # a decision older than this (actor gone) is dropped: per-request depth only
RELEASE_RETRY_S = 300.0  # how long a release keeps trying an engine that is temporarily unreachable
ENGINE_ERRORS = (RayActorError, ray.exceptions.ActorUnavailableError)


@dataclass
class RoundTimings:
    """Where a request's wall time went; overhead = round wall time minus engine compute, of
    which hops = the RPC hops of the calls the round waited on, and the rest the router's own work."""

    round_wall_s: list[float] = field(default_factory=list)
    round_overhead_s: list[float] = field(default_factory=list)
    round_hops_s: list[float] = field(default_factory=list)
    draft_depths: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    round_stages: list[dict[str, float]] | None = None  # per round, when profiling (round_stages.py)

    def to_dict(self) -> dict[str, Any]:
        def median_ms(values: list[float]) -> float | None:
            return round(1000 * statistics.median(values), 3) if values else None

        return {
            "median_round_ms": median_ms(self.round_wall_s),
            "median_overhead_ms": median_ms(self.round_overhead_s),
            "median_hops_ms": median_ms(self.round_hops_s),
            "median_router_ms": median_ms([o - h for o, h in zip(self.round_overhead_s, self.round_hops_s)]),
            "mean_draft_tokens": round(statistics.fmean(self.draft_depths), 3) if self.draft_depths else 0.0,
            "time_to_first_token_ms": None if self.first_token_s is None else round(1000 * self.first_token_s, 3),
            **({} if self.round_stages is None else {"round_stages_ms": [
                {name: round(1000 * seconds, 4) for name, seconds in stages.items()} for stages in self.round_stages]}),
        }


@serve.deployment
class Router:
    def __init__(self, config: dict, target_workers: DeploymentHandle,
                 draft_workers: DeploymentHandle | None = None) -> None:
        self.config = SpecServeConfig.model_validate(config)
        self.target_workers = target_workers
        self.draft_workers = draft_workers
        self.health = PoolHealth({"target": target_workers, "draft": draft_workers})
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.resolved_tokenizer_path, local_files_only=True)
        self.max_context = max_model_len(self.config.target.path, self.config.target.max_model_len)
        self.eos_token_id = eos_token_ids(self.config.target.path, self.tokenizer)  # the set
        self.metrics = RouterMetrics(current_replica_id())
        self.active_requests: dict[str, RequestState] = {}
        limits = self.config.limits
        self.admission = Admission(limits.max_active_requests, limits.max_queued_requests, limits.queue_timeout_s)
        self._background: set[asyncio.Task] = set()  # releases retried on engines that were unreachable
        # Measured costs, shared by this router's requests: they reflect the engines' current load.
        self.round_costs = RoundCosts(draft_cost_ratio=self.config.speculation.draft_cost_ratio)
        # What a round of depth K costs end to end when its request is alone, per class (greedy
        # rounds draft ahead, sampled ones do not): how a lone request picks K.
        self.lone_round_walls = {c: RoundWallFit() for c in REQUEST_CLASSES}
        # Cluster-wide depth from the policy actor (policies/actor.py), refreshed every second.
        self.router_id = current_replica_id()
        self.class_counters = {c: {"rounds": 0, "drafted": 0, "accepted": 0, "reached": [], "accepted_at": []}
                               for c in REQUEST_CLASSES}
        self.policy_decision: dict[str, Any] | None = None
        self.policy_decision_at = 0.0
        self._policy_task: asyncio.Task | None = None
        self.profile_rounds = profiling_enabled()

    def _detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def num_active_requests(self) -> int:
        return len(self.active_requests)

    def status(self) -> dict[str, Any]:
        """This router's load and the depth it would give a fresh greedy (unseeded) request now:
        the policy's depth for the class beside other requests, its lone choice when there are none."""
        spec = self.config.speculation
        typical_depth = spec.num_draft_tokens
        if spec.adaptive:
            cap = self._policy_depth_cap("greedy")
            if cap is not None and self.active_requests:
                typical_depth = min(spec.max_draft_tokens, cap)
            else:
                typical_depth = self._lone_depth("greedy", [], [], cap)
        return {"active_requests": len(self.active_requests), "queued_requests": self.admission.num_waiting,
                "num_draft_tokens": typical_depth if self.config.uses_draft_workers else 0,
                "pending_releases": len(self._background), "policy": self.policy_decision}

    async def pool_health(self) -> dict[str, Any]:
        """{"status": "ok" | "degraded" | "unavailable", "pools": {pool: "ok" | "unavailable"}}
        from the background monitor (deployments/pool_health.py): a busy engine is a live one.
        A draining router reports "unavailable" so load balancers stop sending to it."""
        report = await self.health.report()
        return {**report, "status": "unavailable", "draining": True} if self.admission.draining else report

    def drain(self) -> int:
        """Stop admitting requests (SIGTERM: the server is stopping); -> requests still held."""
        self.admission.drain()
        return len(self.active_requests) + self.admission.num_waiting

    def _ensure_policy_loop(self) -> None:
        if self._policy_task is None or self._policy_task.done():
            self._policy_task = asyncio.get_running_loop().create_task(self._policy_loop())

    async def _policy_loop(self) -> None:
        """Report this router's load to the policy actor and keep its latest decision. If the actor
        is gone, the last decision stands until POLICY_STALE_S, then requests use their own depth."""
        from policies.actor import get_or_create_policy_actor

        policy = None
        while True:
            try:
                if policy is None:
                    policy = get_or_create_policy_actor(self.config)
                policy.report_router.remote(self._load_report())
                self.policy_decision = await asyncio.wait_for(policy.decision.remote(), POLICY_INTERVAL_S)
                self.policy_decision_at = time.monotonic()
            except Exception:  # restarting or unreachable: Ray restarts it; look it up again
                policy = None
            await asyncio.sleep(POLICY_INTERVAL_S)

    def _load_report(self) -> dict[str, Any]:
        active_by_class = dict.fromkeys(REQUEST_CLASSES, 0)
        for state in self.active_requests.values():
            active_by_class[_request_class(state)] += 1
        return {"router": self.router_id, "active_requests": len(self.active_requests),
                "active_by_class": active_by_class, "by_class": self.class_counters,
                "round_overhead_s": self.round_costs.overhead_s}

    def _policy_depth_cap(self, request_class: str) -> int | None:
        """The depth the policy actor allows this request class now, or None (no fresh decision)."""
        if self.policy_decision is None or time.monotonic() - self.policy_decision_at > POLICY_STALE_S:
            return None
        return self.policy_decision.get("num_draft_tokens", {}).get(request_class)

    async def generate(self, request_id: str, prompt_ids: list[int], params: dict,
                       prompt_logprobs: int | None = None) -> AsyncIterator[dict]:
        """Stream {"text", "token_ids", "finish_reason"} chunks; the last adds "usage" and "speculation".
        prompt_logprobs: the first chunk adds "prompt_logprobs", an entry per prompt token (the
        first's logprob None) with this many alternatives, from the target's prefill.

        The rounds run in their own task and hand chunks over through a queue, so a round never
        waits for the previous chunk to be streamed out; chunks that pile up meanwhile are merged.
        Closing this generator (client gone) cancels the task, which releases worker state.
        """
        state = RequestState(request_id=request_id, prompt_ids=list(prompt_ids),
                             params=SamplingParams.model_validate(params), eos_token_id=self.eos_token_id,
                             max_context=self.max_context, detokenize=self._detokenize)
        chunks: asyncio.Queue = asyncio.Queue()
        self._ensure_policy_loop()
        rounds = asyncio.create_task(self._decode(state, chunks, prompt_logprobs))
        try:
            async for merged in coalesced_chunks(chunks, self.config.http.stream_interval_ms / 1000):
                yield merged
        finally:
            rounds.cancel()

    async def _decode(self, state: RequestState, chunks: asyncio.Queue, prompt_logprobs: int | None = None) -> None:
        """Admission, prefill, then speculative rounds until the request finishes; every step's
        tokens go to chunks. Whatever happens, every engine the request touched releases it."""
        request_id = state.request_id
        started = time.perf_counter()
        timings = RoundTimings(round_stages=[] if self.profile_rounds else None)
        engines: list[Any] = []  # every engine this request touched, to release them all
        try:
            async with self.admission.slot():
                self.active_requests[request_id] = state
                self.metrics.set_active_requests(len(self.active_requests))
                await self._rounds(state, chunks, timings, engines, started, prompt_logprobs)
            chunks.put_nowait(self._final_chunk(state, timings))
        except Exception as exc:  # hand it to the stream, which raises it to the caller
            chunks.put_nowait(exc)
        finally:
            self.active_requests.pop(request_id, None)
            self.metrics.set_active_requests(len(self.active_requests))
            self._record(state)
            for engine in engines:
                self._release_everywhere(engine, request_id)

    async def _rounds(self, state: RequestState, chunks: asyncio.Queue, timings: RoundTimings,
                      engines: list[Any], started: float, prompt_logprobs: int | None = None) -> None:
        request_id = state.request_id
        deadline = started + self.config.limits.request_timeout_s
        target = await self._target_engine()
        engines.append(target)
        draft = await self._draft_engine()
        if draft is not None:  # the draft prefills while the target does
            engines.append(draft)
            draft.prefill.remote(request_id, state.history)
        rows, _, target = await self._verify(state, target, engines, prompt_logprobs=prompt_logprobs)
        if prompt_logprobs is not None:  # the prefill answered (its usual answer, the prompt's entries)
            rows, prompt_entries = rows
        rows, logprob_rows = _split_logprobs(state, rows)
        committed = accept_round(state, Proposal([], None), rows)
        timings.first_token_s = time.perf_counter() - started
        self.metrics.record_first_token(timings.first_token_s)
        first_chunk = self._chunk(state, committed, logprob_rows)
        if prompt_logprobs is not None:
            first_chunk["prompt_logprobs"] = prompt_entries
        chunks.put_nowait(first_chunk)
        ahead = None  # (history it continued, its in-flight draft) while the target verifies
        while not state.finished:
            if time.perf_counter() > deadline:
                state.finish_reason = "timeout"
                break
            round_started = time.perf_counter()
            started_alone = len(self.active_requests) == 1
            stages = RoundStages(self.profile_rounds)
            stages.mark("start")
            num_draft = self._draft_depth(state) if draft is not None else 0
            stages.mark("depth")
            proposal, draft_s, draft_hops_s, sent = Proposal([], None), 0.0, 0.0, None
            if num_draft > 0:
                try:
                    proposal, draft_s, draft_hops_s, sent = await self._propose(state, draft, target, num_draft,
                                                                                ahead, stages)
                except ENGINE_ERRORS:
                    logger.warning("draft engine lost for %s; continuing target-only", request_id)
                    self.metrics.record_draft_failure()
                    state.stats.draft_failures += 1
                    draft = None
            stages.mark("proposed")
            if sent is None:  # the verify leaves before the block ahead is launched: it is on the round's path
                sent = self._send_verify(state, target, proposal)
            ahead = None
            if draft is not None and proposal.token_ids and should_draft_ahead(
                    self.config.speculation.pipeline, state.params.is_greedy, len(self.active_requests)):
                # Draft the next block now, guessing the bonus token, on the draft's own worker.
                ahead_of = state.history + proposal.token_ids
                ahead = (ahead_of, draft.propose.remote(request_id, ahead_of, num_draft + 1, state.params,
                                                        self._draft_seed(state), len(state.prompt_ids)))
            rows, verify, target = await self._verify(state, target, engines, proposal, sent)
            if stages.draft is not None and sent[2] is not None:  # the block went draft -> target
                verify = replace(verify, sent_s=stages.draft.left_s)
                stages.chained = True
            stages.target = verify
            target_s = verify.engine_s
            accepted_before = state.stats.num_accepted
            rows, logprob_rows = _split_logprobs(state, rows)
            committed = accept_round(state, proposal, rows, self.config.speculation.verification)
            if proposal.token_ids:
                counters = self.class_counters[_request_class(state)]
                counters["rounds"] += 1
                counters["drafted"] += len(proposal.token_ids)
                counters["accepted"] += state.stats.num_accepted - accepted_before
                taken = state.stats.num_accepted - accepted_before
                count_round_positions(counters["reached"], counters["accepted_at"], len(proposal.token_ids), taken)
                count_round_positions(state.draft_reached, state.draft_accepted_at, len(proposal.token_ids), taken)
            stages.mark("accepted")
            round_wall_s = time.perf_counter() - round_started
            overhead_s = round_wall_s - draft_s - target_s
            timings.round_wall_s.append(round_wall_s)
            timings.round_overhead_s.append(overhead_s)
            timings.round_hops_s.append(draft_hops_s + verify.hops_s)
            timings.draft_depths.append(len(proposal.token_ids))
            self.round_costs.observe_round(target_s, overhead_s)
            if proposal.token_ids and started_alone and len(self.active_requests) == 1:
                self.lone_round_walls[_request_class(state)].observe(len(proposal.token_ids), round_wall_s)
            self.metrics.record_round(round_wall_s, len(proposal.token_ids))
            stages.mark("recorded")
            chunks.put_nowait(self._chunk(state, committed, logprob_rows))
            stages.mark("chunked")
            if stages.enabled:
                timings.round_stages.append(stages.stages())

    async def _propose(self, state: RequestState, draft, target, num_draft: int, ahead,
                       stages: RoundStages) -> tuple[Proposal, float, float, Any]:
        """This round's draft block, the draft engine seconds and the RPC hop seconds the round
        waited on, and the verify already sent for it (or None).

        A block drafted ahead, during the last verification, is used when the target took it all
        and its bonus guess (decoding.speculation.drafted_ahead): no draft time, no hops, and the
        caller sends the verify. Otherwise a fresh block is drafted and its verify is sent at once,
        carrying the draft's answer as an ObjectRef (TargetEngine.verify's draft_block): the block
        goes draft -> target while this router awaits the same answer. The draft engine's cost
        estimate c always gets the drafting call's own engine time, so pipelined rounds do not drag
        the router-wide c towards 0. A fresh call first waits for a missed block ahead."""
        waited_s = 0.0
        if ahead is not None:
            ahead_of, pending = ahead
            started = time.perf_counter()
            drafted, (entered_s, _, left_s) = await pending
            stages.ahead_wait_s = time.perf_counter() - started
            self.round_costs.observe_draft(left_s - entered_s, len(drafted.token_ids))
            proposal = drafted_ahead(state.history, ahead_of, drafted, num_draft)
            state.stats.num_discarded_ahead += discarded_ahead(drafted, proposal)
            if proposal is not None:
                state.stats.pipelined_rounds += 1
                return proposal, 0.0, 0.0, None
            waited_s = time.perf_counter() - started
        sent_s = time.perf_counter()
        answer = draft.propose.remote(state.request_id, state.history, num_draft, state.params,
                                      self._draft_seed(state), len(state.prompt_ids))
        sent = self._send_verify(state, target, None, answer)
        try:
            proposal, span = await answer
        except BaseException:  # a lost draft: the caller goes on target-only with a verify of its own
            _discard(sent[0])
            raise
        call = stages.draft = EngineCall.from_span(sent_s, span, time.perf_counter())
        self.round_costs.observe_draft(call.engine_s, len(proposal.token_ids))
        return proposal, waited_s + call.engine_s, call.entered_s - call.sent_s, sent

    def _spawn(self, coroutine) -> None:
        """Run coroutine in the background, kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _target_engine(self):
        """A target engine for a new request; 503 when no target replica answers in time."""
        try:
            return await asyncio.wait_for(self.target_workers.get_engine.remote(),
                                          self.config.limits.engine_wait_s)
        except asyncio.TimeoutError:
            raise ServerOverloadedError(f"no target replica became available within "
                                        f"{self.config.limits.engine_wait_s:.0f} s", retry_after_s=5.0) from None

    async def _draft_engine(self):
        """This request's draft engine, or None (no proposer, or no draft replica reachable within
        limits.engine_wait_s): speculation is an optimisation, so serve target-only rather than wait."""
        if self.draft_workers is None:
            return None
        try:
            return await asyncio.wait_for(self.draft_workers.get_engine.remote(),
                                          self.config.limits.draft_wait_s)
        except Exception:
            logger.warning("no draft engine available; serving target-only", exc_info=True)
            self.metrics.record_draft_failure()
            return None

    def _send_verify(self, state: RequestState, target, proposal: Proposal | None = None,
                     draft_answer: Any = None, prompt_logprobs: int | None = None) -> tuple[Any, float, Any]:
        """Send one verify: of proposal's block, or of the block a draft engine is drafting
        (draft_answer: its propose ObjectRef, handed to the target unresolved). -> (ObjectRef of the
        answer, when it was sent, draft_answer). prompt_logprobs: a prefill that also returns the
        prompt's log-probabilities (TargetEngine.verify)."""
        block = proposal.token_ids if proposal else []
        sent_s = time.perf_counter()
        answer = target.verify.remote(state.request_id, state.history + block, len(block) + 1, state.params,
                                      state.next_output_index, None if draft_answer is None else [draft_answer],
                                      prompt_logprobs)
        return answer, sent_s, draft_answer

    async def _verify(self, state: RequestState, target, engines: list[Any], proposal: Proposal | None = None,
                      sent: tuple[Any, float, Any] | None = None,
                      prompt_logprobs: int | None = None) -> tuple[Any, EngineCall, Any]:
        """One target forward -> (rows, the call's timing, the engine that answered). sent: the
        verify already sent (`_send_verify`), else it is sent now.

        On a lost engine, ask Serve for one again until TARGET_RECOVERY_S passes: another
        replica's engine, or the replacement Serve starts once the dead replica fails its health
        check. The full history makes the new engine re-prefill, so nothing committed is lost.
        A full engine (no KV slot within its admission deadline) makes the request fail with 503."""
        deadline = time.monotonic() + TARGET_RECOVERY_S
        while True:
            try:
                answer, sent_s, draft_answer = sent if sent is not None else self._send_verify(
                    state, target, proposal, prompt_logprobs=prompt_logprobs)
                sent = None
                rows, span = await answer
                return rows, EngineCall.from_span(sent_s, span, time.perf_counter()), target
            except EngineOverloadedError as exc:
                raise ServerOverloadedError(str(exc), retry_after_s=2.0) from None
            except ENGINE_ERRORS:
                if time.monotonic() > deadline:
                    raise
                logger.warning("target engine lost for %s; re-prefilling on another engine", state.request_id)
                state.stats.target_failovers += 1
                await asyncio.sleep(0.5)
                try:
                    target = await self.target_workers.get_engine.remote()
                    engines.append(target)
                except Exception:  # the replica itself may be going down: try again shortly
                    logger.warning("no target replica reachable yet for %s", state.request_id)

    def _release_everywhere(self, engine, request_id: str) -> None:
        """Release request_id on engine; if the engine is unreachable for now, keep trying in the
        background until it answers or is gone for good (a dead actor's state died with it)."""
        async def release() -> None:
            deadline = time.monotonic() + RELEASE_RETRY_S
            delay_s = 0.5
            while True:
                try:
                    await engine.release.remote(request_id)
                    return
                except RayActorError:
                    return  # dead for good
                except Exception:
                    if time.monotonic() > deadline:
                        logger.error("could not release %s on an unreachable engine", request_id)
                        return
                    await asyncio.sleep(delay_s)
                    delay_s = min(2 * delay_s, 10.0)

        self._spawn(release())

    def _draft_depth(self, state: RequestState) -> int:
        """K for this round. With company (more than one active request) the policy actor's depth
        for the request's class is used as it is: its goodput model sees the batched cost curves
        and the load, which a request's own view does not (per-request choices, and refining the
        class's depth by the request's own acceptance, both measured slower: docs/depth-and-autoscaling.md).
        Alone, `_lone_depth`.
        0 from the policy: speculation does not pay now. A seeded request's K must not depend on
        timing or load (its random draws follow K), so it uses the configured cost ratio and no
        policy."""
        spec = self.config.speculation
        if not spec.adaptive:
            return state.draft_budget(spec.num_draft_tokens)
        if state.params.seed is not None:
            if spec.max_draft_tokens <= 0:
                return 0
            return state.draft_budget(choose_draft_depth(
                state.stats.num_accepted, state.stats.num_drafted, spec.draft_cost_ratio, spec.min_draft_tokens,
                spec.max_draft_tokens, 0.0, num_rounds=state.stats.rounds))
        request_class = _request_class(state)
        policy_depth = self._policy_depth_cap(request_class)
        if policy_depth is not None and len(self.active_requests) > 1:
            return state.draft_budget(min(spec.max_draft_tokens, policy_depth))
        return state.draft_budget(self._lone_depth(request_class, state.draft_reached, state.draft_accepted_at,
                                                   policy_depth))

    def _lone_depth(self, request_class: str, reached: list[int], accepted_at: list[int], cap: int | None) -> int:
        """K for a request of this class with these rounds by position, as if alone: the policy's
        depth (cap) bounds it, and within it the request's own acceptance by position (leaning on
        its class's, policies.acceptance) and what a round costs choose, so an easy prompt drafts
        deeper than a hard one. The cost is the wall-clock line a + b*K of this class's lone
        rounds (policies.depth.RoundWallFit) once K has varied enough to fit one, else the
        engines' seconds (also with company but no policy decision)."""
        spec = self.config.speculation
        low, high = spec.min_draft_tokens, spec.max_draft_tokens
        if cap is not None:
            high = min(high, cap)
            low = min(low, high)
        if high <= 0:
            return 0
        lone_ratios = self.lone_round_walls[request_class].cost_ratios()
        if lone_ratios is not None and len(self.active_requests) <= 1:
            cost_ratio, overhead_ratio = lone_ratios
        else:
            cost_ratio, overhead_ratio = self.round_costs.draft_cost_ratio, self.round_costs.overhead_ratio
        rates = request_position_rates(reached, accepted_at, self._class_rates(request_class, high))
        return best_depth_by_position(rates, cost_ratio, low, high, overhead_ratio)

    def _class_rates(self, request_class: str, depth: int) -> tuple[float, ...]:
        """Acceptance by position for K up to depth over this router's rounds of the class (all
        time), leaning on the class's geometric alpha."""
        counters = self.class_counters[request_class]
        alpha = accept_rate_from_rounds(counters["rounds"], counters["drafted"], counters["accepted"])
        return position_accept_rates(counters["reached"], counters["accepted_at"], depth, alpha)

    @staticmethod
    def _draft_seed(state: RequestState) -> int | None:
        return draft_seed(state.params.seed)

    @staticmethod
    def _chunk(state: RequestState, committed: list[int], logprob_rows=None) -> dict:
        chunk = {"text": state.take_text_delta(), "token_ids": committed, "finish_reason": state.finish_reason}
        if logprob_rows is not None:
            chunk["logprobs"] = token_logprobs(committed, logprob_rows, state.params.logprobs)
        return chunk

    def _final_chunk(self, state: RequestState, timings: RoundTimings) -> dict:
        usage = {"prompt_tokens": len(state.prompt_ids), "completion_tokens": len(state.output_ids),
                 "total_tokens": len(state.prompt_ids) + len(state.output_ids)}
        speculation = {**state.stats.to_dict(), **timings.to_dict(),
                       "proposer": self.config.speculation.proposer}
        return {"text": state.take_text_delta(), "token_ids": [], "finish_reason": state.finish_reason,
                "usage": usage, "speculation": speculation}

    def _record(self, state: RequestState) -> None:
        """Counters from the same stats the response's `speculation` field carries, so they agree."""
        self.metrics.record_request(state.finish_reason, state.stats.to_dict())


def _discard(answer) -> None:
    """Let an ObjectRef's call finish unobserved: its failure must not be logged as unhandled."""
    try:
        ray.cancel(answer)
    except Exception:
        pass


def _request_class(state: RequestState) -> str:
    return "greedy" if state.params.is_greedy else "sampled"


async def coalesced_chunks(chunks: asyncio.Queue, interval_s: float = 0.0) -> AsyncIterator[dict]:
    """The chunks put on the queue, merged: whatever piled up since the last one went out, and with
    interval_s > 0 at most one per interval after the first (the first token and the final chunk
    never wait). Ends after the chunk with "usage"; raises an exception put on the queue."""
    last_sent = None
    while True:
        pending = [await chunks.get()]
        if interval_s and last_sent is not None:  # let rounds pile up, but never hold the last one
            deadline = last_sent + interval_s
            while not _is_last(pending[-1]) and (wait_s := deadline - time.perf_counter()) > 0:
                try:
                    pending.append(await asyncio.wait_for(chunks.get(), wait_s))
                except asyncio.TimeoutError:
                    break
        while not chunks.empty():
            pending.append(chunks.get_nowait())
        if isinstance(pending[-1], Exception):
            raise pending[-1]
        merged = _merge_chunks(pending)
        yield merged
        last_sent = time.perf_counter()
        if "usage" in merged:
            return


def _is_last(chunk: dict | Exception) -> bool:
    """The final chunk (usage) or an error: never held back by the stream interval."""
    return isinstance(chunk, Exception) or "usage" in chunk


def _merge_chunks(chunks: list[dict]) -> dict:
    """One chunk carrying several steps' text and tokens (the last one's finish reason and stats)."""
    if len(chunks) == 1:
        return chunks[0]
    merged = dict(chunks[-1])
    merged["text"] = "".join(chunk["text"] for chunk in chunks)
    merged["token_ids"] = [token for chunk in chunks for token in chunk["token_ids"]]
    if any("logprobs" in chunk for chunk in chunks):
        merged["logprobs"] = [entry for chunk in chunks for entry in chunk.get("logprobs", [])]
    for chunk in chunks:  # only the first chunk of a request has them
        if "prompt_logprobs" in chunk:
            merged["prompt_logprobs"] = chunk["prompt_logprobs"]
    return merged


def _split_logprobs(state: RequestState, rows):
    """(rows, raw log-probability rows or None): a logprobs request's verify answers with both."""
    return rows if state.params.logprobs is not None else (rows, None)
