"""Serve's request router for the target pool: a request's engine is chosen by its prompt's prefix.

The Router deployment asks the target pool for an engine once per request (`get_engine`, with the
prompt's affinity key as its argument); this class, Serve's extension point for that choice
(`RequestRouterConfig.request_router_class`), ranks the replicas with
policies.prefix_routing.rank_replicas. The load it balances is each replica's engine sequences,
which TargetWorker.record_routing_stats reports (Serve polls it); the replicas' own Serve queues
say nothing, since `get_engine` returns at once and the rounds go to the engine directly.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from specserve.policies.prefix_routing import rank_replicas

ROUTER_CLASS_PATH = "specserve.deployments.prefix_router.PrefixAffinityRouter"


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """The replicas ranked by the request's key (its first argument) and load, best first,
        each its own group: Serve tries them in that order."""
        key = pending_request.args[0] if pending_request is not None and pending_request.args else None
        by_id = {str(replica.replica_id): replica for replica in candidate_replicas}
        load = {replica_id: float((replica.routing_stats or {}).get("sequences", 0))
                for replica_id, replica in by_id.items()}
        return [[by_id[replica_id]] for replica_id in rank_replicas(list(by_id), key, load)]
