"""Shared fixtures: free ports and a process group that always stops what a test started."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.ops.processes import ProcessGroup, free_port

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[ProcessGroup]:
    """Children started through this group are stopped at teardown, also when the test fails."""
    group = ProcessGroup(tmp_path / "logs")
    try:
        yield group
    finally:
        group.stop()
