"""Serve's high-throughput data plane (cluster/serve_data_plane.py): what a local cluster's processes
get, that a user's own setting or no HAProxy binary leaves the environment alone, that two
clusters on one machine do not fight over Serve's fixed fallback-proxy ports, and that the
launcher Serve is pointed at ends HAProxy with the process that started it."""

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from specserve.cluster.serve_data_plane import (DRAIN_FLOOR, FALLBACK_PROXY_PORTS, HAPROXY_BINARY_ENV,
                                                HIGH_THROUGHPUT_ENV, LOCAL_DRAIN_FLOOR_S, added_to_environment,
                                                free_ports, haproxy_found, local_cluster_env, parent_bound_launcher)


def found() -> bool:
    return True


def bound() -> str:
    return "/cache/bin/bound-haproxy"


def test_both_switches_come_together_with_a_local_drain_floor_free_fallback_ports_and_a_bound_haproxy():
    added = local_cluster_env({"PATH": "/usr/bin"}, found, ports=lambda count: [41001, 41002][:count],
                              launcher=bound)
    assert added == {**HIGH_THROUGHPUT_ENV, DRAIN_FLOOR: LOCAL_DRAIN_FLOOR_S,
                     "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": "41001", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": "41002",
                     HAPROXY_BINARY_ENV: "/cache/bin/bound-haproxy"}
    assert set(HIGH_THROUGHPUT_ENV) == {"RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_THROUGHPUT_OPTIMIZED"}


def test_settings_the_user_chose_stand():
    chosen = {DRAIN_FLOOR: "30", FALLBACK_PROXY_PORTS[0]: "8500", FALLBACK_PROXY_PORTS[1]: "9500",
              HAPROXY_BINARY_ENV: "/opt/haproxy"}
    assert local_cluster_env(chosen, found, launcher=bound) == HIGH_THROUGHPUT_ENV


def test_without_a_launcher_that_runs_serve_runs_its_binary_itself():
    added = local_cluster_env({}, found, ports=lambda count: [41001, 41002][:count], launcher=lambda: None)
    assert HAPROXY_BINARY_ENV not in added and set(HIGH_THROUGHPUT_ENV) <= set(added)


@pytest.mark.parametrize("name", sorted(HIGH_THROUGHPUT_ENV))
@pytest.mark.parametrize("value", ["0", "1"])
def test_a_user_who_sets_either_switch_decides_alone(name, value):
    """Either switch alone gains little (docs/performance.md), so nothing is added beside the user's."""
    assert local_cluster_env({name: value}, found) == {}


def test_without_an_haproxy_binary_serves_proxy_stays():
    assert local_cluster_env({}, found=lambda: False) == {}


def test_fallback_ports_are_distinct_and_free():
    ports = free_ports(2)
    assert len(set(ports)) == 2
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("", port))


def test_the_environment_is_as_it_was_after_the_start():
    environ = {"KEPT": "1", DRAIN_FLOOR: "5"}
    with added_to_environment({DRAIN_FLOOR: "2", "ADDED": "1"}, environ):
        assert environ == {"KEPT": "1", DRAIN_FLOOR: "2", "ADDED": "1"}
    assert environ == {"KEPT": "1", DRAIN_FLOOR: "5"}
    with pytest.raises(RuntimeError), added_to_environment({"ADDED": "1"}, environ):
        raise RuntimeError("a start that fails")
    assert environ == {"KEPT": "1", DRAIN_FLOOR: "5"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ray[serve] bundles HAProxy on Linux only")
def test_ray_serve_installs_an_haproxy_binary_here():
    assert haproxy_found()


# A parent that starts the launcher, says the launcher's pid, and waits to be killed.
PARENT = "import subprocess, sys, time; print(subprocess.Popen(sys.argv[1:]).pid, flush=True); time.sleep(600)"


def ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_launcher_becomes_its_binary_and_ends_when_its_parent_is_killed(tmp_path):
    """The launcher runs the binary with its arguments in its own pid (Serve signals that pid on
    reloads); SIGKILL the process that started it, and the binary gets SIGTERM. Without the
    launcher the same binary outlives its parent (the test can fail)."""
    sleep = "/bin/sleep"
    launcher = parent_bound_launcher(sleep, tmp_path, check=["0"])
    assert launcher is not None and os.access(launcher, os.X_OK)
    assert parent_bound_launcher(sleep, tmp_path, check=["0"]) == launcher   # written once, then found
    for command, outlives in (([str(launcher), "600"], False), ([sleep, "600"], True)):
        parent = subprocess.Popen([sys.executable, "-c", PARENT, *command], stdout=subprocess.PIPE, text=True)
        child = int(parent.stdout.readline())
        try:
            deadline = time.monotonic() + 10
            while psutil.Process(child).cmdline() != [sleep, "600"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert psutil.Process(child).cmdline() == [sleep, "600"]
            parent.send_signal(signal.SIGKILL)
            parent.wait()
            deadline = time.monotonic() + (2 if outlives else 10)
            while not ended(child) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ended(child) != outlives, command
        finally:
            if not ended(child):
                os.kill(child, signal.SIGKILL)


def test_a_launcher_that_does_not_run_here_is_none(tmp_path):
    """Checked by running it (`-v`): a binary that fails there leaves Serve to run its own."""
    assert parent_bound_launcher("/bin/false", tmp_path) is None
