"""The ports of a multi-process test cluster (tests/local_server.PortReservation): distinct, held
until taken, then free for the process that binds them."""

import socket

import pytest

from tests.local_server import PortReservation


def _bindable(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def test_reserved_ports_are_distinct_and_held_until_taken():
    with PortReservation(20) as ports:
        first = ports.take(2)
        assert all(_bindable(port) for port in first)  # taken: free for the node about to start
        rest = ports.take(18)
        assert len(set(first + rest)) == 20
    held = PortReservation(6)
    try:
        # Still held: no other process (another node, a port drawn meanwhile) can have them.
        reserved = list(held.held)
        assert not any(_bindable(port) for port in reserved)
        assert not any(_bindable(port, "0.0.0.0") for port in reserved)
        assert held.take(4) == reserved[:4] and all(_bindable(port) for port in reserved[:4])
        assert not any(_bindable(port) for port in reserved[4:])
    finally:
        held.close()
    assert all(_bindable(port) for port in reserved)


def test_taking_more_than_reserved_is_refused():
    with PortReservation(2) as ports:
        ports.take(1)
        with pytest.raises(ValueError, match="1 left"):
            ports.take(2)
    with pytest.raises(ValueError, match="at least one"):
        PortReservation(0)
