"""Start-up truth: a busy HTTP port fails `specserve serve` at once, naming the port, before Ray starts."""

import socket

import pytest
import ray

from cluster.config import SpecServeConfig
from cluster.local import PortInUseError, check_port_free, start_local


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
    from cluster import cli

    monkeypatch.setenv("SPECSERVE__HTTP__PORT", str(busy_port))
    with pytest.raises(SystemExit) as info:
        cli.main(["serve"])
    assert info.value.code == 2
    assert f"port {busy_port} is already in use" in capsys.readouterr().err
    assert not ray.is_initialized()
