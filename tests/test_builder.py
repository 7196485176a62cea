"""App builder and Serve config YAML (validated with Ray's own schema)."""

import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.builder import IMPORT_PATH, build_app, deployment_options, serve_config_yaml
from cluster.config import SpecServeConfig


def test_serve_config_yaml_is_valid_for_serve_deploy():
    config = SpecServeConfig.model_validate({"target_workers": {"num_gpus": 1, "num_replicas": 2},
                                             "draft_workers": {"num_gpus": 1}})
    document = yaml.safe_load(serve_config_yaml(config))
    schema = ServeDeploySchema.model_validate(document)
    app = schema.applications[0]
    assert app.import_path == IMPORT_PATH
    assert SpecServeConfig.model_validate(app.args) == config
    by_name = {d.name: d for d in app.deployments}
    assert by_name["TargetWorker"].num_replicas == 2
    assert by_name["TargetWorker"].placement_group_bundles[1] == {"CPU": 1.0, "GPU": 1.0}
    assert by_name["DraftWorker"].placement_group_bundles[1] == {"CPU": 1.0, "GPU": 1.0}


def test_draft_and_target_engines_get_their_own_resources():
    options = deployment_options(SpecServeConfig.model_validate(
        {"target_workers": {"num_gpus": 1}, "draft_workers": {"num_gpus": 0.5, "num_cpus": 2}}))
    assert options["TargetWorker"]["placement_group_bundles"][1] == {"CPU": 1.0, "GPU": 1}
    assert options["DraftWorker"]["placement_group_bundles"][1] == {"CPU": 2, "GPU": 0.5}


def test_no_draft_deployment_without_speculation():
    config = SpecServeConfig.model_validate({"speculation": {"proposer": "none"}})
    assert "DraftWorker" not in deployment_options(config)
    assert build_app(config) is not None


def test_build_app_binds_the_whole_graph():
    app = build_app(SpecServeConfig())
    assert type(app).__name__ == "Application"


def test_committed_kuberay_manifest_is_generated_from_the_gpu_config():
    from cluster.config import PROJECT_ROOT, load_config
    from cluster.kuberay import rayservice_yaml

    config = load_config(PROJECT_ROOT / "k8s" / "specserve-gpu.yaml", environ={})
    committed = (PROJECT_ROOT / "k8s" / "rayservice.yaml").read_text()
    assert committed == rayservice_yaml(config), "regenerate with `specserve k8s-manifest -o k8s/rayservice.yaml`"


def test_kuberay_manifest_pins_draft_and_target_to_their_own_gpu_groups():
    from cluster.config import PROJECT_ROOT, load_config
    from cluster.kuberay import rayservice_manifest

    manifest = rayservice_manifest(load_config(PROJECT_ROOT / "k8s" / "specserve-gpu.yaml", environ={}))
    ServeDeploySchema.model_validate(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    groups = {g["groupName"]: g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert "specserve_draft" in groups["draft-gpu"]["rayStartParams"]["resources"]
    assert "specserve_target" in groups["target-gpu"]["rayStartParams"]["resources"]
    for group in groups.values():
        assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
