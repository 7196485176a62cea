"""Losing a node on a real multi-node Ray cluster, started on this machine with `ray start`.

A head node (no engine resources: Serve's controller and proxy, the ingress and the router), one
node offering `draft_node` and two offering `target_node`; the pools ask for those resources, so
the draft engine runs on its own node and the two target engines on theirs. A node is stopped
by killing its raylet and everything under it (SIGKILL, as a lost machine), mid-stream:
- the draft node: the request completes target-only, its greedy text equal to the target's own;
- the node of the request's target engine, while another target replica lives: the request
  completes on the other one by re-prefilling from the committed history, same text.
Slow (a cluster of four nodes on two cores): `make reliability`, not CI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
import ray
from ray import serve

from specserve.common.config import SpecServeConfig
from specserve.cluster.builder import APP_NAME, build_app
from specserve.cluster.local import wait_healthy
from tests.local_server import PortReservation, free_port
from tests.test_serving import MODEL, PROMPTS
from tests.tiny_pair import make_tiny_pair

pytestmark = [pytest.mark.ray, pytest.mark.slow]
# The running interpreter's Ray CLI, whether or not its venv has a `ray` script in bin/.
RAY_CLI = [sys.executable, "-m", "ray.scripts.scripts"]
AUTH_ENV = ("RAY_AUTH_MODE",)
ENGINE_CPUS = 0.99  # + the replica's 0.01: a worker node with one CPU holds one worker, nothing else


NODE_PORT_FLAGS = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                   "--metrics-export-port")  # every node's own; the head's GCS and client ports come on top


def ray_start(ports: PortReservation, *args: str, temp_dir: str | None = None) -> None:
    """`ray start` one node, its ports taken from the cluster's reservation as it starts."""
    chosen = [f"{flag}={port}" for flag, port in zip(NODE_PORT_FLAGS, ports.take(len(NODE_PORT_FLAGS)))]
    extra = [f"--temp-dir={temp_dir}"] if temp_dir else []
    done = subprocess.run([*RAY_CLI, "start", *args, *chosen, "--min-worker-port=0", "--max-worker-port=0",
                           "--disable-usage-stats", *extra], capture_output=True, text=True, timeout=180,
                          env=os.environ.copy())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def raylet_of(node_id: str) -> psutil.Process:
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if cmdline and cmdline[0].endswith("raylet") and f"--node_id={node_id}" in cmdline:
            return process
    raise LookupError(f"no raylet for node {node_id}")


def kill_node(node_id: str) -> None:
    """SIGKILL a node's raylet and every process under it (its workers and agents)."""
    raylet = raylet_of(node_id)
    processes = [raylet, *raylet.children(recursive=True)]
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)


def cluster_processes(temp_dir: str, gcs_port: int) -> list[psutil.Process]:
    """This cluster's processes and only those (never `ray stop`: it kills every Ray on the
    machine): the head's services name its temp dir or GCS port, and raylets (which name the
    GCS address) own the workers and agents."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if temp_dir in cmdline or f":{gcs_port}" in cmdline or f"port={gcs_port}" in cmdline:
            found.append(process)
            try:
                found.extend(process.children(recursive=True))
            except psutil.Error:
                pass
    return [process for process in found if process.pid != os.getpid()]


def multinode_app(tmp_path_factory, workers: dict, head_resources: dict | None = None,
                  **sections: dict) -> Iterator[tuple[str, SpecServeConfig]]:
    """A head node (3 CPUs, head_resources) and one 1-CPU node per resource named in workers
    ({resource: node count}), the tiny pair's app deployed on them with extra config sections;
    all torn down by PID."""
    target_path, draft_path = make_tiny_pair(tmp_path_factory.mktemp("pair"))
    temp_dir = tempfile.mkdtemp(prefix="ssmn")  # short: Ray's socket paths must fit in 107 bytes
    # Every port of the cluster reserved at once: distinct, and held until its node starts.
    ports = PortReservation(2 + len(NODE_PORT_FLAGS) * (1 + sum(workers.values())))
    gcs_port, client_server_port = ports.take(2)
    # Token authentication off for this throwaway cluster: the test driver's Ray reads its auth
    # mode once per process (off here), so every `ray start` must agree with it (restored after).
    saved = {name: os.environ.get(name) for name in AUTH_ENV}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        head = [f"--resources={json.dumps(head_resources)}"] if head_resources else []
        ray_start(ports, "--head", f"--port={gcs_port}", f"--ray-client-server-port={client_server_port}",
                  "--num-cpus=3", "--include-dashboard=false", *head, temp_dir=temp_dir)
        address = f"127.0.0.1:{gcs_port}"
        for resource, count in workers.items():
            for _ in range(count):
                ray_start(ports, f"--address={address}", "--num-cpus=1", f"--resources={json.dumps({resource: 1})}")
        ports.close()
        ray.init(address=address, configure_logging=False, log_to_driver=False)
        config = SpecServeConfig.model_validate({
            "model_name": MODEL, "target": {"path": str(target_path)}, "draft": {"path": str(draft_path)},
            "http": {"port": free_port()},
            "target_workers": {"num_replicas": workers["target_node"], "num_cpus": ENGINE_CPUS,
                               "resources": {"target_node": 1}},
            "draft_workers": {"num_replicas": workers["draft_node"], "num_cpus": ENGINE_CPUS,
                              "resources": {"draft_node": 1}},
            **sections,
        })
        # One HTTP proxy, on the head: every node is on this machine and would bind the same port.
        serve.start(proxy_location="HeadOnly", http_options={"host": config.http.host, "port": config.http.port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        url = f"http://{config.http.host}:{config.http.port}"
        wait_healthy(url, timeout_s=300)
        yield url, config
    finally:
        ports.close()
        if ray.is_initialized():
            try:
                serve.shutdown()
            except Exception:
                pass
            ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for process in cluster_processes(temp_dir, gcs_port):
            try:
                process.kill()
            except psutil.Error:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[str, SpecServeConfig]]:
    """Head + draft node + two target nodes, the app deployed on them."""
    yield from multinode_app(tmp_path_factory, {"draft_node": 1, "target_node": 2})


@pytest.fixture(scope="module")
def reference(cluster):
    """In-process target-only greedy text: what every request must return whatever node is lost."""
    from tests.local_server import greedy_reference

    return greedy_reference(cluster[1].target.path)


def engine_nodes(pool: str) -> dict:
    """pool's named engine actors -> their stats (node id, sequences held); only that pool's, so
    an engine lost with another node is never waited on."""
    from specserve.common.naming import ENGINE_NAMESPACE, parse_engine_actor_name

    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        parsed = parse_engine_actor_name(entry["name"]) if entry["namespace"] == ENGINE_NAMESPACE else None
        if parsed is not None and parsed[0] == pool:
            actor = ray.get_actor(entry["name"], namespace=ENGINE_NAMESPACE)
            found[parsed[1]] = ray.get(actor.stats.remote(), timeout=5)
    return found


def stream_losing_a_node(url: str, prompt: str, max_tokens: int, pick_node) -> dict:
    """Stream a greedy completion; once the first chunk is out, kill the node pick_node() names."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, final, killed = "", {}, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()[:500]
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            if killed is None:
                killed = pick_node()
                kill_node(killed)
            text += chunk["choices"][0]["text"]
            final = chunk
    return {"text": text, "final": final, "killed": killed}


def test_engines_land_on_their_own_nodes(cluster):
    targets, drafts = engine_nodes("target"), engine_nodes("draft")
    assert len(targets) == 2 and len(drafts) == 1
    nodes = [stats.node_id for stats in (*targets.values(), *drafts.values())]
    assert len(set(nodes)) == 3, nodes


def test_losing_the_draft_node_mid_stream_the_request_completes_target_only(cluster, reference):
    url, _ = cluster
    draft_node = next(iter(engine_nodes("draft").values())).node_id
    result = stream_losing_a_node(url, PROMPTS[2], 150, lambda: draft_node)
    assert result["text"] == reference(PROMPTS[2], 150)
    assert result["final"]["speculation"]["draft_failures"] >= 1


def test_losing_a_target_node_mid_stream_the_request_completes_on_the_other_target(cluster, reference):
    url, _ = cluster

    def node_serving_the_request() -> str:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            holding = [stats for stats in engine_nodes("target").values() if stats.sequences > 0]
            if len(holding) == 1:
                return holding[0].node_id
            time.sleep(0.05)
        raise AssertionError("no single target engine holds the request")

    result = stream_losing_a_node(url, PROMPTS[1], 200, node_serving_the_request)
    assert result["text"] == reference(PROMPTS[1], 200)
    assert result["final"]["speculation"]["target_failovers"] >= 1
