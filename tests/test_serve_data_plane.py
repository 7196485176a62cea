"""Serve's high-throughput data plane (cluster/serve_data_plane.py): what a local cluster's processes
get, that a user's own setting or no HAProxy binary leaves the environment alone, and that two
clusters on one machine do not fight over Serve's fixed fallback-proxy ports."""

import socket
import sys

import pytest

from specserve.cluster.serve_data_plane import (DRAIN_FLOOR, FALLBACK_PROXY_PORTS, HIGH_THROUGHPUT_ENV,
                                                LOCAL_DRAIN_FLOOR_S, added_to_environment, free_ports,
                                                haproxy_found, local_cluster_env)


def found() -> bool:
    return True


def test_both_switches_come_together_with_a_local_drain_floor_and_free_fallback_ports():
    added = local_cluster_env({"PATH": "/usr/bin"}, found, ports=lambda count: [41001, 41002][:count])
    assert added == {**HIGH_THROUGHPUT_ENV, DRAIN_FLOOR: LOCAL_DRAIN_FLOOR_S,
                     "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": "41001", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": "41002"}
    assert set(HIGH_THROUGHPUT_ENV) == {"RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_THROUGHPUT_OPTIMIZED"}


def test_settings_the_user_chose_stand():
    chosen = {DRAIN_FLOOR: "30", FALLBACK_PROXY_PORTS[0]: "8500", FALLBACK_PROXY_PORTS[1]: "9500"}
    assert local_cluster_env(chosen, found) == HIGH_THROUGHPUT_ENV


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
