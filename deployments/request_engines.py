"""The engines one request talks to, and what happens when one of them is lost.

Serve picks which replica's engine a request uses, once, at its start (deployments/engine_host.py:
the engine's actor and its channel's address); every round's call then goes over this router
process's channel to that engine (common.channel), batched with the other requests' calls of the
same event-loop turn. A channel that closes or goes silent is a lost engine. Engines keep each
request's committed history; a call carries only what was committed since that engine's last
call, and an engine that does not hold the history answers UnknownHistory, which makes this side
send all of it once (deployments/committed_history.py). So a replacement engine re-prefills from
the router's history: a dead target is swapped for another replica's engine, a dead draft makes
the request continue target-only. Nothing committed is lost. `touched` lists every engine the
request used, so the router can release it on all of them.

With an EAGLE-3 head for a draft, each verify's answer carries the target's features of the
positions its forward computed; this side keeps them until the next propose, which carries those
of the committed positions (docs/eagle3.md#serving). A draft engine lacking a request's features
(a replacement) answers UnknownFeatures: that round runs target-only, the target computing the
features again from where the draft needs them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray.serve.handle import DeploymentHandle

from specserve.common.channel import ChannelLostError, ChannelPool
from specserve.common.config import LimitsSpec
from specserve.common.messages import CallSpan, EngineEndpoint, UnknownFeatures, UnknownHistory
from specserve.decoding.target_features import TargetFeatures, merged_features
from specserve.decoding.proposers import Proposal
from specserve.decoding.sampling import draft_seed
from specserve.decoding.sequence import RequestState
from specserve.deployments.admission import ServerOverloadedError
from specserve.deployments.committed_history import HistorySender, RunningDigest
from specserve.deployments.engine_loop import EngineOverloadedError, observed
from specserve.deployments.round_stages import EngineCall
from specserve.policies.fan_out import FanOut
from specserve.policies.prefix_routing import prefix_key

logger = logging.getLogger("ray.serve")
TARGET_RECOVERY_S = 60.0  # how long a request waits for a replacement target engine
ENGINE_ERRORS = (ChannelLostError,)


class RequestEngines:
    """A request's target engine and, while it has one, its draft engine."""

    def __init__(self, target_workers: DeploymentHandle, draft_workers: DeploymentHandle | None,
                 limits: LimitsSpec, channels: ChannelPool, verification: str = "block") -> None:
        """channels: this router process's channels to engines; verification: how sampled blocks
        are verified (speculation.verification); the target's answers are computed for it."""
        self.verification = verification
        self.target_workers = target_workers
        self.draft_workers = draft_workers
        self.limits = limits
        self.channels = channels
        self.target: EngineEndpoint | None = None
        self.draft: EngineEndpoint | None = None
        self.affinity_key: str | None = None   # the prompt's prefix key (set by acquire)
        self._draft_lookup: asyncio.Future | None = None   # acquire's draft engine, until draft_acquired
        self._draft_abandoned = False   # the request ended before its draft engine was needed
        self.touched: list[EngineEndpoint] = []
        digest = RunningDigest()
        self.target_history = HistorySender(digest)  # what the target engine was told of the committed history
        self.draft_history = HistorySender(digest)
        self.features: TargetFeatures | None = None   # the target's, not yet sent to the draft engine
        self.features_from: int | None = None         # the next verify computes the features again from here

    async def acquire(self, state: RequestState) -> None:
        """A target engine, preferably the one likely to hold the prompt's prefix
        (policies.prefix_routing; 503 when no target replica answers in time), each a Serve call.
        Where there is a draft pool, its engine is asked for at the same time; it prefills as soon
        as it answers, and `draft_acquired` awaits it: the target's prefill does not wait for it."""
        self.affinity_key = prefix_key(state.prompt_ids)
        if self.draft_workers is not None:
            self._draft_lookup = asyncio.ensure_future(self._acquire_draft(state))
        try:
            self.target = await asyncio.wait_for(self.target_workers.get_engine.remote(self.affinity_key),
                                                 self.limits.engine_wait_s)
        except BaseException as error:
            self.abandon_draft()
            if isinstance(error, asyncio.TimeoutError):
                raise ServerOverloadedError(f"no target replica became available within "
                                            f"{self.limits.engine_wait_s:.0f} s", retry_after_s=5.0) from None
            raise
        self.touched.append(self.target)

    async def _acquire_draft(self, state: RequestState) -> bool:
        """A draft engine if one answers within limits.draft_wait_s (speculation is an
        optimisation, so a request serves target-only rather than wait), which starts prefilling."""
        try:
            draft = await asyncio.wait_for(self.draft_workers.get_engine.remote(), self.limits.draft_wait_s)
        except Exception:
            logger.warning("no draft engine available; serving target-only", exc_info=True)
            return False
        if self._draft_abandoned:
            # asyncio.wait_for (Python 3.11) returns an answer that arrived in the same event-loop
            # turn as its cancel instead of raising: the request is gone, and the router may have
            # released its engines already, so nothing may start on this one.
            return False
        self.draft = draft
        self.touched.append(self.draft)
        prefill = self._call(self.draft, "prefill", state.request_id, self.draft_history.update(state))
        prefill.add_done_callback(observed)   # a lost draft shows at the first propose
        return True

    async def draft_acquired(self) -> bool:
        """Await the draft engine `acquire` asked for. -> False when there is a draft pool but none
        of its engines answered."""
        lookup, self._draft_lookup = self._draft_lookup, None
        return True if lookup is None else await lookup

    def abandon_draft(self) -> None:
        """Stop a draft lookup still under way (the request ended, or failed, before it needed the
        draft): a lookup stopped starts nothing on any engine, even one whose answer came in the
        same turn as the stop, and one that answered before is in `touched`, so the router
        releases it."""
        if self._draft_lookup is not None:
            self._draft_abandoned = True
            self._draft_lookup.add_done_callback(observed)
            self._draft_lookup.cancel()
            self._draft_lookup = None

    def _call(self, engine: EngineEndpoint, method: str, *args: Any) -> asyncio.Future:
        return self.channels.to(engine.address).call(method, *args)

    def lose_draft(self) -> None:
        self.draft = None
        self.features = None

    def needs_features(self, reply: Any) -> bool:
        """The propose's answer says the draft engine's head lacks the target's features from some
        position: the next verify computes them again from there (the round goes target-only)."""
        if not isinstance(reply, UnknownFeatures):
            return False
        self.features_from = reply.start
        return True

    def propose(self, state: RequestState, num_tokens: int, fan_out: FanOut = FanOut()) -> asyncio.Future:
        """The draft engine's (proposal, span) for num_tokens continuing the committed history, or
        its UnknownHistory (`draft_reply`); fan_out: what it then pre-drafts for the outcomes of
        verifying this block (DraftEngine.propose)."""
        # The features of the committed positions the target computed (all but the last token's).
        features = None if self.features is None else self.features.before(len(state.history) - 1)
        self.features = None
        return self._call(self.draft, "propose", state.request_id, self.draft_history.update(state), num_tokens,
                          state.params, draft_seed(state.params.seed), len(state.prompt_ids), fan_out.blocks,
                          features, fan_out.depth)

    def draft_reply(self, reply: Any) -> tuple[Proposal, Any] | None:
        """A propose's answer, or None when the draft engine did not hold the history: the next
        propose then carries all of it."""
        if isinstance(reply, UnknownHistory):
            self.draft_history.forget()
            return None
        return reply

    async def verify(self, state: RequestState, proposal: Proposal | None = None, prompt_logprobs: int | None = None,
                     capture_top_k: int | None = None, steps: int = 1) -> tuple[Any, EngineCall]:
        """One target forward over proposal's block (and its q; none: a prefill) -> (rows, the
        call's timing). prompt_logprobs: a prefill that also returns the prompt's log-probabilities;
        capture_top_k: a round captured for online training; steps: a round without a block may
        decode up to this many tokens, answered as DecodedSteps (TargetEngine.verify).

        On a lost engine, ask Serve for one again until TARGET_RECOVERY_S passes: another
        replica's engine, or the replacement Serve starts once the dead replica fails its health
        check. The new engine answers UnknownHistory and is sent the whole history, which it
        re-prefills, so nothing committed is lost. A full engine (no KV slot within its admission
        deadline) makes the request fail with 503."""
        deadline = time.monotonic() + TARGET_RECOVERY_S
        resent_history = False
        while True:
            try:
                sent_s = time.perf_counter()
                features_from, self.features_from = self.features_from, None
                reply = await self._call(self.target, "verify", state.request_id, self.target_history.update(state),
                                         proposal if proposal and proposal.token_ids else None, state.params,
                                         state.next_output_index, prompt_logprobs, capture_top_k, self.verification,
                                         features_from, steps)
                if isinstance(reply, UnknownHistory):
                    if resent_history:
                        raise RuntimeError(f"target engine refused {state.request_id}'s whole history")
                    resent_history = True
                    self.target_history.forget()
                    continue
                rows, span = reply
                # kept while a draft engine has been asked for, too: the prefill may answer first
                if (self.draft is not None or self._draft_lookup is not None) and span.features is not None:
                    self.features = merged_features(self.features, span.features)
                return rows, EngineCall.from_span(sent_s, span, time.perf_counter())
            except EngineOverloadedError as exc:
                raise ServerOverloadedError(str(exc), retry_after_s=2.0) from None
            except ENGINE_ERRORS:
                if time.monotonic() > deadline:
                    raise
                logger.warning("target engine lost for %s; re-prefilling on another engine", state.request_id)
                state.stats.target_failovers += 1
                await asyncio.sleep(0.5)
                try:
                    self.target = await self.target_workers.get_engine.remote(self.affinity_key)
                    self.target_history.forget()
                    if all(engine.address != self.target.address for engine in self.touched):
                        self.touched.append(self.target)
                except Exception:  # the replica itself may be going down: try again shortly
                    logger.warning("no target replica reachable yet for %s", state.request_id)

    async def continue_round(self, state: RequestState, steps: int) -> tuple[Any, CallSpan] | None:
        """A target-only round of up to `steps` tokens that the target engine starts where the
        round in flight ends (TargetEngine.verify without a history), sent before that one's answer
        arrives, so the engine decodes on instead of waiting for this side between rounds. ->
        (rows, the engine's span), or None when the engine could not continue
        (it lost the round, or the channel): this side then sends the round the usual way."""
        try:
            reply = await self._call(self.target, "verify", state.request_id, None, None, state.params, None, None,
                                     None, self.verification, None, steps)
        except (*ENGINE_ERRORS, EngineOverloadedError):
            return None
        return None if isinstance(reply, UnknownHistory) else reply
