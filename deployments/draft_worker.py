"""Draft engine: proposes K tokens (and, when sampling, the q each was drawn from as (ids, probs))
per round, for every request drafting now in batched decode steps.

Batching is continuous at step granularity: an engine iteration runs ONE decode step for every
block being drafted, and a propose that arrives meanwhile joins the next step, rather than waiting
for the other blocks' K steps to end. A block unfinished at the end of an iteration stays queued
with what it drafted so far (decoding.proposers.Drafting); each row draws with its own generator,
so the block is the one drafting it alone draws.

While the target verifies a block, the engine pre-drafts the next block for the verification's
likely outcomes into its speculation cache (speculative speculative decoding,
decoding/speculation_cache.py, docs/speculation-cache.md): the next propose is answered at once
when its history is one of them. Disaggregation's edge: the draft has its own device, idle during
the verify otherwise.

Its weights can change while it serves (`load_draft`, docs/online-learning.md): a new version is
fetched (from Ray's object store, or a path) while the old one serves, and copied into the serving
runner between two forwards, in place (the same KV pool), every sequence's draft KV dropped (the engine keeps each request's committed history, so the next propose re-prefills from it). Each Proposal names the
version that drafted it and carries that version's q, which the router verifies the block
against, so a swap in the middle of a request changes speed, never the output distribution.

An EAGLE-3 head (proposer "eagle3") drafts from the target's features, which each propose
carries for the positions committed since the last (`Eagle3Proposer.observe`); an engine lacking
some answers UnknownFeatures and the router has the target compute them again. It pre-drafts
nothing: a pre-draft would need the features of positions the running verify is computing
(docs/eagle3.md#serving).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray
import torch

from specserve.common.messages import CallSpan, HistoryUpdate, UnknownFeatures, UnknownHistory
from specserve.decoding.batched_runner import load_runner
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.model_runner import checkpoint_weights
from specserve.decoding.proposer_registry import proposer_kind
from specserve.decoding.proposers import Drafting, Proposal, ProposeCall, empty_proposal, reads_target_features
from specserve.decoding.sampling import SamplingParams, make_generator
from specserve.decoding.speculation_cache import Predraft, block_of, continues, may_continue, predrafts, tokens_thrown_away
from specserve.policies.fan_out import MAX_BONUS_GUESSES, OutcomeCalibration, share_fan_out
from specserve.decoding.scheduler import CallShape, Schedule
from specserve.deployments.engine_core import EngineCore, StepOutput, timed_forward
from specserve.deployments.engine_loop import SequenceReleasedError, observed
from specserve.common.metrics import DraftVersionMetrics
from specserve.common.naming import ENGINE_NAMESPACE

OBJECT_STORE = "object store"  # DraftEngine.draft_source of weights sent through Ray's object store
REGISTER_INTERVAL_S = 5.0  # how often an engine tells the draft trainer its version (a new one learns the latest)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftCall:
    seq_id: str
    history: Sequence[int]
    num_tokens: int                  # 0: only prefill the cache with history
    params: SamplingParams | None = None
    seed: int | None = None
    prompt_len: int | None = None    # history's prompt tokens (penalties count the rest as output)
    num_candidates: int = 0          # also rank the draft's top tokens per position (Proposal.candidates)
    fork_of: str | None = None       # a pre-draft: its sequence starts from this one's KV (shared blocks)
    stream_state: torch.Tensor | None = None   # a sampled pre-draft: its stream starts from this state
    guess_rank: int | None = None    # a bonus pre-draft: its first token is a guess (ProposeCall.guess_rank)


@dataclass
class _Branch:
    """A block being pre-drafted for one verification outcome (decoding.speculation_cache)."""

    seq_id: str                      # its own sequence in this engine
    predraft: Predraft
    answer: asyncio.Future           # -> (Proposal, CallSpan)

    def drafted(self) -> Proposal | None:
        """Its block if it finished drafting one, else None."""
        if not self.answer.done() or self.answer.cancelled() or self.answer.exception() is not None:
            return None
        return self.answer.result()[0]   # None: dropped for want of a sequence slot


class DraftEngine(EngineCore):
    """Holds the proposer and, per request id, its KV slot and its seeded draft generator."""

    pool = "draft"
    channel_methods = frozenset({"prefill", "propose", "release"})

    def __init__(self, proposer_name: str, model_spec: dict | None, target_path: str, engine_options: dict,
                 name: str = "") -> None:
        kind = proposer_kind(proposer_name)
        runner = None
        if kind.needs_model:
            assert model_spec is not None, "a draft-model proposer needs a model spec"
            # The pair was checked before the app started (cluster.builder.served_model_specs): a
            # refusal here would only make Serve retry this deployment while the rest serves.
            runner = load_runner(model_spec)
        self.generators: dict[str, torch.Generator] = {}
        self.model_spec = model_spec
        self.draft_version, self.draft_path = 0, None if model_spec is None else model_spec["path"]
        self.draft_source = self.draft_path   # where the serving weights were read: a path, or "object store"
        self._pending_swap: tuple[int, str, str, Any] | None = None  # (version, path, source, state dict) fetched
        self._swap_lock = threading.Lock()
        self.trainer_name = engine_options.get("draft_trainer")
        self._registered_at = 0.0
        self.speculation: dict[str, list[_Branch]] = {}   # per request: its pre-drafts for the verify running now
        # per request: the block being verified (its history's length, the proposal), whose outcome
        # the next propose shows; what the draft's numbers mean, learned from those outcomes
        self.verifying: dict[str, tuple[int, Proposal, bool]] = {}
        self.calibration = {greedy: OutcomeCalibration() for greedy in (True, False)}
        self.drafting: dict[str, Drafting] = {}   # blocks drafted over several iterations, by sequence
        self._branch_count = 0
        self.speculative_s = 0.0
        super().__init__(runner, engine_options, name)
        # The proposer drafts through the engine's scheduler: its steps are planned forwards too.
        self.proposer = kind.build(None if runner is None else self.scheduler, model_spec, engine_options)
        # Pre-drafts fork a draft model's KV, or start from an EAGLE-3 head's last block; n-grams have neither.
        self.predrafts = runner is not None or hasattr(self.proposer, "fork")
        self.version_metrics = DraftVersionMetrics(name.rsplit(":", 1)[-1] if name else "local")
        self.version_metrics.set_version(0)

    async def load_draft(self, version: int, path: str,
                         weights: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """Serve the draft weights `version` from the next forward: `weights` (a state dict), or
        else the checkpoint at path (a shared versions_dir, or the draft this server started
        with). The trainer passes weights as a reference into Ray's object store, which Ray
        fetches to this node before the call runs: no node but the trainer's needs to read its
        disk. They are copied into the serving runner (BatchedModelRunner.load_weights), which
        keeps its KV pool: a swap needs no room for a second pool or a second copy of the
        weights. A load that fails raises and changes nothing: the current weights go on serving."""
        if self.runner is None:
            raise ValueError("an n-gram proposer has no weights to load")
        if (version, path) == (self.draft_version, self.draft_path):
            return await self.version()
        if weights is not None:
            state = weights
        else:
            state = await asyncio.to_thread(checkpoint_weights, path, self.runner.model.dtype)
        problem = self.runner.weights_mismatch(state)
        if problem is not None:
            raise ValueError(f"draft version {version} ({path}): {problem}")
        source = OBJECT_STORE if weights is not None else path
        with self._swap_lock:
            self._pending_swap = (version, path, source, state)
        logger.info("%s: draft version %d loaded from %s; it serves from the next forward",
                    self.name or self.pool, version, source)
        return {**(await self.version()), "pending": version}

    async def version(self) -> dict[str, Any]:
        """The draft version serving now, the path it names and where its weights were read."""
        return {"draft_version": self.draft_version, "draft_path": self.draft_path, "draft_source": self.draft_source}

    def step(self, calls: list[DraftCall]) -> tuple[dict[int, Any], int]:
        """An iteration, on the loaded version if one waits: it takes over here, between forwards.
        A pre-draft's sequence is forked from its request's here, in the worker thread. An
        iteration of pre-drafts only is speculative work: its seconds are counted apart
        (EngineStats.speculative_s), so the policy sees what the rounds wait on."""
        self._apply_pending_swap()
        started = time.perf_counter()
        dropped = self._fork_predrafts(calls)
        if dropped:
            kept = [index for index in range(len(calls)) if index not in dropped]
            kept_results, ran = super().step([calls[i] for i in kept])
            results = {kept[index]: result for index, result in kept_results.items()}
            results.update(dropped)
            ran += len(dropped)
        else:
            results, ran = super().step(calls)
        if calls and all(call.fork_of is not None for call in calls):
            self.speculative_s += time.perf_counter() - started
        return results, ran

    def _fork_predrafts(self, calls: list[DraftCall]) -> dict[int, None]:
        """Fork each new pre-draft's sequence from its request's while a sequence slot is free
        beyond those this iteration's new requests need; the rest are answered None (no block:
        the round drafts just in time). Pre-drafts are optional: they never take a request's slot."""
        dropped: dict[int, None] = {}
        if self.runner is None:   # a head's pre-draft starts from its request's last block (no KV slots)
            return {index: None for index, call in enumerate(calls)
                    if call.fork_of is not None and not self.proposer.fork(call.fork_of, call.seq_id, call.history)}
        blocks = self.scheduler.blocks
        free = blocks.num_free_slots - sum(1 for call in calls if call.fork_of is None and not blocks.num_cached(call.seq_id))
        for index, call in enumerate(calls):
            if call.fork_of is None or blocks.num_cached(call.seq_id):
                continue
            if self.drafting.pop(call.seq_id, None) is not None:   # preempted mid-block: its fork is gone
                dropped[index] = None
                continue
            if free <= 0:
                dropped[index] = None
                continue
            blocks.fork(call.fork_of, call.seq_id)
            free -= 1
        return dropped

    def _apply_pending_swap(self) -> None:
        """The loaded version replaces the serving one's weights in place; all draft KV is let go."""
        with self._swap_lock:
            pending, self._pending_swap = self._pending_swap, None
        if pending is None:
            return
        version, path, source, state = pending
        # Its prefix cache is salted with the version: no block of other weights is found.
        self.scheduler.load_weights(state, cache_salt=f"{path}@draft-v{version}")
        self.draft_version, self.draft_path, self.draft_source = version, path, source
        self.version_metrics.set_version(self.draft_version)

    async def ping(self) -> bool:
        """Health check; with online training on, also tell the app's trainer this engine's
        version every few seconds, so a new replica is given the current one."""
        if self.trainer_name and time.monotonic() - self._registered_at > REGISTER_INTERVAL_S:
            self._registered_at = time.monotonic()
            try:
                trainer = ray.get_actor(self.trainer_name, namespace=ENGINE_NAMESPACE)
                trainer.register_engine.remote(self.name, ray.get_runtime_context().current_actor,
                                               self.draft_version, self.draft_path)
            except Exception:  # no trainer (yet, or it died): serving goes on untouched
                pass
        return await super().ping()

    async def prefill(self, seq_id: str, history: HistoryUpdate) -> UnknownHistory | None:
        """Warm the draft's cache with the prompt while the target prefills it."""
        committed = self.committed(seq_id, history)
        if isinstance(committed, UnknownHistory):
            return committed
        await self.submit(DraftCall(seq_id, committed, 0))
        return None

    async def propose(self, seq_id: str, history: HistoryUpdate, num_tokens: int, params: SamplingParams,
                      seed: int | None, prompt_len: int | None = None, fan_out: Sequence[int] = (),
                      features=None, predraft_tokens: int = 0
                      ) -> tuple[Proposal, CallSpan] | UnknownHistory | UnknownFeatures:
        """Up to num_tokens draft tokens continuing the committed history (its update since this
        engine's last call for seq_id, deployments.committed_history), its first prompt_len tokens
        the prompt; and the span it spent in this engine. UnknownHistory when this engine does not
        hold the history the update continues: the caller sends all of it again.

        This is the one place a round's block is found in the speculation cache or drafted: the
        block pre-drafted for the history the round now has is answered at once (a hit,
        Proposal.cached), else one is drafted just in time; the other pre-drafts are dropped.
        sum(fan_out): blocks to pre-draft, once this one is answered, for its likely outcomes
        (shared out by policies.fan_out.share_fan_out from the draft's own numbers; empty: none),
        each max(num_tokens, predraft_tokens) tokens deep: a round may draft deeper than the one
        before it, and a pre-drafted block is used cut to its round's depth, never lengthened.
        features: an EAGLE-3 head's, the target's features of the positions committed since the
        last propose (decoding.target_features.TargetFeatures); UnknownFeatures answers when the head
        lacks some it needs."""
        if features is not None:
            self.proposer.observe(seq_id, features)
        committed = self.committed(seq_id, history)
        if isinstance(committed, UnknownHistory):
            self._drop_predrafts(seq_id)
            self.verifying.pop(seq_id, None)   # its outcome will not be seen
            return committed
        if num_tokens > 0 and reads_target_features(self.proposer):
            missing = self.proposer.missing_features(seq_id, committed)
            if missing is not None:
                return UnknownFeatures(seq_id, missing)
        entered_s = time.perf_counter()
        num_candidates = max(sum(fan_out) + 1, MAX_BONUS_GUESSES) if any(fan_out) and self.predrafts else 0
        proposal, thrown_away = await self._take_predraft(seq_id, committed, num_tokens)
        if proposal is not None:
            span = CallSpan(entered_s, time.perf_counter(), time.perf_counter())
        else:
            proposal, span = await self.submit(DraftCall(seq_id, committed, num_tokens, params, seed, prompt_len,
                                                         num_candidates))
        self.call_log.record("propose", seq_id, span)
        if num_candidates and proposal.token_ids:
            self._start_predrafts(seq_id, committed, proposal, fan_out, DraftCall(
                seq_id, (), max(num_tokens, predraft_tokens), params, None, prompt_len, num_candidates,
                fork_of=seq_id))
        return replace(proposal, candidates=None, odds=None, stream_states=None,
                       predrafted_thrown_away=thrown_away), span

    async def _take_predraft(self, seq_id: str, history: list[int], num_tokens: int) -> tuple[Proposal | None, int]:
        """(the block pre-drafted for history, cut to num_tokens, or None; pre-drafted tokens thrown
        away). The pre-draft that may continue history is waited for if still drafting; every other
        one is dropped at once, so it stops taking draft forwards."""
        branches = self.speculation.pop(seq_id, [])
        maybes = [branch for branch in branches if may_continue(branch.predraft, history)]
        thrown_away = self._drop(branch for branch in branches if branch not in maybes)
        maybe = drafted = None
        for branch in maybes:   # several bonus guesses may: the one whose guess came true
            try:
                await branch.answer
            except Exception:   # released, overloaded or failed: drafting now is the fallback
                pass
            if maybe is None and branch.drafted() is not None and continues(branch.predraft, branch.drafted(), history):
                maybe, drafted = branch, branch.drafted()
        thrown_away += self._drop(branch for branch in maybes if branch is not maybe)
        self._learn_outcome(seq_id, history, maybes)
        if maybe is None:
            return None, thrown_away
        if len(drafted.token_ids) - maybe.predraft.guesses_next < num_tokens:
            return None, thrown_away + self._drop([maybe])
        used = replace(block_of(maybe.predraft, drafted, num_tokens), cached=True)
        await self.loop.between_iterations()
        try:
            self.released.check(seq_id)   # released while it waited: no KV may be adopted for it
        except Exception:
            self._drop([maybe])
            raise
        # its KV (a head's: its block) holds history and the block: the next pre-drafts fork it
        if self.runner is None:
            self.proposer.adopt(seq_id, maybe.seq_id)
        else:
            self.scheduler.blocks.adopt(seq_id, maybe.seq_id)
        if drafted.stream_states:   # the request's stream goes on from where drafting this block now would leave it
            self.generators[seq_id].set_state(drafted.stream_states[num_tokens - 1])
        self.generators.pop(maybe.seq_id, None)
        self.idle.forget(maybe.seq_id)
        if getattr(self.proposer, "grammars", None) is not None:
            self.proposer.grammars.release(maybe.seq_id)
        return used, thrown_away + tokens_thrown_away(maybe.predraft, drafted, used)

    def _start_predrafts(self, seq_id: str, history: list[int], proposal: Proposal, fan_out: Sequence[int],
                         like: DraftCall) -> None:
        """Queue the pre-drafts of proposal's likely outcomes (decoding.speculation_cache.predrafts)
        as calls of their own, forked from seq_id's KV: they batch with each other and with other
        requests' calls. A sampled pre-draft draws with a copy of the request's draft stream as it
        is now (`branch_stream_state`), and a bonus pre-draft's guess is drawn with no randomness:
        the block used is the very block drafting just in time would draw, so a round's output is
        the same whether it hits or not, and exact as plain rounds are."""
        if seq_id in self.released:
            # Released while its block was drafted: its forget has run, so nothing would ever drop
            # these branches, and a fork of a sequence no longer held prefills a sequence of its own.
            return
        stream = self.generators.get(seq_id)
        state = None if stream is None or like.params.is_greedy else branch_stream_state(stream)
        branches = []
        picks = share_fan_out(proposal.token_ids, proposal.candidates or [], proposal.odds or [], sum(fan_out),
                              self.calibration[like.params.is_greedy])
        self.verifying[seq_id] = (len(history), proposal, like.params.is_greedy)
        for predraft in predrafts(history, proposal.token_ids, picks):
            self._branch_count += 1
            call = replace(like, seq_id=f"{seq_id}#predraft{self._branch_count}", history=list(predraft.history),
                           num_tokens=like.num_tokens + predraft.guesses_next, stream_state=state,
                           guess_rank=predraft.guess_rank)
            answer = asyncio.ensure_future(self._submit_predraft(seq_id, call))
            answer.add_done_callback(observed)
            branches.append(_Branch(call.seq_id, predraft, answer))
        self.speculation[seq_id] = branches

    def _learn_outcome(self, seq_id: str, history: list[int], bonus_branches: Sequence[_Branch]) -> None:
        """The last pre-drafting round's outcome, now in history: what its block's numbers meant
        (bonus_branches: its bonus pre-drafts, answered, whose guesses say the bonus token's rank)."""
        verified = self.verifying.pop(seq_id, None)
        if verified is None or verified[1].odds is None:
            return
        length, proposal, greedy = verified
        guesses: dict[int, int | None] = {}
        for branch in bonus_branches:
            if branch.predraft.guess_rank is not None:
                drafted = branch.drafted()
                guesses[branch.predraft.guess_rank] = drafted.token_ids[0] if drafted and drafted.token_ids else None
        ranked = [guesses.get(rank) for rank in range(max(guesses, default=-1) + 1)]
        self.calibration[greedy].observe(proposal.token_ids, proposal.candidates or [], proposal.odds,
                                         history[length:], ranked)

    async def _submit_predraft(self, seq_id: str, call: DraftCall) -> tuple[Proposal | None, CallSpan]:
        """Queue a pre-draft, unless it was dropped before its task started (its request released,
        or its outcome known): queued then, it would take KV nobody frees."""
        if not any(branch.seq_id == call.seq_id for branch in self.speculation.get(seq_id, ())):
            raise SequenceReleasedError(f"pre-draft {call.seq_id!r} dropped")
        return await self.submit(call)

    def _drop(self, branches) -> int:
        """Let go of pre-drafts not used: queued calls dropped, KV freed between forwards. -> the
        pre-drafted tokens thrown away (of those already drafted)."""
        thrown_away = 0
        for branch in branches:
            thrown_away += tokens_thrown_away(branch.predraft, branch.drafted(), None)
            self.loop.release(branch.seq_id)
        return thrown_away

    def _drop_predrafts(self, seq_id: str) -> None:
        self._drop(self.speculation.pop(seq_id, []))

    def forget(self, seq_id: str) -> None:
        super().forget(seq_id)
        self.drafting.pop(seq_id, None)
        self.verifying.pop(seq_id, None)
        self._drop_predrafts(seq_id)
        self.generators.pop(seq_id, None)
        if self.runner is not None:
            self.proposer.grammars.release(seq_id)
        else:   # a model-free proposer's own state (an EAGLE-3 head's entries)
            self.proposer.release(seq_id)

    def shape(self, call: DraftCall) -> CallShape:
        return CallShape(call.seq_id, self._tokens(call))

    def _tokens(self, call: DraftCall) -> Sequence[int]:
        """The history call's next forward runs over: with the tokens drafted so far, mid-block."""
        drafting = self.drafting.get(call.seq_id)
        return call.history if drafting is None else drafting.history

    def run(self, calls: list[DraftCall], schedule: Schedule) -> StepOutput:
        """Prefill what the cache lacks (prompts, or a replica's first sight of a request), then one
        batched decode step for every call drafting a block; a block finished is answered, the
        others stay queued for the next iteration, which new calls join."""
        output = StepOutput()
        if self.runner is not None:  # a block past the draft's context: none
            for index, call in enumerate(calls):
                if (call.seq_id not in self.drafting
                        and len(call.history) + max(call.num_tokens - 1, 0) > self.runner.max_context):
                    output.results[index] = None if call.num_tokens == 0 else empty_proposal()
        runnable = self._prefill(calls, schedule, output) + schedule.plan.steps
        to_draft = []
        for index in runnable:
            if calls[index].num_tokens == 0:
                output.results.setdefault(index, None)
            elif index not in output.results:
                to_draft.append(index)
        if not to_draft:
            return output
        if self.runner is None:   # a model-free proposer: every block at once
            proposals = self.proposer.propose_batch([self._propose_call(calls[index]) for index in to_draft])
            output.results.update((index, self._to_wire(proposal)) for index, proposal in zip(to_draft, proposals))
            return output
        drafts = {index: self.drafting.get(calls[index].seq_id) or self.proposer.start(self._propose_call(calls[index]))
                  for index in to_draft}
        stepping = [draft for draft in drafts.values() if not draft.done]
        if stepping:
            started = time.perf_counter()
            self.proposer.step(stepping)
            output.costs.append((len(stepping), time.perf_counter() - started))   # one decode step
        for index, draft in drafts.items():
            if draft.done:
                self.drafting.pop(draft.call.seq_id, None)
                output.results[index] = self._to_wire(draft.proposal())
            else:
                self.drafting[draft.call.seq_id] = draft
        return output

    def _prefill(self, calls: list[DraftCall], schedule: Schedule, output: StepOutput) -> list[int]:
        """Run this iteration's prefill chunks in one forward; the calls whose cache is now complete."""
        if not schedule.plan.prefills:
            return []
        forward_calls, complete = [], []
        for index, chunk in schedule.plan.prefills:
            tokens = self._tokens(calls[index])
            end = schedule.calls[index].chunk_end(chunk)
            forward_calls.append(ForwardCall(calls[index].seq_id, tokens if end is None else tokens[:end], 1,
                                             over_map=True))   # its logits are not read
            if end is None:
                complete.append(index)
        _, cost = timed_forward(self.scheduler, forward_calls)
        output.costs.append(cost)
        return complete

    def _propose_call(self, call: DraftCall) -> ProposeCall:
        """The proposer's call. A sampled draft draws from its Saguaro-lowered row on rounds that
        pre-draft (docs/speculation-cache.md), where it puts the residual on the blocks pre-drafted;
        elsewhere it would cost acceptance for nothing. A seeded request's rows are always lowered:
        its output must not depend on whether load let a round pre-draft."""
        generator = self.generators.get(call.seq_id)
        if generator is None:
            # A model-free proposer: where its head runs, if it has one.
            device = self.runner.device if self.runner is not None else getattr(self.proposer, "device",
                                                                                 torch.device("cpu"))
            generator = self.generators[call.seq_id] = make_generator(call.seed, device)
            if call.stream_state is not None:
                generator.set_state(call.stream_state)
        return ProposeCall(call.seq_id, call.history, call.num_tokens, call.params, generator, call.prompt_len,
                           call.num_candidates, call.guess_rank, keep_stream_states=call.stream_state is not None,
                           lowered=call.seed is not None or call.num_candidates > 0)

    def _to_wire(self, proposal: Proposal) -> Proposal:
        return replace(proposal, support=None if proposal.support is None else proposal.support.wire(),
                       draft_version=self.draft_version)


def branch_stream_state(stream: torch.Generator) -> torch.Tensor:
    """Where a sampled pre-draft's stream starts: the request's draft stream as it is now, whose
    next uniforms no block has used yet. Restarting the stream from its seed instead would replay
    the uniforms earlier blocks were drawn with, which the verification has seen: biased
    (tests/test_predrafting.py)."""
    return stream.get_state()
