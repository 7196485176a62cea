"""Config -> KubeRay ``RayService`` manifest: a CPU head, a draft group, a target GPU group.

Every pod mounts the checkpoints' volume read-only at /models (a PersistentVolumeClaim, by default
``specserve-models``; point `target.path` / `draft.path` into it) and a memory-backed /dev/shm (Ray's
object store lives there; without it Ray falls back to disk). Each pool's pod memory is its
``node_memory_gb``.

Draft and target engines are pinned to their own worker groups with custom Ray resources
(``specserve_draft`` / ``specserve_target``), so each lands on its own node (a GPU node, or a
CPU node for a draft with num_gpus 0); the Serve config inside is the same one
`specserve serve-config` prints. Every pod's environment switches on Serve's high-throughput data
plane (HAProxy ingress, replicas over gRPC: cluster/serve_data_plane.py), as a local start does.
The Ray autoscaler is on, each group between its pool's min_replicas and max_replicas, so
replicas Serve adds get nodes.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from specserve.cluster.builder import serve_config_yaml
from specserve.cluster.serve_data_plane import HIGH_THROUGHPUT_ENV
from specserve.decoding.host_memory import ENGINE_ENV
from specserve.common.config import SpecServeConfig, WorkerResources

DEFAULT_IMAGE = "specserve:0.1.0-gpu"  # built from k8s/Dockerfile
RAY_VERSION = "2.60.0"


DEFAULT_MODELS_CLAIM = "specserve-models"
MODELS_MOUNT = "/models"


def _pod(image: str, cpus: float, gpus: float, memory_gb: float, models_claim: str | None) -> dict[str, Any]:
    """A Ray pod spec: the container, /dev/shm in memory, the checkpoints' volume read-only."""
    limits: dict[str, Any] = {"cpu": str(cpus), "memory": f"{memory_gb:g}Gi"}
    if gpus:
        limits["nvidia.com/gpu"] = str(int(gpus))
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if models_claim:
        mounts.append({"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True})
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": models_claim, "readOnly": True}})
    container = {"name": "ray", "image": image, "resources": {"limits": limits, "requests": dict(limits)},
                 "env": [{"name": name, "value": value}
                         for name, value in {**HIGH_THROUGHPUT_ENV, **ENGINE_ENV}.items()],
                 "volumeMounts": mounts}
    return {"containers": [container], "volumes": volumes}


# The Ray autoscaler adds a node when a pending replica's engine does not fit, and removes one
# idle this long; Serve's policy decides how many replicas there are (policies.autoscaling).
AUTOSCALER_OPTIONS = {"upscalingMode": "Default", "idleTimeoutSeconds": 120,
                      "resources": {"limits": {"cpu": "500m", "memory": "512Mi"},
                                    "requests": {"cpu": "500m", "memory": "512Mi"}}}


def readiness_probe(http_port: int) -> dict[str, Any]:
    """A worker pod is Ready (Kubernetes sends it Serve traffic) when /health answers 200 through
    its HTTP ingress (HAProxy, or Serve's proxy): every engine pool has answered once
    (deployments/ingress.py), not merely when the ingress runs (KubeRay's default probe). The head keeps KubeRay's own probes: KubeRay submits
    the Serve application only once the head is Ready, so a head gated on the application would
    never get one."""
    return {"httpGet": {"path": "/health", "port": http_port}, "periodSeconds": 5, "timeoutSeconds": 5,
            "failureThreshold": 3}


def _worker_group(pool: str, workers: WorkerResources, image: str, models_claim: str | None,
                  http_port: int) -> dict[str, Any]:
    """One node per engine: node counts follow the pool's replica bounds. A draft pool with
    num_gpus 0 becomes a CPU group (heterogeneous placement: small drafts need no GPU). A
    tensor-parallel engine's N ranks share one node (STRICT_PACK): its pod gets N ranks' GPUs and CPUs."""
    size = workers.tensor_parallel_size
    gpus_per_node = max(1, int(workers.num_gpus)) * size if workers.num_gpus else 0
    low, high = workers.replica_bounds
    spec = _pod(image, max(2.0, workers.num_cpus * size + 1), gpus_per_node, workers.node_memory_gb, models_claim)
    spec["containers"][0]["readinessProbe"] = readiness_probe(http_port)
    return {
        "groupName": f"{pool}-{'gpu' if gpus_per_node else 'cpu'}",
        "replicas": workers.initial_replicas,
        "minReplicas": low,
        "maxReplicas": high,
        "rayStartParams": {"resources": json.dumps(workers.resources)} if workers.resources else {},
        "template": {"spec": spec},
    }


def rayservice_manifest(config: SpecServeConfig, image: str = DEFAULT_IMAGE, name: str = "specserve",
                        models_claim: str | None = DEFAULT_MODELS_CLAIM) -> dict[str, Any]:
    """models_claim: the PVC holding the checkpoints, mounted at /models everywhere (the head reads
    the tokenizer and configs when it builds the app); None mounts nothing (models in the image)."""
    head_port_config = [{"containerPort": 6379, "name": "gcs"}, {"containerPort": 8265, "name": "dashboard"},
                        {"containerPort": 8000, "name": "serve"}, {"containerPort": 8080, "name": "metrics"}]
    head = _pod(image, 4, 0, 8, models_claim)
    head["containers"][0]["ports"] = head_port_config
    serve_yaml = serve_config_yaml(config.model_copy(update={"http": config.http.model_copy(update={"host": "0.0.0.0"})}))
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            "serveConfigV2": serve_yaml,
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": AUTOSCALER_OPTIONS,
                "headGroupSpec": {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
                                  "template": {"spec": head}},
                "workerGroupSpecs": [_worker_group("draft", config.draft_workers, image, models_claim, config.http.port),
                                     _worker_group("target", config.target_workers, image, models_claim,
                                                   config.http.port)],
            },
        },
    }


class _BlockStringDumper(yaml.SafeDumper):
    """Writes multi-line strings (the embedded Serve config) as readable `|` blocks."""


_BlockStringDumper.add_representer(
    str, lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                                       style="|" if "\n" in value else None))


def rayservice_yaml(config: SpecServeConfig, image: str = DEFAULT_IMAGE,
                    models_claim: str | None = DEFAULT_MODELS_CLAIM) -> str:
    return "# Generated by `specserve k8s-manifest`; do not edit by hand.\n" + \
        yaml.dump(rayservice_manifest(config, image, models_claim=models_claim), Dumper=_BlockStringDumper,
                  sort_keys=False, width=120)
