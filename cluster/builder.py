"""Config -> bound Ray Serve application, and config -> Serve config YAML (`serve deploy`).

The YAML points Serve at ``specserve.cluster.builder:app_builder`` with the whole config as ``args``, so
``serve run``/``serve deploy`` and ``specserve serve`` build the very same graph.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
import yaml
from ray.serve import Application

from specserve.common.config import SpecServeConfig, WorkerResources
from specserve.decoding.host_memory import ENGINE_ENV
from specserve.deployments.engine_host import REPLICA_CPUS, DraftWorker, TargetWorker, engine_bundles
from specserve.deployments.ingress import Ingress
from specserve.deployments.prefix_router import ROUTER_CLASS_PATH as PREFIX_ROUTER_CLASS_PATH
from specserve.deployments.router import Router
from specserve.policies.decision import PolicySettings

APP_NAME = "specserve"
IMPORT_PATH = "specserve.cluster.builder:app_builder"


POOL_POLICY = "specserve.policies.autoscaling:PoolPolicy"
ROUTING_STATS_PERIOD_S = 2.0  # how often Serve reads a target replica's engine load for routing
# A replica Serve stops (scale-down, redeploy, shutdown) sleeps this long, then looks for requests
# still running and sleeps again while there are: it is the poll of the drain, not a grace (the
# grace is graceful_shutdown_timeout_s). Serve's default of 2 s makes every stop of an idle app
# seconds longer; requests in flight are waited for just the same.
SHUTDOWN_DRAIN_POLL_S = 0.25


def _replica_options(resources: WorkerResources, policy: dict[str, Any] | None = None) -> dict[str, Any]:
    """num_replicas for a fixed pool; Serve's autoscaling_config (with our policy) for a ranged one."""
    drain = {"graceful_shutdown_wait_loop_s": SHUTDOWN_DRAIN_POLL_S}
    if not resources.autoscaling:
        return {"num_replicas": resources.initial_replicas, **drain}
    low, high = resources.replica_bounds
    autoscaling: dict[str, Any] = {"min_replicas": low, "max_replicas": high,
                                   "initial_replicas": resources.initial_replicas,
                                   "upscale_delay_s": resources.upscale_delay_s,
                                   "downscale_delay_s": resources.downscale_delay_s}
    if policy is not None:
        autoscaling["policy"] = policy
    return {"autoscaling_config": autoscaling, **drain}


def _pool_policy(pool: str, config: SpecServeConfig) -> dict[str, Any]:
    """The policy actor's decision drives the pool; its settings let the controller create it."""
    settings = json.loads(json.dumps(PolicySettings.from_config(config).to_dict()))  # tuples -> lists
    return {"policy_function": POOL_POLICY, "policy_kwargs": {"pool": pool, "settings": settings}}


def _worker_options(name: str, resources: WorkerResources, policy: dict[str, Any] | None = None) -> dict[str, Any]:
    """Worker replicas are light; their engine actor carries the CPUs/GPUs in bundle 1 (a
    tensor-parallel engine's ranks in bundles 1..N, packed on one node)."""
    return {
        "name": name,
        **_replica_options(resources, policy),
        "max_ongoing_requests": resources.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": REPLICA_CPUS},
        "placement_group_bundles": engine_bundles(resources.num_cpus, resources.num_gpus, resources.resources,
                                                  resources.tensor_parallel_size),
        "placement_group_strategy": "STRICT_PACK",
        # A dead engine fails its replica's health check; find out fast so Serve replaces it.
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 10.0,
    }


def _plain_options(name: str, resources: WorkerResources) -> dict[str, Any]:
    actor_options: dict[str, Any] = {"num_cpus": resources.num_cpus}
    if resources.num_gpus:
        actor_options["num_gpus"] = resources.num_gpus
    # A ranged ingress/router pool uses Serve's default, request-based policy.
    return {"name": name, **_replica_options(resources),
            "max_ongoing_requests": resources.max_ongoing_requests, "ray_actor_options": actor_options}


def logical_cpus_needed(config: SpecServeConfig) -> int:
    """Ray's CPU accounting is logical: reserve what the deployments ask for at their max replicas
    (an autoscaled pool must find room to grow on a single machine), at least the cores."""
    needed = sum(d.replica_bounds[1] * d.num_cpus for d in (config.ingress, config.router))
    for workers in (config.target_workers, config.draft_workers):
        needed += workers.replica_bounds[1] * (workers.num_cpus * workers.tensor_parallel_size + 0.02)
    if config.draft_training.enabled:
        needed += config.draft_training.num_cpus
    return max(os.cpu_count() or 1, math.ceil(needed) + 1)


def custom_resources_needed(config: SpecServeConfig) -> dict[str, float]:
    """Custom Ray resources the worker engines ask for at max replicas (one node offers them all)."""
    needed: dict[str, float] = {}
    for workers in (config.target_workers, config.draft_workers):
        for name, amount in workers.resources.items():
            needed[name] = needed.get(name, 0.0) + amount * workers.replica_bounds[1] * workers.tensor_parallel_size
    if config.draft_training.enabled:
        for name, amount in config.draft_training.resources.items():
            needed[name] = needed.get(name, 0.0) + amount
    return needed


def deployment_options(config: SpecServeConfig) -> dict[str, dict[str, Any]]:
    """Per-deployment Serve options, by deployment name."""
    options = {
        "Ingress": _plain_options("Ingress", config.ingress),
        "Router": _plain_options("Router", config.router),
        "TargetWorker": {**_worker_options("TargetWorker", config.target_workers, _pool_policy("target", config)),
                         # a request's target replica is the one likely to hold its prompt's prefix
                         "request_router_config": {"request_router_class": PREFIX_ROUTER_CLASS_PATH,
                                                   "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}},
    }
    if config.uses_draft_workers:
        options["DraftWorker"] = _worker_options("DraftWorker", config.draft_workers, _pool_policy("draft", config))
    return options


def served_model_specs(config: SpecServeConfig) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(target spec, draft spec) as the engines receive them: the configured ModelSpec plus what
    the pair decides, read from the checkpoint folders before anything starts: the ids served
    (the tokenizer's, checked against the draft: IncompatibleModelsError here, at start, names
    the difference), the EOS set, max_model_len and the tokenizer's path (the engines build
    structured outputs' grammar masks over it)."""
    from transformers import AutoTokenizer

    from specserve.decoding.checkpoint import context_length, eos_token_ids, max_model_len
    from specserve.decoding.model_runner import check_compatible_paths, output_width, served_vocab_size

    tokenizer_path = config.resolved_tokenizer_path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    if config.speculation.needs_draft_model and config.draft is not None:
        vocab_size = check_compatible_paths(config.draft.path, config.target.path, tokenizer_path)
    else:
        vocab_size = served_vocab_size(tokenizer, output_width(config.target.path))
    target_len = max_model_len(config.target.path, config.target.max_model_len)
    engine = config.engine_options()
    served = {"vocab_size": vocab_size, "eos_token_ids": sorted(eos_token_ids(config.target.path, tokenizer)),
              "max_model_len": target_len, "tokenizer_path": str(tokenizer_path),
              # The largest forwards the engine's scheduler plans: profiled on a GPU before sizing the KV cache.
              "profile_batches": [[engine["max_batch_rows"], engine["max_step_tokens"]],
                                  [1, engine["prefill_token_budget"]]],
              # The deepest a step rolls back (its speculative tail): windowed layers keep the keys for it.
              "rollback_tokens": engine["max_step_tokens"]}
    target = {**config.target.model_dump(), **served, "gpu_share": gpu_share(config.target_workers.num_gpus),
              "tensor_parallel_timeout_s": config.target_workers.tensor_parallel_timeout_s, "token_map": None}
    if config.speculation.proposer == "eagle3" and config.draft is not None:
        return head_specs(config, target)
    draft = None
    if config.draft is not None and config.speculation.needs_draft_model:
        draft = {**config.draft.model_dump(), **served, "gpu_share": gpu_share(config.draft_workers.num_gpus),
                 "max_model_len": min(target_len, context_length(config.draft.path)),
                 "tensor_parallel_timeout_s": config.draft_workers.tensor_parallel_timeout_s,
                 "token_map": config.draft_token_map}
    return target, draft


def head_specs(config: SpecServeConfig, target: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(target spec, head spec) for an EAGLE-3 head: the head is loaded here against the target's
    embeddings, so a head that does not fit the target (Eagle3CheckpointError, naming why) stops
    the start before any engine does; the target computes the head's aux layers' features, and
    the draft engine reads the target's embeddings from target_path."""
    head = checked_head(config)
    draft = {**config.draft.model_dump(), "target_path": config.target.path, "token_map": None}
    return {**target, "aux_layers": list(head.aux_layers)}, draft


def checked_head(config: SpecServeConfig):
    """The configured EAGLE-3 head loaded against the target's embeddings on the meta device
    (decoding.eagle3_checkpoint.LoadedHead: its layers and format; its weights hold no values):
    every check of the head against the target runs, and none of the target's weights is read,
    only its config and the embedding matrix's shape. Eagle3CheckpointError, naming why, for a
    head this target cannot use."""
    from specserve.decoding.eagle3_checkpoint import load_eagle3_head, target_embeddings

    return load_eagle3_head(config.draft.path, target_embeddings(config.target.path, torch.float32, "meta"))


def gpu_share(num_gpus: float) -> float:
    """The share of one device an engine's gpu_memory_utilization applies to: Ray's fractional
    num_gpus (two engines at 0.5 share one GPU); a whole GPU or more is the whole device."""
    return num_gpus if 0 < num_gpus < 1 else 1.0


def build_app(config: SpecServeConfig) -> Application:
    """The bound application: Ingress -> Router -> (TargetWorker, DraftWorker)."""
    options = deployment_options(config)
    config_dict = config.model_dump(mode="json")
    target_spec, draft_spec = served_model_specs(config)
    engine_options = config.engine_options()
    targets = TargetWorker.options(**options["TargetWorker"]).bind(
        config.target_workers.model_dump(), target_spec, engine_options)
    drafts = None
    if config.uses_draft_workers:
        drafts = DraftWorker.options(**options["DraftWorker"]).bind(
            config.draft_workers.model_dump(), config.speculation.proposer, draft_spec, config.target.path,
            engine_options)
    router = Router.options(**options["Router"]).bind(config_dict, targets, drafts)
    return Ingress.options(**options["Ingress"]).bind(config_dict, router)


def app_builder(args: dict[str, Any]) -> Application:
    """Entry point for `serve run` / `serve deploy`: args is the specserve config as a mapping."""
    return build_app(SpecServeConfig.model_validate(args or {}))


def serve_config(config: SpecServeConfig) -> dict[str, Any]:
    """A Serve config (ServeDeploySchema) that deploys this config's application."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": config.http.host, "port": config.http.port},
        "applications": [{
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": IMPORT_PATH,
            "args": config.model_dump(mode="json"),
            "deployments": list(deployment_options(config).values()),
        }],
    }


def serve_config_yaml(config: SpecServeConfig) -> str:
    """serve_config as YAML, validated with Ray's own ServeDeploySchema before it is returned."""
    from ray.serve.schema import ServeDeploySchema

    document = serve_config(config)
    ServeDeploySchema.model_validate(document)
    header = ("# Generated by `specserve serve-config`; deploy with `serve deploy` or `serve run`.\n"
              "# Ray must offer the logical CPUs the deployments ask for, whatever the machine's core count:\n"
              f"#   ray start --head --num-cpus {logical_cpus_needed(config)} && serve run THIS_FILE\n"
              "# CPU engines keep the host memory they free with glibc's malloc set where `ray start` runs\n"
              "# (docs/performance.md, \"Host memory kept (CPU)\"):\n"
              f"#   export {' '.join(f'{name}={value}' for name, value in ENGINE_ENV.items())}\n")
    return header + yaml.safe_dump(document, sort_keys=False)
