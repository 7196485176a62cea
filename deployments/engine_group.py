"""A tensor-parallel engine as Ray actors: rank 0 is the engine itself (the actor the router
calls), ranks 1..N-1 are `RankFollower`s that replay its runner calls (decoding.tensor_parallel).

Placement: the worker replica's placement group holds [replica, rank 0, ..., rank N-1] bundles
(one GPU each on a GPU cluster) under STRICT_PACK, so the whole group sits on the replica's node
and meets at a store the replica serves there. One replica = one group for Serve, the policy
actor and autoscaling. The replica owns every rank: if it goes, they go; its health check pings
every rank, so a dead rank fails the replica and Serve replaces the whole group, while the router
re-prefills the group's requests elsewhere (a broken group's rank 0 ends its own process, which is
what the router recognises as a lost engine: deployments.request_engines).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import ray

from specserve.common.messages import RankStats
from specserve.decoding.batched_runner import load_runner
from specserve.decoding.tensor_parallel import GroupBrokenError, host_store

logger = logging.getLogger(__name__)


def group_store() -> tuple[Any, str]:
    """The group's meeting point, served by this process (the replica) on its node; -> (the store,
    to keep while the group lives, its address)."""
    return host_store(ray.util.get_node_ip_address())


def rank_spec(model_spec: dict, rank: int, size: int, store_address: str) -> dict:
    """The model spec rank `rank` loads: the engine's, plus its place in the group (and how long
    its collectives wait: the spec's tensor_parallel_timeout_s, common.config)."""
    member = {"rank": rank, "size": size, "store_address": store_address}
    if "tensor_parallel_timeout_s" in model_spec:
        member["timeout_s"] = model_spec["tensor_parallel_timeout_s"]
    return {**model_spec, "tensor_parallel": member}


def private_rss_bytes() -> int:
    """This process's own resident memory (Linux's RssAnon: its heap, weights and KV), without the
    pages of files it maps (a safetensors checkpoint read through mmap: page cache, shared by the
    ranks and given back under pressure). Elsewhere, the peak resident size."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_stats(runner: Any, rank: int, error: str | None = None) -> RankStats:
    """This process's RankStats (runner: the rank's BatchedModelRunner)."""
    from specserve.decoding.tensor_parallel import weight_bytes

    gpu_ids = tuple(str(gpu) for gpu in ray.get_gpu_ids()) if ray.is_initialized() else ()
    node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    return RankStats(rank, node_id, gpu_ids, weight_bytes(runner.model), runner.kv_capacity.tokens,
                     runner.kv_capacity.bytes_per_token, private_rss_bytes(), error)


def end_process(error: GroupBrokenError) -> None:
    """Rank 0's answer to a broken group: end the engine's process, so every caller sees a lost
    engine (and fails over) rather than an error on a group that can no longer serve."""
    logger.error("%s; ending this engine's process so the router fails over", error)
    os._exit(1)


class RankFollower:
    """A follower rank: loads its shards, then replays rank 0's runner calls in a thread until the
    group stops or breaks; `ping` (the replica's health check) fails once it has broken."""

    def __init__(self, model_spec: dict) -> None:
        self.follower = load_runner(model_spec)
        self.rank = model_spec["tensor_parallel"]["rank"]
        self.error: str | None = None
        self.thread = threading.Thread(target=self._follow, name=f"tp-rank-{self.rank}", daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        try:
            self.follower.follow()
            self.error = "the group was stopped"
        except BaseException as error:   # the group broke: say so at the next health check
            self.error = f"{type(error).__name__}: {error}"
            logger.error("tensor-parallel rank %d: %s", self.rank, self.error)

    def ping(self) -> bool:
        if self.error is not None:
            raise GroupBrokenError(f"rank {self.rank}: {self.error}")
        return True

    def stats(self) -> RankStats:
        return rank_stats(self.follower.runner, self.rank, self.error)
