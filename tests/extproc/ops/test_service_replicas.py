"""The service processes ``fairlane up`` starts: their command lines, the Redis check that
runs before anything starts, and ``--replicas``. No processes (tests/integration/test_up.py
runs them)."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from extproc.fleet.backend import BackendSpec
from extproc.ops import cli
from extproc.ops.processes import ProcessGroup
from extproc.ops.redis_server import RedisMissing, require_redis_server
from extproc.ops.service_replicas import service_argv, start_services
from extproc.ops.up import Stack, StackConfig

BACKENDS = (BackendSpec("127.0.0.1", 8101, "region-a", seats=8),)


def flags(argv: list[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for key, value in pairwise(argv):
        if key.startswith("--"):
            found.setdefault(key[2:], []).append(value)
    return found


def test_one_service_runs_without_state() -> None:
    argv = service_argv(50051, 9090, Path("p.yaml"), BACKENDS)
    assert argv[argv.index("-m") + 1 : argv.index("-m") + 3] == ["extproc", "serve"]
    assert flags(argv) == {
        "port": ["50051"],
        "metrics-port": ["9090"],
        "policy": ["p.yaml"],
        "backend": ["region-a=http://127.0.0.1:8101#seats=8"],
    }


def test_a_replica_names_its_redis_and_itself() -> None:
    argv = service_argv(50052, 9091, Path("p.yaml"), BACKENDS, "redis://127.0.0.1:7/0", "r2")
    assert flags(argv)["state"] == ["redis://127.0.0.1:7/0"]
    assert flags(argv)["replica-id"] == ["r2"]


def test_without_redis_server_replicas_fail_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(RedisMissing, match="scripts/setup-tools"):
        require_redis_server()
    with ProcessGroup(tmp_path) as group:
        with pytest.raises(RedisMissing, match="apt-get install"):
            Stack(StackConfig(port=0, replicas=2), group).start()
        assert group.children == []  # not even the simulators


def test_replicas_take_free_ports_only(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path) as group:
        with pytest.raises(ValueError, match="free ports"):
            Stack(StackConfig(replicas=2, service_port=50051), group).start()
        with pytest.raises(ValueError, match="at least one"):
            start_services(group, 0, Path("p.yaml"), BACKENDS)
        assert group.children == []


@pytest.mark.parametrize(("value", "expected"), [([], 1), (["--replicas", "3"], 3)])
def test_up_takes_a_replica_count(value: list[str], expected: int) -> None:
    args = cli.build_parser("up").parse_args(["up", *value])
    assert args.replicas == expected


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_up_refuses_a_bad_replica_count(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser("up").parse_args(["up", "--replicas", bad])
    assert "must be a whole number >= 1" in capsys.readouterr().err
