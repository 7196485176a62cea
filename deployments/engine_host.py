"""A worker deployment's replica owns one engine actor; the router talks to the engine directly.

Why two actors per replica: Serve gives us lifecycle, health checks, scaling and placement, but
a DeploymentHandle call costs several times a plain Ray actor call, and a Ray actor call costs
far more than a round's bytes on a socket (docs/transport.md), paid twice per speculative round.
So each worker replica spawns its engine (the model) inside the replica's own placement group
(bundle 1 carries the engine's CPUs/GPUs, so on a GPU cluster draft and target engines land on
distinct GPUs); the engine listens for channels (common.channel) on its node's address, and the
replica hands the engine's actor handle and that address (EngineEndpoint) to the router once per
request through Serve. The rounds then go over the router's channel to the engine. If the
replica dies, its engine dies with it (the replica owns it).

This module imports no engine code, and the replica none: it names its engine class by path, and
the engine's actor (deployments.engine_process.EngineProcess) imports it. An engine's imports
(torch, transformers, the runner) cost seconds of CPU, which a replica paying them too before it
could spawn its engine would add to every start, a failover's and an autoscaled replica's
included, on the cores the engines load on (docs/performance.md, "Start-up").
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray
from ray import serve
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specserve.common.messages import EngineEndpoint
from specserve.common.naming import ENGINE_NAMESPACE, current_replica_id, engine_actor_name, rank_actor_name
from specserve.deployments.engine_process import EngineProcess

ENGINE_BUNDLE_INDEX = 1
REPLICA_CPUS = 0.01  # the replica only relays the engine handle and health checks
RANK_FOLLOWER = "specserve.deployments.engine_group:RankFollower"


def engine_bundles(num_cpus: float, num_gpus: float, resources: dict[str, float] | None = None,
                   tensor_parallel_size: int = 1) -> list[dict[str, float]]:
    """Placement-group bundles for one worker replica: [replica, engine], or [replica, rank 0, ...,
    rank N-1] for a tensor-parallel engine (each rank gets the engine's resources)."""
    engine = {"CPU": num_cpus, "GPU": num_gpus, **(resources or {})}
    rank = {k: v for k, v in engine.items() if v > 0} or {"CPU": REPLICA_CPUS}
    return [{"CPU": REPLICA_CPUS}] + [dict(rank) for _ in range(tensor_parallel_size)]


def spawn_engine(engine_path: str, num_cpus: float, num_gpus: float, resources: dict[str, float],
                 name: str | None, *args: Any, bundle_index: int = ENGINE_BUNDLE_INDEX) -> "ray.actor.ActorHandle":
    """Start the engine class at engine_path as a Ray actor (an EngineProcess) in this replica's
    bundle_index bundle (or free-standing)."""
    placement_group = get_current_placement_group()
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": resources,
                               "max_restarts": 0, "max_concurrency": 1000}
    if name:
        options.update(name=name, namespace=ENGINE_NAMESPACE)
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index)
    return ray.remote(EngineProcess).options(**options).remote(engine_path, *args)


class EngineHost:
    """Base of the worker deployments: spawn the engine (a group of rank actors under tensor
    parallelism: deployments.engine_group), hand out its handle, check its health."""

    pool: str
    engine_path: str   # "module:Class" of the engine
    model_spec_arg: int   # where the model spec sits among the engine's arguments

    def __init__(self, resources: dict[str, Any], *engine_args: Any) -> None:
        """resources: a WorkerResources dump (num_cpus, num_gpus, resources, tensor_parallel_size)
        for the engine (for each rank of it)."""
        name = engine_actor_name(self.pool, current_replica_id())
        size = int(resources.get("tensor_parallel_size", 1))
        placement = (resources["num_cpus"], resources["num_gpus"], resources["resources"])
        self.followers: list[Any] = []
        if size > 1:
            engine_args, self.followers = self._spawn_followers(name, size, placement, list(engine_args))
        self.engine = spawn_engine(self.engine_path, *placement, name, *engine_args, name)
        started = time.monotonic()
        # Fail replica start-up if the model cannot load (on any rank: they load together).
        ray.get([self.engine.ping.remote()] + [follower.ping.remote() for follower in self.followers])
        if self.followers:
            ray.get(self.engine.set_followers.remote(self.followers))
        self.endpoint = EngineEndpoint(self.engine, ray.get(self.engine.open_channel.remote()))
        self.startup_s = time.monotonic() - started

    def _spawn_followers(self, name: str, size: int, placement: tuple, engine_args: list[Any]
                         ) -> tuple[list[Any], list[Any]]:
        """Ranks 1..size-1 in bundles 2..size; -> (rank 0's engine arguments, the followers).
        Imported here: a group's store is torch.distributed's, which a replica without one
        does not import."""
        from specserve.deployments.engine_group import group_store, rank_spec

        self._group_store, address = group_store()   # lives as long as this replica, and the group with it
        spec = engine_args[self.model_spec_arg]
        followers = [spawn_engine(RANK_FOLLOWER, *placement, rank_actor_name(name, rank),
                                  rank_spec(spec, rank, size, address), bundle_index=ENGINE_BUNDLE_INDEX + rank)
                     for rank in range(1, size)]
        engine_args[self.model_spec_arg] = rank_spec(spec, 0, size, address)
        return engine_args, followers

    async def get_engine(self, affinity_key: str | None = None) -> EngineEndpoint:
        """This replica's engine: its actor and its channel's address. affinity_key: what Serve's
        request router chose the replica by (the target pool's deployments.prefix_router); the
        replica itself has no use for it. A coroutine, so Serve answers it on the replica's event
        loop: a plain method would go through Serve's thread pool, a thread hop on every
        request's way to its first token."""
        return self.endpoint

    async def record_routing_stats(self) -> dict[str, Any]:
        """What Serve's request router balances on (it polls this): the engine's sequences."""
        return {"sequences": (await self.engine.stats.remote()).sequences}

    async def check_health(self) -> None:
        """Every rank answers, or the replica (the whole group) is replaced."""
        await asyncio.wait_for(asyncio.gather(self.engine.ping.remote(),
                                              *(follower.ping.remote() for follower in self.followers)), timeout=30)


@serve.deployment
class TargetWorker(EngineHost):
    pool = "target"
    engine_path = "specserve.deployments.target_worker:TargetEngine"
    model_spec_arg = 0


@serve.deployment
class DraftWorker(EngineHost):
    pool = "draft"
    engine_path = "specserve.deployments.draft_worker:DraftEngine"
    model_spec_arg = 1
