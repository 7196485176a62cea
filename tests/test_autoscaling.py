"""Autoscaling wiring: per-pool min/max in the config, Serve autoscaling_config with our policy,
a Serve config that Ray's own schema accepts, local resources for max replicas, KubeRay autoscaler."""

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from specserve.cluster.builder import (POOL_POLICY, custom_resources_needed, deployment_options, logical_cpus_needed,
                                       serve_config_yaml)
from specserve.common.config import PROJECT_ROOT, SpecServeConfig, WorkerResources, load_config
from specserve.policies.decision import PolicySettings

RANGED = {"target_workers": {"min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 1, "downscale_delay_s": 5},
          "draft_workers": {"min_replicas": 1, "max_replicas": 3, "num_gpus": 0.5}}


def test_min_above_max_is_rejected():
    with pytest.raises(ValidationError, match="min_replicas <= max_replicas"):
        WorkerResources(min_replicas=3, max_replicas=2)


def test_unset_bounds_mean_a_fixed_pool_of_num_replicas():
    fixed = WorkerResources(num_replicas=2)
    assert fixed.replica_bounds == (2, 2) and not fixed.autoscaling and fixed.initial_replicas == 2


def test_equal_bounds_are_a_fixed_pool_and_ranged_bounds_autoscale():
    assert not WorkerResources(min_replicas=3, max_replicas=3).autoscaling
    assert WorkerResources(min_replicas=3, max_replicas=3).initial_replicas == 3
    ranged = WorkerResources(num_replicas=1, max_replicas=4)
    assert ranged.autoscaling and ranged.replica_bounds == (1, 4) and ranged.initial_replicas == 1


def test_fixed_pools_keep_num_replicas_and_no_autoscaling():
    options = deployment_options(SpecServeConfig.model_validate({"target_workers": {"num_replicas": 2}}))
    assert options["TargetWorker"]["num_replicas"] == 2
    assert "autoscaling_config" not in options["TargetWorker"]


def test_ranged_pools_autoscale_through_serve_with_the_pool_policy():
    config = SpecServeConfig.model_validate(RANGED)
    options = deployment_options(config)
    for name, pool, bounds in (("TargetWorker", "target", (1, 4)), ("DraftWorker", "draft", (1, 3))):
        assert "num_replicas" not in options[name]
        autoscaling = AutoscalingConfig.model_validate(options[name]["autoscaling_config"])  # Ray's own model
        assert (autoscaling.min_replicas, autoscaling.max_replicas) == bounds
        assert autoscaling.policy.policy_function == POOL_POLICY
        assert autoscaling.policy.policy_kwargs["pool"] == pool
        settings = PolicySettings.from_dict(autoscaling.policy.policy_kwargs["settings"])
        assert settings == PolicySettings.from_config(config)
    assert options["TargetWorker"]["autoscaling_config"]["upscale_delay_s"] == 1
    assert options["TargetWorker"]["autoscaling_config"]["downscale_delay_s"] == 5


def test_policy_settings_carry_the_depth_and_replica_bounds():
    settings = PolicySettings.from_config(SpecServeConfig.model_validate(
        {**RANGED, "speculation": {"min_draft_tokens": 2, "num_draft_tokens": 3, "max_draft_tokens": 6,
                                   "target_only_steps": 5}}))
    assert (settings.min_k, settings.default_k, settings.max_k, settings.target_only_steps) == (2, 3, 6, 5)
    assert PolicySettings.from_dict(settings.to_dict()) == settings
    assert settings.target_bounds == (1, 4) and settings.draft_bounds == (1, 3)
    assert PolicySettings.from_config(SpecServeConfig.model_validate({"speculation": {"proposer": "none"}})).draft_bounds is None


def test_serve_config_with_autoscaling_validates_with_serve_deploy_schema():
    config = SpecServeConfig.model_validate(RANGED)
    document = yaml.safe_load(serve_config_yaml(config))
    app = ServeDeploySchema.model_validate(document).applications[0]
    by_name = {d.name: d for d in app.deployments}
    target = by_name["TargetWorker"].autoscaling_config
    assert target["min_replicas"] == 1 and target["max_replicas"] == 4
    assert target["policy"]["policy_function"] == POOL_POLICY
    assert SpecServeConfig.model_validate(app.args) == config


def test_a_ranged_router_uses_serves_default_policy():
    options = deployment_options(SpecServeConfig.model_validate({"router": {"min_replicas": 1, "max_replicas": 3}}))
    autoscaling = AutoscalingConfig.model_validate(options["Router"]["autoscaling_config"])
    assert autoscaling.policy.is_default_policy_function()


def test_single_machine_resources_cover_max_replicas():
    config = SpecServeConfig.model_validate(
        {"target_workers": {"min_replicas": 1, "max_replicas": 6, "num_cpus": 1, "resources": {"t": 1}},
         "draft_workers": {"min_replicas": 1, "max_replicas": 4, "num_cpus": 1}})
    assert logical_cpus_needed(config) >= 6 + 4 + 0.5
    assert custom_resources_needed(config) == {"t": 6.0}


def test_kuberay_manifest_enables_the_autoscaler_with_per_pool_bounds():
    from specserve.cluster.kuberay import rayservice_manifest

    config = load_config(PROJECT_ROOT / "k8s" / "specserve-gpu.yaml", environ={})
    cluster = rayservice_manifest(config)["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert (groups["target-gpu"]["minReplicas"], groups["target-gpu"]["maxReplicas"]) == config.target_workers.replica_bounds
    assert (groups["draft-gpu"]["minReplicas"], groups["draft-gpu"]["maxReplicas"]) == config.draft_workers.replica_bounds
    assert config.target_workers.autoscaling and config.draft_workers.autoscaling


def test_kuberay_draft_group_may_be_cpu_nodes():
    from specserve.cluster.kuberay import rayservice_manifest

    config = SpecServeConfig.model_validate({"draft_workers": {"num_gpus": 0, "max_replicas": 8, "resources": {"specserve_draft": 1}},
                                             "target_workers": {"num_gpus": 1, "max_replicas": 2}})
    groups = {g["groupName"]: g for g in rayservice_manifest(config)["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    limits = groups["draft-cpu"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits and groups["draft-cpu"]["maxReplicas"] == 8
    assert groups["target-gpu"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_kuberay_pods_mount_shm_and_the_checkpoints_and_size_memory_per_pool():
    """Every pod gets a memory-backed /dev/shm (Ray's object store) and the checkpoints' claim
    read-only at /models; pool pods take their node_memory_gb; without a claim nothing is mounted."""
    from specserve.cluster.kuberay import rayservice_manifest

    config = load_config(PROJECT_ROOT / "k8s" / "specserve-gpu.yaml", environ={})
    cluster = rayservice_manifest(config, models_claim="my-models")["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "my-models", "readOnly": True}
        mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert "/dev/shm" in mounts and mounts["/models"]["readOnly"] is True
    groups = {g["groupName"]: g["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
              for g in cluster["workerGroupSpecs"]}
    assert groups == {"draft-gpu": f"{config.draft_workers.node_memory_gb:g}Gi",
                      "target-gpu": f"{config.target_workers.node_memory_gb:g}Gi"}
    bare = rayservice_manifest(config, models_claim=None)["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert [v["name"] for v in bare["template"]["spec"]["volumes"]] == ["dshm"]


def test_build_app_binds_autoscaled_pools():
    from specserve.cluster.builder import build_app

    assert type(build_app(SpecServeConfig.model_validate(RANGED))).__name__ == "Application"
