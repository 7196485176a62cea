"""App builder and Serve config YAML (validated with Ray's own schema)."""

import pytest
import yaml
from ray._common.utils import import_attr
from ray.serve.schema import ServeDeploySchema

from specserve.cluster.builder import IMPORT_PATH, build_app, deployment_options, serve_config_yaml
from specserve.common.config import SpecServeConfig


def test_serve_config_yaml_is_valid_for_serve_deploy():
    config = SpecServeConfig.model_validate({"target_workers": {"num_gpus": 1, "num_replicas": 2},
                                             "draft_workers": {"num_gpus": 1}})
    document = yaml.safe_load(serve_config_yaml(config))
    schema = ServeDeploySchema.model_validate(document)
    app = schema.applications[0]
    assert app.import_path == IMPORT_PATH
    assert SpecServeConfig.model_validate(app.args) == config
    # What `serve run` does with it, short of deploying (tests/test_serve_config_deploy.py deploys
    # it, under `make reliability`): import the path and build the app from the args.
    built = import_attr(app.import_path)(app.args)
    assert set(bound_deployments(built)) == {"Ingress", "Router", "TargetWorker", "DraftWorker"}
    by_name = {d.name: d for d in app.deployments}
    assert by_name["TargetWorker"].num_replicas == 2
    assert by_name["TargetWorker"].placement_group_bundles[1] == {"CPU": 1.0, "GPU": 1.0}
    assert by_name["DraftWorker"].placement_group_bundles[1] == {"CPU": 1.0, "GPU": 1.0}


def test_draft_and_target_engines_get_their_own_resources():
    options = deployment_options(SpecServeConfig.model_validate(
        {"target_workers": {"num_gpus": 1}, "draft_workers": {"num_gpus": 0.5, "num_cpus": 2}}))
    assert options["TargetWorker"]["placement_group_bundles"][1] == {"CPU": 1.0, "GPU": 1}
    assert options["DraftWorker"]["placement_group_bundles"][1] == {"CPU": 2, "GPU": 0.5}


def bound_deployments(app) -> dict:
    """Deployment name -> the bound Deployment, walking the graph through bound init args.
    (Ray 2.60 keeps the bound deployment of an Application in `_bound_deployment`.)"""
    found, pending = {}, [app]
    while pending:
        deployment = pending.pop()._bound_deployment
        found[deployment.name] = deployment
        pending.extend(arg for arg in (*deployment.init_args, *deployment.init_kwargs.values())
                       if type(arg).__name__ == "Application")
    return found


def test_build_app_binds_ingress_router_and_both_worker_pools():
    config = SpecServeConfig.model_validate({"target_workers": {"num_gpus": 1, "num_replicas": 2},
                                             "draft_workers": {"num_gpus": 0.5, "num_cpus": 2}})
    app = build_app(config)
    graph = bound_deployments(app)
    assert app._bound_deployment.name == "Ingress"
    assert set(graph) == {"Ingress", "Router", "TargetWorker", "DraftWorker"}
    router_args = graph["Router"].init_args
    assert [a._bound_deployment.name for a in router_args[1:]] == ["TargetWorker", "DraftWorker"]
    target, draft = graph["TargetWorker"], graph["DraftWorker"]
    assert target.num_replicas == 2
    assert target._replica_config.placement_group_bundles[1] == {"CPU": 1.0, "GPU": 1.0}
    assert draft._replica_config.placement_group_bundles[1] == {"CPU": 2.0, "GPU": 0.5}
    assert target._replica_config.placement_group_strategy == "STRICT_PACK"
    assert target.init_args[1]["path"] == config.target.path
    assert draft.init_args[1] == config.speculation.proposer
    assert graph["Ingress"].ray_actor_options == {"num_cpus": config.ingress.num_cpus}


def test_the_bound_options_are_the_ones_the_serve_yaml_declares():
    config = SpecServeConfig()
    graph = bound_deployments(build_app(config))
    for name, options in deployment_options(config).items():
        assert graph[name].num_replicas == options["num_replicas"]
        assert graph[name].max_ongoing_requests == options["max_ongoing_requests"]


def test_every_replica_polls_its_drain_quickly_when_stopped():
    """A stop (scale-down, shutdown) waits for requests in flight, polled every
    SHUTDOWN_DRAIN_POLL_S, not Serve's default 2 s: fixed and autoscaled pools alike."""
    from specserve.cluster.builder import SHUTDOWN_DRAIN_POLL_S

    fixed, ranged = SpecServeConfig(), SpecServeConfig.model_validate(
        {"target_workers": {"min_replicas": 1, "max_replicas": 2}, "router": {"min_replicas": 1, "max_replicas": 2}})
    assert "autoscaling_config" in deployment_options(ranged)["TargetWorker"]
    for config in (fixed, ranged):
        options = deployment_options(config)
        assert set(options) == {"Ingress", "Router", "TargetWorker", "DraftWorker"}
        assert {name: o["graceful_shutdown_wait_loop_s"] for name, o in options.items()} == \
            dict.fromkeys(options, SHUTDOWN_DRAIN_POLL_S)


def test_no_draft_deployment_without_speculation():
    config = SpecServeConfig.model_validate({"speculation": {"proposer": "none"}})
    assert "DraftWorker" not in deployment_options(config)
    graph = bound_deployments(build_app(config))
    assert set(graph) == {"Ingress", "Router", "TargetWorker"}
    assert graph["Router"].init_args[2] is None  # the router is told there is no draft pool


def test_committed_kuberay_manifest_is_generated_from_the_gpu_config():
    from specserve.common.config import PROJECT_ROOT, load_config
    from specserve.cluster.kuberay import rayservice_yaml

    config = load_config(PROJECT_ROOT / "k8s" / "specserve-gpu.yaml", environ={})
    committed = (PROJECT_ROOT / "k8s" / "rayservice.yaml").read_text()
    assert committed == rayservice_yaml(config), "regenerate with `specserve k8s-manifest -o k8s/rayservice.yaml`"


def test_kuberay_manifest_pins_draft_and_target_to_their_own_gpu_groups():
    from specserve.common.config import PROJECT_ROOT, load_config
    from specserve.cluster.kuberay import rayservice_manifest

    manifest = rayservice_manifest(load_config(PROJECT_ROOT / "k8s" / "specserve-gpu.yaml", environ={}))
    ServeDeploySchema.model_validate(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    groups = {g["groupName"]: g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert "specserve_draft" in groups["draft-gpu"]["rayStartParams"]["resources"]
    assert "specserve_target" in groups["target-gpu"]["rayStartParams"]["resources"]
    for group in groups.values():
        assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_kuberay_worker_pods_are_ready_only_when_health_answers_and_the_head_keeps_kuberays_probes():
    """Kubernetes sends Serve traffic to Ready pods: a worker's readiness is specserve's /health
    on the Serve port (every engine pool has answered), not the proxy merely running. The head has
    no probe of ours: KubeRay deploys the app only once the head is Ready."""
    from specserve.common.config import PROJECT_ROOT, load_config
    from specserve.cluster.kuberay import rayservice_manifest

    config = load_config(PROJECT_ROOT / "k8s" / "specserve-gpu.yaml", environ={})
    cluster = rayservice_manifest(config)["spec"]["rayClusterConfig"]
    for group in cluster["workerGroupSpecs"]:
        probe = group["template"]["spec"]["containers"][0]["readinessProbe"]
        assert probe["httpGet"] == {"path": "/health", "port": config.http.port}
    assert "readinessProbe" not in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]


def test_each_application_names_its_own_policy_actor():
    """Engines, routers and the pools' autoscaling policy of one app all address the policy actor
    named after its model, and two apps' names differ (tests/test_policy_actor.py: two actors)."""
    from specserve.policies.decision import PolicySettings

    names = set()
    for model_name in ("pair-a", "pair-b"):
        config = SpecServeConfig.model_validate({"model_name": model_name,
                                                 "target_workers": {"min_replicas": 1, "max_replicas": 2}})
        autoscaling = deployment_options(config)["TargetWorker"]["autoscaling_config"]["policy"]["policy_kwargs"]
        addressed = {config.engine_options()["policy_actor"], PolicySettings.from_config(config).actor_name,
                     autoscaling["settings"]["actor_name"]}
        assert len(addressed) == 1
        names |= addressed
    assert len(names) == 2


def test_a_tensor_parallel_target_gets_a_bundle_per_rank_packed_on_one_node():
    config = SpecServeConfig.model_validate({"target_workers": {"tensor_parallel_size": 4, "num_gpus": 1},
                                             "target": {"path": "t", "device": "auto"}})
    options = deployment_options(config)
    assert options["TargetWorker"]["placement_group_bundles"] == [{"CPU": 0.01}] + [{"CPU": 1.0, "GPU": 1.0}] * 4
    assert options["TargetWorker"]["placement_group_strategy"] == "STRICT_PACK"
    assert len(options["DraftWorker"]["placement_group_bundles"]) == 2   # the draft stays one engine


def test_kuberay_gives_a_tensor_parallel_targets_pods_one_gpu_per_rank():
    from specserve.common.config import PROJECT_ROOT, load_config
    from specserve.cluster.kuberay import rayservice_manifest

    config = load_config(PROJECT_ROOT / "k8s" / "specserve-gpu.yaml", environ={})
    config = config.model_copy(update={"target_workers": config.target_workers.model_copy(
        update={"tensor_parallel_size": 4})})
    groups = {g["groupName"]: g for g in rayservice_manifest(config)["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    limits = {name: group["template"]["spec"]["containers"][0]["resources"]["limits"] for name, group in groups.items()}
    assert limits["target-gpu"]["nvidia.com/gpu"] == "4" and limits["draft-gpu"]["nvidia.com/gpu"] == "1"


def test_the_tensor_parallel_size_flag_sets_the_target_pool():
    import argparse

    from specserve.cluster.cli import add_model_args, config_from_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_model_args(parser)
    config = config_from_args(parser.parse_args(["--tensor-parallel-size", "2"]))
    assert config.target_workers.tensor_parallel_size == 2 and config.draft_workers.tensor_parallel_size == 1


@pytest.mark.parametrize("section", [{"router": {"tensor_parallel_size": 2}},
                                     {"draft_workers": {"tensor_parallel_size": 2},
                                      "draft_training": {"enabled": True}},
                                     {"draft_workers": {"tensor_parallel_size": 2},
                                      "speculation": {"proposer": "ngram"}}])
def test_tensor_parallelism_is_refused_where_it_cannot_run(section):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        SpecServeConfig.model_validate(section)
