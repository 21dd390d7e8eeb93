"""Shared fixtures: free ports, a process group that always stops what a test started, a
real Redis, and a model's tokenizer files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.ops.processes import Child, ProcessGroup, free_port
from extproc.ops.redis_server import RedisMissing, redis_url, start_redis

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding the tiny model's tokenizer and chat template (a byte-level
    BPE with special role tokens, trained offline in a fraction of a second by
    ``loadtests.conformance.tiny_model``), for the engine-tokenizer paths."""
    from loadtests.conformance.tiny_model import build_tokenizer

    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(directory)
    return directory


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


class RedisServer:
    """A real ``redis-server`` on a free loopback port, which a test may stop and restart
    (empty: it keeps nothing on disk) on the same port."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.port = free_port()
        self.url = redis_url(self.port)
        self.child: Child | None = None

    def start(self) -> None:
        try:
            self.child = start_redis(self.group, self.port, name=f"redis-{self.port}")
        except RedisMissing as missing:
            pytest.fail(str(missing), pytrace=False)

    def stop(self) -> None:
        """SIGKILL: what a crashed or unreachable Redis looks like to the replicas."""
        if self.child is not None:
            self.child.popen.kill()
            self.child.popen.wait()
            self.child = None


@pytest.fixture
def redis_server(processes: ProcessGroup) -> RedisServer:
    """A running Redis; stopped with ``processes`` at teardown."""
    server = RedisServer(processes)
    server.start()
    return server
