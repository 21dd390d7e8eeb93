"""Ports for the servers a command or test starts (extproc.ops.processes.free_port)."""

from __future__ import annotations

import socket

import pytest

from extproc.ops import processes
from extproc.ops.processes import LOWEST_PORT, _ephemeral_range, free_port


def test_ports_are_free_distinct_and_outside_the_range_outgoing_connections_use() -> None:
    """A port in the kernel's ephemeral range can be taken by an outgoing connection
    between the pick and the server's bind; one below it cannot."""
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(LOWEST_PORT <= port < low for port in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_a_socket_holds_or_lately_handed_out_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handed = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        spare = free_port()
        tries = iter([taken, handed, taken, spare + 1, spare + 2, spare + 3])
        monkeypatch.setattr(processes.random, "randrange", lambda a, b: next(tries))
        assert free_port() in (spare + 1, spare + 2, spare + 3)
