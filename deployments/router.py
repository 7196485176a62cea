"""Router: owns each request's committed history and drives its speculative rounds.

A request's rounds run in deployments/round_loop.py against the engines it holds
(deployments/request_engines.py: target failover, draft loss); each round's record goes to one
observer (deployments/round_record.py) that feeds this router's depth chooser
(policies/depth_chooser.py) and metrics. The router itself keeps what spans requests: admission,
the depth chooser and the policy actor's decision it polls, releases on every engine a request
touched, health and drain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from transformers import AutoTokenizer

from specserve.common.channel import ChannelPool, EngineGoneError
from specserve.common.config import SpecServeConfig
from specserve.common.messages import REQUEST_CLASSES, EngineEndpoint, RouterReport, StreamSink
from specserve.decoding.checkpoint import eos_token_ids, max_model_len
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.sequence import RequestState
from specserve.deployments.admission import Admission
from specserve.common.metrics import RouterMetrics
from specserve.common.naming import current_replica_id
from specserve.deployments.pool_health import PoolHealth
from specserve.deployments.request_engines import RequestEngines
from specserve.deployments.round_capture import RoundCapture
from specserve.deployments.round_loop import RoundLoop
from specserve.deployments.round_record import RoundObserver, RoundTimings
from specserve.deployments.round_stages import profiling_enabled
from specserve.deployments.streaming import ChunkSender, final_chunk
from specserve.policies.depth_chooser import DepthChooser, request_class
from specserve.policies.fan_out import FanOut, may_predraft

logger = logging.getLogger("ray.serve")
POLICY_INTERVAL_S = 1.0  # how often a router reports load to the policy actor and reads its decision
RELEASE_RETRY_S = 300.0  # how long a release keeps trying an engine that is temporarily unreachable


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
        self.eos_token_ids = eos_token_ids(self.config.target.path, self.tokenizer)
        self.router_id = current_replica_id()
        self.metrics = RouterMetrics(self.router_id)
        self.active_requests: dict[str, RequestState] = {}
        limits = self.config.limits
        self.admission = Admission(limits.max_active_requests, limits.max_queued_requests, limits.queue_timeout_s)
        self.depth = DepthChooser(self.config.speculation)
        self.capture = RoundCapture(self.config, self.metrics)  # online draft training's rounds (off by default)
        self.channels = ChannelPool()  # this process's channels to engines, opened once, shared by every request
        self._background: set[asyncio.Task] = set()  # releases retried on engines that were unreachable
        self._policy_task: asyncio.Task | None = None
        self.profile_rounds = profiling_enabled()

    def _detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def num_active_requests(self) -> int:
        return len(self.active_requests)

    def status(self) -> dict[str, Any]:
        """This router's load, the depth it would give a fresh greedy (unseeded) request now, and
        its open channels (to engines and ingress replicas) by transport."""
        typical_depth = self.depth.typical_depth(len(self.active_requests), time.monotonic())
        decision = self.depth.policy_decision
        return {"active_requests": len(self.active_requests), "queued_requests": self.admission.num_waiting,
                "num_draft_tokens": typical_depth if self.config.uses_draft_workers else 0,
                "draft_kind": self.config.speculation.draft_kind,
                "pending_releases": len(self._background), "channels": self.channels.transports(),
                "policy": None if decision is None else decision.to_dict()}

    async def pool_health(self) -> dict[str, Any]:
        """{"status": "starting" | "ok" | "degraded" | "unavailable", "pools": {pool: "ok" | "unavailable"}}
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
        is gone, the last decision stands until it goes stale (policies.depth_chooser), then
        requests use their own depth."""
        from specserve.policies.actor import get_or_create_policy_actor

        policy = None
        while True:
            try:
                if policy is None:
                    policy = get_or_create_policy_actor(self.config)
                policy.report_router.remote(self._load_report())
                decision = await asyncio.wait_for(policy.decision.remote(), POLICY_INTERVAL_S)
                self.depth.set_policy_decision(decision, time.monotonic())
            except Exception:  # restarting or unreachable: Ray restarts it; look it up again
                policy = None
            await asyncio.sleep(POLICY_INTERVAL_S)

    def _load_report(self) -> RouterReport:
        active_by_class = dict.fromkeys(REQUEST_CLASSES, 0)
        for state in self.active_requests.values():
            active_by_class[request_class(state)] += 1
        return RouterReport(self.router_id, len(self.active_requests), active_by_class, self.depth.counters_report(),
                            self.depth.round_costs.overhead_s)

    async def generate(self, sink: StreamSink, request_id: str, prompt_ids: list[int], params: dict,
                       prompt_logprobs: int | None = None, cache_salt: str | None = None) -> None:
        """Generate, pushing {"text", "token_ids", "finish_reason"} chunks to the ingress's stream
        `sink` (deployments.streaming); the last adds "usage" and "speculation". Returns once the
        last chunk, or the error that ended the request, is delivered there; cancelled (the client
        left), the request ends and every engine it touched releases it.
        prompt_logprobs: the first chunk adds "prompt_logprobs", an entry per prompt token (the
        first's logprob None) with this many alternatives, from the target's prefill.
        cache_salt: the engines key this request's prefix-cache blocks under it (vLLM's tenant
        isolation); None: the engines' shared cache.
        """
        state = RequestState(request_id=request_id, prompt_ids=list(prompt_ids),
                             params=SamplingParams.model_validate(params), eos_token_id=self.eos_token_ids,
                             max_context=self.max_context, detokenize=self._detokenize, cache_salt=cache_salt)
        chunks = ChunkSender(self.channels.to(sink.address), sink)
        self._ensure_policy_loop()
        await chunks.finish(await self._decode(state, chunks, prompt_logprobs))

    async def _decode(self, state: RequestState, chunks: ChunkSender,
                      prompt_logprobs: int | None = None) -> dict | Exception:
        """Admission, then the request's rounds until it finishes, every step's tokens sent as a
        chunk; -> the last chunk, or the error that ended the request. Whatever happens, every
        engine the request touched releases it."""
        request_id = state.request_id
        started = time.perf_counter()
        timings = RoundTimings(round_stages=[] if self.profile_rounds else None)
        engines = RequestEngines(self.target_workers, self.draft_workers, self.config.limits, self.channels,
                                 self.config.speculation.verification)
        observer = RoundObserver(timings, self.depth, self.metrics, self.capture)
        loop = RoundLoop(state, engines, observer, chunks.put, self._choose_depth, self.num_active_requests,
                         self.config.speculation, self.profile_rounds, self._choose_fan_out)
        try:
            async with self.admission.slot():
                self.active_requests[request_id] = state
                self.metrics.set_active_requests(len(self.active_requests))
                await loop.run(started, started + self.config.limits.request_timeout_s, prompt_logprobs)
            speculation = {**state.stats.to_dict(), **timings.to_dict(), "proposer": self.config.speculation.proposer,
                           "draft_kind": self.config.speculation.draft_kind}
            return final_chunk(state, speculation)
        except Exception as exc:  # the stream raises it to the caller
            return exc
        finally:
            self.active_requests.pop(request_id, None)
            self.metrics.set_active_requests(len(self.active_requests))
            # Counters from the same stats the response's `speculation` field carries, so they agree.
            self.metrics.record_request(state.finish_reason, state.stats.to_dict())
            for engine in engines.touched:
                self._release_everywhere(engine, request_id)

    def _choose_depth(self, state: RequestState) -> int:
        return self.depth.choose(state, len(self.active_requests), time.monotonic())

    def _choose_fan_out(self, state: RequestState, num_draft: int) -> FanOut:
        params = state.params
        if not may_predraft(self.config.speculation.proposer, params.seed is not None and not params.is_greedy):
            return FanOut()
        num_active, now = len(self.active_requests), time.monotonic()
        return FanOut(self.depth.fan_out(state, num_draft, num_active, now),
                      self.depth.predraft_depth(state, num_draft, num_active, now))

    def _spawn(self, coroutine) -> None:
        """Run coroutine in the background, kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _release_everywhere(self, engine: EngineEndpoint, request_id: str) -> None:
        """Release request_id on engine (over its channel, with the other requests' calls); if the
        engine is unreachable for now, keep trying in the background until it answers or is gone
        for good (nothing listens at its address: its state died with its process)."""
        async def release() -> None:
            deadline = time.monotonic() + RELEASE_RETRY_S
            delay_s = 0.5
            while True:
                try:
                    await self.channels.to(engine.address).call("release", request_id)
                    return
                except EngineGoneError:
                    return  # dead for good
                except Exception:
                    if time.monotonic() > deadline:
                        logger.error("could not release %s on an unreachable engine", request_id)
                        return
                    await asyncio.sleep(delay_s)
                    delay_s = min(2 * delay_s, 10.0)

        self._spawn(release())
