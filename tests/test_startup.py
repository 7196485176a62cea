"""Start-up truth: a busy HTTP port fails `specserve serve` at once, naming the port, before Ray starts;
a Ray node that misses its start-up limits is started once more."""

import logging
import socket
import subprocess
import time

import psutil
import pytest
import ray

from specserve.common.config import DEFAULT_MODELS_DIR, SpecServeConfig
from specserve.cluster.local import PortInUseError, StartupError, check_port_free, init_local_ray, start_local
from tests.local_server import free_port


@pytest.fixture
def busy_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_a_busy_port_fails_start_up_naming_the_port_before_ray_starts(busy_port):
    config = SpecServeConfig.model_validate({"http": {"port": busy_port}})
    with pytest.raises(PortInUseError, match=f"port {busy_port} is already in use"):
        start_local(config)
    assert not ray.is_initialized()


def test_a_free_port_passes_the_check():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    check_port_free("127.0.0.1", port)


def test_the_cli_prints_the_busy_port_without_a_traceback(busy_port, monkeypatch, capsys):
    from specserve.cluster import cli

    monkeypatch.setenv("SPECSERVE__HTTP__PORT", str(busy_port))
    with pytest.raises(SystemExit) as info:
        cli.main(["serve"])
    assert info.value.code == 2
    assert f"port {busy_port} is already in use" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_replica_cause_is_the_innermost_exception_of_a_serve_status_message():
    from specserve.cluster.local import replica_cause

    message = ("A replica failed to start with exception. Retrying 2 more time(s). Error:\n"
               "\x1b[36mray::ServeReplica:specserve:TargetWorker.initialize_and_get_metadata()\x1b[39m (pid=1)\n"
               "  File \"replica.py\", line 3521, in initialize_and_get_metadata\n"
               "RuntimeError: Traceback (most recent call last):\n"
               "  File \"engine_host.py\", line 205, in __init__\n"
               "    ray.get(self.engine.ping.remote())\n"
               "ray.exceptions.ActorDiedError: The actor died because of an error raised in its creation task\n"
               "  File \"paged_cache.py\", line 90, in kv_capacity\n"
               "ValueError: the budget holds 16 tokens\n"
               "fewer than max_model_len\n")
    assert replica_cause(message) == "ValueError: the budget holds 16 tokens\nfewer than max_model_len"
    assert replica_cause("no traceback here") == "no traceback here"


@pytest.mark.ray
@pytest.mark.slow   # in make reliability (a whole `specserve serve` start-up); the message's parts are tested above
def test_a_start_that_fails_never_answers_200_and_ends_with_the_replicas_own_error():
    """A KV budget too small for one sequence. Polled from the moment the command starts, neither
    /v1/models nor /health ever answers 200 (the engines never answered: the server was never
    ready), though the app answered while it started. The engine's own message, its budget as
    given, is the CLI's last line, at the first failed replica (not after Serve's retries), with no
    traceback through Ray. The shipped target alone (no draft): one engine to start, the same
    failure path."""
    import os
    import sys
    import threading
    import time
    from pathlib import Path

    import httpx

    repo = Path(__file__).resolve().parents[1]
    port = free_port()
    env = {**os.environ, "SPECSERVE__HTTP__PORT": str(port), "PYTHONPATH": str(repo)}
    command = [sys.executable, "-m", "specserve.cluster.cli", "serve", "--target", str(DEFAULT_MODELS_DIR / "target"),
               "--kv-cache-memory-gb", "0.0005"]
    statuses: list = []

    def poll(server: subprocess.Popen) -> None:
        while server.poll() is None:
            for route in ("/v1/models", "/health"):
                try:
                    statuses.append((route, httpx.get(f"http://127.0.0.1:{port}{route}", timeout=10).status_code))
                except httpx.HTTPError:
                    statuses.append((route, None))
            time.sleep(0.2)

    server = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    poller = threading.Thread(target=poll, args=(server,))
    poller.start()
    stdout, stderr = server.communicate(timeout=600)
    poller.join(timeout=30)
    assert server.returncode == 1, stderr[-2000:]
    answered = [status for _, status in statuses if status is not None]
    assert answered and 200 not in answered, statuses
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith("specserve: TargetWorker failed to start: ValueError: the KV cache budget of "
                                "0.0005 GiB"), last_line
    assert "kv_cache_memory_gb" in last_line and "max_model_len=512" in last_line
    assert "Traceback" not in stderr and "Deploying application" not in stderr
    assert "Token authentication" not in stdout + stderr and "(raylet)" not in stdout + stderr


def test_a_ray_start_that_misses_its_limits_is_tried_once_more_and_leaves_nothing_of_the_failed_try(
        monkeypatch, caplog):
    """The first start fails as a node that never comes up does (its GCS process started, then the
    port-file wait gives up: Ray raises a bare RuntimeError); the second is asked with the same
    arguments, after what the first left behind has ended. The warning says what became of the
    failed start's processes: one still running, one killed at birth."""
    failed_children, second_starts = [], []

    def init_whose_node_times_out_once(**kwargs):
        if not failed_children:
            failed_children.append(subprocess.Popen(["sleep", "60"]))  # a process of the failed start
            died = subprocess.Popen(["sh", "-c", "kill -9 $$"])
            while psutil.Process(died.pid).status() != psutil.STATUS_ZOMBIE:   # dead, not reaped
                time.sleep(0.01)
            failed_children.append(died)
            raise RuntimeError("Timed out waiting for file .../gcs_server_port")
        second_starts.append((kwargs, failed_children[0].poll()))

    monkeypatch.setattr(ray, "init", init_whose_node_times_out_once)
    with caplog.at_level(logging.WARNING, logger="specserve.cluster.local"):
        init_local_ray(num_cpus=1, include_dashboard=False)
    (kwargs, first_exit), = second_starts
    assert kwargs["num_cpus"] == 1 and kwargs["include_dashboard"] is False
    assert first_exit is not None  # ended before the second try
    sleeping, died = failed_children
    assert f"sleep (pid {sleeping.pid}): sleeping" in caplog.text
    assert f"sh (pid {died.pid}): killed by SIGKILL" in caplog.text


def test_a_ray_start_that_fails_twice_is_a_startup_error(monkeypatch):
    def init_that_never_comes_up(**kwargs):
        raise RuntimeError("The current node timed out during startup.")

    monkeypatch.setattr(ray, "init", init_that_never_comes_up)
    with pytest.raises(StartupError, match="Ray did not start on this machine: The current node timed out"):
        init_local_ray(num_cpus=1)
