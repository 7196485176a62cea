"""The generated Serve config deploys through Serve's own config path (`serve run CONFIG`) and answers.

Under `make reliability` (marker slow): a whole cluster and app start for one request. `make test`
checks the same YAML in process (tests/test_builder.py): Serve's own schema takes it, and its
import path built with its args is the app every served test deploys."""

import subprocess
import sys

import httpx
import pytest
import ray

from specserve.cluster.builder import logical_cpus_needed, serve_config_yaml
from specserve.common.config import SpecServeConfig
from specserve.cluster.local import RAY_SYSTEM_CONFIG, init_local_ray, wait_healthy
from tests.local_server import free_port, stop_test_cluster
from tests.tiny_pair import make_tiny_pair

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_generated_serve_config_runs_with_serve_run_and_answers(tmp_path):
    target_path, draft_path = make_tiny_pair(tmp_path)
    config = SpecServeConfig.model_validate({
        "model_name": "tiny-pair", "target": {"path": str(target_path)}, "draft": {"path": str(draft_path)},
        "http": {"port": free_port()}})
    config_path = tmp_path / "serve.yaml"
    text = serve_config_yaml(config)
    assert f"--num-cpus {logical_cpus_needed(config)}" in text  # the header says what Ray needs
    config_path.write_text(text)
    # A cluster with the logical CPUs the header names, as `ray start --head --num-cpus N` gives.
    init_local_ray(num_cpus=logical_cpus_needed(config), include_dashboard=False, _system_config=RAY_SYSTEM_CONFIG)
    try:
        # Serve's CLI of the running interpreter, whether or not its venv has a `serve` script in bin/.
        deployed = subprocess.run([sys.executable, "-m", "ray.serve.scripts", "run", "--non-blocking", "--address",
                                   ray.get_runtime_context().gcs_address, str(config_path)],
                                  timeout=300, capture_output=True, text=True)
        assert deployed.returncode == 0, deployed.stderr[-3000:]
        url = f"http://127.0.0.1:{config.http.port}"
        wait_healthy(url, timeout_s=300)
        response = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "tiny-pair", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
        assert response.json()["speculation"]["num_drafted"] > 0
    finally:
        stop_test_cluster()
