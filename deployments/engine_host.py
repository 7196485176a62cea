"""A worker deployment's replica owns one engine actor; the router talks to the engine directly.

Why two actors per replica: Serve gives us lifecycle, health checks, scaling and placement, but
a DeploymentHandle call costs ~3 ms, paid twice per speculative round. A plain Ray actor call
costs about half that. So each worker replica spawns its engine (the model) inside the replica's
own placement group (bundle 1 carries the engine's CPUs/GPUs, so on a GPU cluster draft and
target engines land on distinct GPUs), and hands the engine's actor handle to the router once
per request through Serve. If the replica dies, its engine dies with it (the replica owns it).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import ray
import torch
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

ENGINE_BUNDLE_INDEX = 1
REPLICA_CPUS = 0.01  # the replica only relays the engine handle and health checks


def engine_bundles(num_cpus: float, num_gpus: float,
                   resources: dict[str, float] | None = None) -> list[dict[str, float]]:
    """Placement-group bundles for one worker replica: [replica, engine]."""
    engine = {"CPU": num_cpus, "GPU": num_gpus, **(resources or {})}
    return [{"CPU": REPLICA_CPUS}, {k: v for k, v in engine.items() if v > 0} or {"CPU": REPLICA_CPUS}]


def spawn_engine(engine_class: type, num_cpus: float, num_gpus: float, resources: dict[str, float],
                 *args: Any) -> "ray.actor.ActorHandle":
    """Start engine_class as a Ray actor in this replica's engine bundle (or free-standing)."""
    placement_group = get_current_placement_group()
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": resources,
                               "max_restarts": 0}
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=ENGINE_BUNDLE_INDEX)
    return ray.remote(engine_class).options(**options).remote(*args)


def to_wire(rows: torch.Tensor) -> list[int] | np.ndarray:
    """Ids as a list, probability rows as a numpy array: a torch tensor costs ~0.25 ms to pickle
    and unpickle, paid every round; a list or an array costs a few microseconds."""
    if rows.dtype.is_floating_point:
        return rows.cpu().numpy()
    return rows.tolist()


class EngineHost:
    """Base of the worker deployments: spawn the engine, hand out its handle, check its health."""

    engine_class: type

    def __init__(self, resources: dict[str, Any], *engine_args: Any) -> None:
        """resources: a WorkerResources dump (num_cpus, num_gpus, resources) for the engine."""
        self.engine = spawn_engine(self.engine_class, resources["num_cpus"], resources["num_gpus"],
                                   resources["resources"], *engine_args)
        started = time.monotonic()
        ray.get(self.engine.ping.remote())  # fail replica start-up if the model cannot load
        self.startup_s = time.monotonic() - started

    def get_engine(self) -> "ray.actor.ActorHandle":
        return self.engine

    async def check_health(self) -> None:
        await self.engine.ping.remote()
