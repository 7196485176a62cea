"""Processes of `specserve serve` killed outright (SIGKILL, as the OOM killer does), on the real
CLI with HAProxy run through specserve's launcher (cluster/serve_data_plane.py): kill Serve's
HAProxy manager, and its HAProxy ends and the manager Serve starts in its place serves HTTP again
(through the launcher: start, reload); kill the CLI, and its port is free again with no HAProxy
left. Without the launcher a killed server's HAProxy outlived it in four of five trials here,
holding the HTTP port and HAProxy's fixed stats ports for the next start to fail on, and in others
the manager's own exit ended it: so this test shows the launcher serving, and
tests/test_serve_data_plane.py (a deterministic child) shows the binding. One start, in its own
session so every process it spawns can be found after."""

import signal
import time

import httpx
import psutil
import pytest

from specserve.cluster.local import PortInUseError, check_port_free
from tests.local_server import free_port, session_processes, start_cli_server, wait_until_serving
from tests.test_serve_data_plane import ended

pytestmark = [pytest.mark.ray, pytest.mark.slow]   # make reliability: a whole CLI start costs a minute

PORT_FREED_WITHIN_S = 30
SERVING_AGAIN_WITHIN_S = 120


def port_free(port: int) -> bool:
    try:
        check_port_free("127.0.0.1", port)
    except PortInUseError:
        return False
    return True


def _named(session: int, name: str) -> list[psutil.Process]:
    return [process for process in session_processes(session) if name in " ".join(process.cmdline())]


def _wait(condition, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.25)
    return condition()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/v1/models", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_haproxy_ends_with_its_manager_and_with_the_server(tmp_path):
    """Kill the HAProxy manager: its HAProxy ends, Serve's replacement serves HTTP again. Then
    kill the CLI: the port is free again and no HAProxy is left."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    server = start_cli_server(port, log_path)
    try:
        wait_until_serving(server, log_path)
        first = _named(server.pid, "bin/haproxy")
        assert first, "the data plane runs HAProxy (tests/test_serve_data_plane.py checks it is installed)"
        for manager in _named(server.pid, "ray::HAProxyManager"):
            manager.kill()
        assert _wait(lambda: all(ended(process.pid) for process in first), 10), [process.cmdline() for process in first]
        assert _wait(lambda: _answers(url), SERVING_AGAIN_WITHIN_S), log_path.read_text()

        running = _named(server.pid, "bin/haproxy")
        server.send_signal(signal.SIGKILL)   # the CLI alone
        server.wait()
        assert _wait(lambda: port_free(port), PORT_FREED_WITHIN_S), [" ".join(p.cmdline()) for p in
                                                                     session_processes(server.pid)]
        assert all(ended(process.pid) for process in running)
    finally:
        for process in session_processes(server.pid):   # Ray's agents end on their own, later
            try:
                process.kill()
            except psutil.Error:
                pass
