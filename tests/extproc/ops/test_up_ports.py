"""A port the user fixes for ``fairlane up`` that is already taken is named, with the
component that wanted it, before anything is started."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.ops.processes import PortInUse, ProcessGroup, ensure_port_free, free_port
from extproc.ops.up import Stack, StackConfig


@pytest.fixture
def taken() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_ensure_port_free_names_port_and_component(taken: int) -> None:
    with pytest.raises(
        PortInUse, match=rf"port {taken} on 127.0.0.1 \(the thing\) is already in use"
    ):
        ensure_port_free(taken, "the thing")
    ensure_port_free(free_port(), "the thing")


@pytest.mark.parametrize(
    ("field", "what"),
    [("port", "Envoy's client listener, --port"), ("admin_port", "Envoy's admin interface")],
)
def test_stack_refuses_a_taken_fixed_port_before_starting(
    taken: int, field: str, what: str, tmp_path: Path
) -> None:
    config = StackConfig(port=free_port())
    setattr(config, field, taken)
    with ProcessGroup(tmp_path) as group:
        with pytest.raises(PortInUse, match=f"port {taken} on 127.0.0.1 \\({what}"):
            Stack(config, group).start()
        assert group.children == []
