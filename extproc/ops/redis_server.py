"""A throwaway local Redis for replicas: ``fairlane up --replicas N`` and the tests.

Debian's ``redis-server`` (``scripts/setup-tools`` installs it), on loopback, with nothing
written to disk (``--save '' --appendonly no``): the replicas' state is soft, rebuilt from
the replicas within one exchange after a restart, so persisting it would only replay
stale leases.
"""

from __future__ import annotations

import shutil

from extproc.ops.processes import Child, ProcessGroup, wait_port_open

MISSING = (
    "redis-server is not on PATH; scripts/setup-tools installs Debian's package, or by hand: "
    "apt-get update && apt-get install -y --no-install-recommends redis-server"
)


class RedisMissing(RuntimeError):
    def __init__(self) -> None:
        super().__init__(MISSING)


def require_redis_server() -> str:
    """The path of ``redis-server``, or ``RedisMissing`` (saying how to install it): checked
    before anything starts when replicas are asked for."""
    path = shutil.which("redis-server")
    if path is None:
        raise RedisMissing()
    return path


def redis_argv(port: int, host: str = "127.0.0.1") -> list[str]:
    """The command line of a loopback Redis that keeps nothing on disk."""
    return [
        require_redis_server(),
        "--port",
        str(port),
        "--bind",
        host,
        "--save",
        "",
        "--appendonly",
        "no",
    ]


def start_redis(group: ProcessGroup, port: int, name: str = "redis") -> Child:
    """Start Redis on 127.0.0.1:``port`` in ``group`` and wait until it accepts clients."""
    child = group.start(name, redis_argv(port))
    wait_port_open(port, child, timeout=10.0)
    return child


def redis_url(port: int, db: int = 0) -> str:
    return f"redis://127.0.0.1:{port}/{db}"
