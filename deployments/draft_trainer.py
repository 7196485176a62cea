"""The draft trainer actor: one per application when draft_training.enabled (docs/online-learning.md).

Routers push captured blocks and per-version acceptance counts to it, fire-and-forget: a round
never waits for it. When the policy actor reports slack (spare capacity: policies/slack.py) it
runs a training pass (training/online_trainer.py) in a worker thread, polling the load every
quarter second and stopping within one optimizer step once the slack ends (with
slack_max_active_requests 0, any pushed block ends it); a trainer with a GPU of its own trains
beside serving. An accepted
candidate is on the trainer's disk (or a configured shared versions_dir) before every draft engine
is told to load it; without a shared versions_dir its weights travel through Ray's object store, so
draft engines on other nodes load what only this node can read. An engine that fails to load keeps
serving its weights and is offered the version again, backing off (LoadBackoff). After a swap
the trainer watches live acceptance and swaps back a version that does worse than its predecessor.

Nothing on the data path depends on this actor: it is detached like the policy actor, created by
the first router that needs it, and if it dies routers' pushes fail silently and the engines keep
the draft they serve. Being detached, it outlives a redeploy: every lookup hands it the caller's
config (`configure`), and a trainer whose draft or training settings a redeploy changed exits, so
the next push starts one for the new config (its CPUs and GPUs are the actor's own and cannot
change in place; an old trainer would offer versions of the old draft).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import ray
import torch

from specserve.common.config import SpecServeConfig
from specserve.decoding.capture import CapturedBlock, save_blocks
from specserve.decoding.checkpoint import checkpoint_dtype
from specserve.decoding.model_runner import checkpoint_weights
from specserve.common.naming import ENGINE_NAMESPACE, draft_trainer_name, policy_actor_name
from specserve.policies.slack import has_own_device
from specserve.training.online_distill import this_process_training_device
from specserve.training.online_trainer import OnlineTrainer

LOOP_INTERVAL_S = 0.5      # how often the trainer looks for slack, captures and rollbacks
FIRST_RETRY_S = 5.0        # a version an engine failed to load is offered again after this, doubling ...
MAX_RETRY_S = 600.0        # ... up to this
LOAD_POLL_S = 0.25         # how often a running pass checks that the slack lasts
CAPTURE_SHARD_BLOCKS = 256  # blocks per persisted shard (only with draft_training.capture_dir)

logger = logging.getLogger(__name__)


@dataclass
class FailedLoad:
    """An engine that failed to load a version: when it may be offered again, and why it failed."""

    version: int
    error: str
    failures: int
    retry_at: float


class LoadBackoff:
    """Offers of a version an engine failed to load back off exponentially (FIRST_RETRY_S, doubling
    to MAX_RETRY_S), instead of one failed load every registration, forever (a GPU without room
    for a second copy of the draft fails every time). Failures show in `specserve status`."""

    def __init__(self) -> None:
        self.failed: dict[str, FailedLoad] = {}

    def may_offer(self, engine: str, version: int, now: float) -> bool:
        failed = self.failed.get(engine)
        return failed is None or failed.version != version or now >= failed.retry_at

    def failure(self, engine: str, version: int, error: str, now: float) -> FailedLoad:
        previous = self.failed.get(engine)
        failures = previous.failures + 1 if previous is not None and previous.version == version else 1
        delay = min(MAX_RETRY_S, FIRST_RETRY_S * 2 ** (failures - 1))
        self.failed[engine] = FailedLoad(version, error[:300], failures, now + delay)
        return self.failed[engine]

    def success(self, engine: str) -> None:
        self.failed.pop(engine, None)

    def status(self) -> dict[str, dict[str, Any]]:
        return {engine: asdict(failed) for engine, failed in self.failed.items()}


class DraftTrainer:
    """push / register_engine in; status out; the training loop runs in the background."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = SpecServeConfig.model_validate(config)
        spec = self.config.draft_training
        torch.set_num_threads(max(1, int(spec.num_cpus)))
        versions_dir = spec.versions_dir or tempfile.mkdtemp(prefix="specserve-draft-versions-")
        self.core = OnlineTrainer(self.config.draft.path, spec.model_dump(), versions_dir,
                                  this_process_training_device(spec.num_gpus))
        self.engines: dict[str, Any] = {}          # engine name -> actor handle
        self.engine_versions: dict[str, int] = {}  # what each engine last said it serves
        self._unsaved: list[CapturedBlock] = []
        self._shards = 0
        self._stop = threading.Event()
        self._training = False
        self._loop_task: asyncio.Task | None = None
        self.started_at = time.time()
        self.backoff = LoadBackoff()
        self._weights: dict[int, ray.ObjectRef] = {}   # version -> its weights in the object store
        self._putting = asyncio.Lock()

    async def configure(self, config: dict[str, Any]) -> bool:
        """A config from a lookup: the same for this trainer (-> False), or a redeploy changed what
        it trains or runs on, and it exits (a running pass dies with it) so the next lookup starts
        a trainer for the new config."""
        if trainer_settings(SpecServeConfig.model_validate(config)) == trainer_settings(self.config):
            return False
        logger.warning("draft trainer %s: a redeploy changed the draft or its training; exiting so that a "
                       "trainer for the new config takes over", draft_trainer_name(self.config.model_name))
        self._stop.set()
        ray.actor.exit_actor()
        return True  # not reached: exit_actor ends the actor

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    async def push(self, blocks: Sequence[CapturedBlock],
                   live_counts: Mapping[int, tuple[Sequence[int], Sequence[int]]]) -> None:
        """Captured blocks and per-position (drafted, accepted) counts per draft version since the router's last push."""
        self._ensure_loop()
        spec = self.config.draft_training
        if spec.slack_max_active_requests == 0 and not has_own_device(spec.num_gpus):
            self._stop.set()  # idle-only training: a block is a request in flight, yield at once
        self.core.add(blocks)
        self.core.record_live(live_counts)
        if self.config.draft_training.capture_dir is not None:
            self._unsaved.extend(blocks)
            if len(self._unsaved) >= CAPTURE_SHARD_BLOCKS:
                self.flush_captures()

    def flush_captures(self) -> int:
        """Write captured blocks not yet persisted (only with capture_dir); -> blocks written."""
        blocks, self._unsaved = self._unsaved, []
        if blocks and self.config.draft_training.capture_dir is not None:
            save_blocks(blocks, self.config.draft_training.capture_dir,
                        f"capture-{int(self.started_at)}-{self._shards:06d}")
            self._shards += 1
        return len(blocks)

    async def register_engine(self, name: str, engine: Any, version: int, path: str) -> None:
        """A draft engine says which version it serves; one behind is offered the serving version.
        A version this trainer does not know (it was restarted) is adopted, not undone."""
        self._ensure_loop()
        self.engines[name] = engine
        self.engine_versions[name] = version
        self.core.adopt(version, path)
        if version != self.core.serving.version and self.backoff.may_offer(name, self.core.serving.version,
                                                                            time.monotonic()):
            await self._offer_one(name, engine, self.core.serving)

    async def status(self) -> dict[str, Any]:
        self._ensure_loop()
        return {**self.core.status(), "training_now": self.training_now(),
                "engines": dict(self.engine_versions), "failed_loads": self.backoff.status()}

    def training_now(self) -> bool:
        return self._training

    async def _loop(self) -> None:
        while True:
            try:
                await self._step()
            except Exception:  # a failed pass or offer is logged; serving is untouched
                logger.exception("draft trainer step failed")
            await asyncio.sleep(LOOP_INTERVAL_S)

    async def _step(self) -> None:
        back = self.core.rollback_to()
        if back is not None:
            logger.warning("draft version %d does worse live than its predecessor; back to %d",
                           self.core.serving.version, back.version)
            await self._offer_all(self.core.swap_to(back.version))
        if self.core.ready() and await self._slack():
            await self._train()

    async def _slack(self) -> bool:
        spec = self.config.draft_training
        if has_own_device(spec.num_gpus):
            return True   # it takes nothing the engines use: it trains beside serving
        try:
            policy = ray.get_actor(policy_actor_name(self.config.model_name), namespace="specserve")
            return await policy.slack.remote(spec.slack_max_active_requests, spec.slack_max_busy_share)
        except Exception:  # no policy actor: no view of the load, so no training
            return False

    async def _train(self) -> None:
        self.flush_captures()  # what a pass trains on is on disk first, when persistence is asked for
        self._stop.clear()
        self._training = True
        watcher = asyncio.get_running_loop().create_task(self._watch_load())
        try:
            result = await asyncio.to_thread(self.core.train_pass, self._stop.is_set)
        finally:
            watcher.cancel()
            self._training = False
        logger.info("draft training pass: %s", {k: v for k, v in result.items() if k != "steps"})
        if result["outcome"] == "accepted":
            await self._offer_all(self.core.swap_to(result["version"]))

    async def _watch_load(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(LOAD_POLL_S)
            if not await self._slack():
                self._stop.set()

    async def _weights_of(self, version) -> "ray.ObjectRef | None":
        """What engines load `version` from besides its path: its weights in Ray's object store
        (put once, held while the version is kept), so engines on any node load what only this
        trainer's node can read; None where every engine reads the path itself: a configured
        versions_dir (shared storage) or the draft the server started with (version 0)."""
        if self.config.draft_training.versions_dir is not None or version.version == 0:
            return None
        async with self._putting:   # one put per version, however many engines are offered it at once
            kept = {v.version for v in self.core.versions}
            for number in [n for n in self._weights if n not in kept]:
                del self._weights[number]   # pruned: its object goes once no engine holds it
            if version.version not in self._weights:
                self._weights[version.version] = await asyncio.to_thread(put_version, version.path)
            return self._weights[version.version]

    async def _offer_all(self, version) -> None:
        await asyncio.gather(*[self._offer_one(name, engine, version) for name, engine in list(self.engines.items())])

    async def _offer_one(self, name: str, engine: Any, version) -> None:
        try:
            await engine.load_draft.remote(version.version, version.path, await self._weights_of(version))
            self.engine_versions[name] = version.version
            self.backoff.success(name)
        except ray.exceptions.RayActorError:
            self.engines.pop(name, None)  # gone: a new replica registers itself
            self.engine_versions.pop(name, None)
        except Exception as exc:
            failed = self.backoff.failure(name, version.version, f"{type(exc).__name__}: {exc}", time.monotonic())
            logger.exception("draft engine %s could not load version %d (failure %d); it keeps its weights and is "
                             "offered it again in %.0f s", name, version.version, failed.failures,
                             failed.retry_at - time.monotonic())


def put_version(path: str) -> "ray.ObjectRef":
    """A version's weights (a state dict in its saved dtype) in Ray's object store."""
    return ray.put(checkpoint_weights(path, checkpoint_dtype(path)))


def trainer_settings(config: SpecServeConfig) -> dict[str, Any]:
    """What a trainer is built from: the draft it trains and its training settings."""
    return config.model_dump(mode="json", include={"model_name", "draft", "draft_training"})


def get_or_create_draft_trainer(config: SpecServeConfig) -> "ray.actor.ActorHandle":
    """The application's trainer (detached, named draft_trainer_name), created if missing; a
    running one is sent this config (`configure`, not waited for: routers call this on their
    round path) and exits if it was built from another (a redeploy), so that a later lookup
    creates the trainer of this config."""
    spec = config.draft_training
    options: dict[str, Any] = {"name": draft_trainer_name(config.model_name), "namespace": ENGINE_NAMESPACE,
                               "lifetime": "detached", "get_if_exists": True, "max_restarts": 0,
                               "max_concurrency": 64, "num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus}
    if spec.resources:
        options["resources"] = spec.resources
    trainer = ray.remote(DraftTrainer).options(**options).remote(config.model_dump(mode="json"))
    trainer.configure.remote(config.model_dump(mode="json"))
    return trainer
