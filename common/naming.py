"""Names by which processes find the named actors: engines, their follower ranks, each
application's policy actor and draft trainer.

They are named Ray actors in specserve's namespace, so a process that joins the cluster
(``specserve status``, a router, a trainer) can find them without going through Serve; each name
format lives here only, for the actors that take a name and the tools that parse it.
"""

from __future__ import annotations

import os

from specserve.common.messages import POOLS, RAY_NAMESPACE

ENGINE_NAMESPACE = RAY_NAMESPACE
ENGINE_NAME_PREFIX = "engine"
RANK_NAME_PREFIX = "rank"
DRAFT_TRAINER_PREFIX = "draft-trainer:"
POLICY_ACTOR_PREFIX = "specserve-policy"


def engine_actor_name(pool: str, replica_id: str) -> str:
    """``engine:<pool>:<replica_id>``, e.g. ``engine:target:abc123``; unique while the replica lives."""
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    if not replica_id or ":" in replica_id:
        raise ValueError(f"replica_id must be non-empty and free of ':', got {replica_id!r}")
    return f"{ENGINE_NAME_PREFIX}:{pool}:{replica_id}"


def rank_actor_name(engine_name: str, rank: int) -> str:
    """``rank:<pool>:<replica_id>:<rank>``: a follower rank of a tensor-parallel engine (rank 0 is
    the engine itself); not an engine name, so tools listing engines pass it over."""
    return f"{RANK_NAME_PREFIX}:{engine_name.split(':', 1)[1]}:{rank}"


def parse_engine_actor_name(name: str) -> tuple[str, str] | None:
    """(pool, replica_id) of an engine actor's name; None for any other actor's name."""
    parts = name.split(":")
    if len(parts) != 3 or parts[0] != ENGINE_NAME_PREFIX or parts[1] not in POOLS or not parts[2]:
        return None
    return parts[1], parts[2]


def current_replica_id() -> str:
    """This Serve replica's unique id; outside a replica (tests, scripts) the process id, so
    labels and names still tell processes apart."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica: RayServeException, or Serve not started
        return f"pid{os.getpid()}"


def draft_trainer_name(model_name: str) -> str:
    """The draft trainer actor of the application serving model_name (one per application, in
    ENGINE_NAMESPACE, as its policy actor: two apps must not train each other's drafts)."""
    return f"{DRAFT_TRAINER_PREFIX}{model_name}"


def policy_actor_name(model_name: str) -> str:
    """The policy actor of the application serving model_name. One per application, not one per
    cluster: two specserve apps in one Ray cluster (two model pairs, or benchmark variants side
    by side) must not mix their pools' load reports nor read each other's decisions."""
    return f"{POLICY_ACTOR_PREFIX}:{model_name}"
