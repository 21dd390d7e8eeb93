"""The ext_proc service processes of a stack: one, or N replicas sharing a local Redis.

``fairlane up`` (and the tests and benchmarks, through :class:`~extproc.ops.up.Stack`) runs
one service process, as it always has, or with ``--replicas N`` a throwaway Redis
(:mod:`extproc.ops.redis_server`: loopback, nothing on disk) and N ``fairlane serve --state
redis://... --replica-id rI`` processes on ports of their own. Envoy then lists them all
(extproc.envoy.replicas): a request goes to any of them, and every one gets every completion.

Every process is started in the stack's :class:`~extproc.ops.processes.ProcessGroup`, so a
failed start, Ctrl-C or the end of a test stops Redis and the replicas with everything else.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from extproc.fleet.backend import BackendSpec, backend_argument
from extproc.ops.processes import Child, ProcessGroup, free_port, wait_port_open
from extproc.ops.redis_server import redis_url, require_redis_server, start_redis

SINGLE = "service"
"""The process name of the one service (its log is ``service.log``)."""


@dataclass(frozen=True)
class ServiceProcess:
    """One running service process: where its gRPC and metrics ports are."""

    child: Child
    port: int
    metrics_port: int
    replica_id: str | None = None
    """``r1`` .. ``rN`` for replicas; None for the one service."""

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


@dataclass(frozen=True)
class Services:
    """The service processes of a stack, and the Redis they share (replicas only)."""

    processes: tuple[ServiceProcess, ...]
    redis: Child | None = None
    redis_url: str | None = None
    redis_port: int | None = None

    @property
    def replicated(self) -> bool:
        return self.redis is not None

    def alive(self) -> list[ServiceProcess]:
        return [p for p in self.processes if p.child.alive()]

    def find(self, replica_id: str) -> ServiceProcess:
        for process in self.processes:
            if process.replica_id == replica_id:
                return process
        raise KeyError(f"no replica {replica_id!r}")

    def holding(self, child: Child) -> ServiceProcess | None:
        """The service process that ``child`` is (or was), if it is one."""
        return next((p for p in self.processes if p.child is child), None)

    def replacing(self, old: Child, new: Child) -> Services:
        """These services with ``new`` running where ``old`` did (same ports: a restart)."""
        if self.holding(old) is None:
            raise ValueError(f"{old.label} is not one of the service processes")
        return replace(
            self,
            processes=tuple(replace(p, child=new) if p.child is old else p for p in self.processes),
        )


def service_argv(
    port: int,
    metrics_port: int,
    policy_path: Path,
    backends: Sequence[BackendSpec],
    state_url: str | None = None,
    replica_id: str | None = None,
) -> list[str]:
    """The ``fairlane serve`` command line of one service process."""
    argv = [
        sys.executable,
        "-m",
        "extproc",
        "serve",
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--policy",
        str(policy_path),
        *[arg for b in backends for arg in ("--backend", backend_argument(b))],
    ]
    if state_url is not None:
        argv += ["--state", state_url]
    if replica_id is not None:
        argv += ["--replica-id", replica_id]
    return argv


def start_services(
    group: ProcessGroup,
    count: int,
    policy_path: Path,
    backends: Sequence[BackendSpec],
    port: int = 0,
    metrics_port: int = 0,
    shared: bool | None = None,
    extra_args: Sequence[str] = (),
) -> Services:
    """Start the service (``count`` 1, on ``port``/``metrics_port`` when given) or Redis
    and ``count`` replicas on free ports, and wait until every gRPC port accepts.

    ``shared`` (default: ``count > 1``) runs even one service as a replica on a Redis (the
    bench compares the two with one process); ``extra_args`` go to every ``fairlane
    serve`` (e.g. ``--state-period-ms``)."""
    if count < 1:
        raise ValueError(f"the service needs at least one replica, got {count}")
    if shared is None:
        shared = count > 1
    if not shared:
        process = _start(
            group,
            SINGLE,
            port or free_port(),
            metrics_port or free_port(),
            policy_path,
            backends,
            extra_args=extra_args,
        )
        wait_port_open(process.port, process.child)
        return Services((process,))
    require_redis_server()
    redis_port = free_port()
    redis = start_redis(group, redis_port)
    url = redis_url(redis_port)
    processes = tuple(
        _start(
            group,
            f"{SINGLE}-r{i}",
            free_port(),
            free_port(),
            policy_path,
            backends,
            url,
            f"r{i}",
            extra_args,
        )
        for i in range(1, count + 1)
    )
    for process in processes:
        wait_port_open(process.port, process.child)
    return Services(processes, redis, url, redis_port)


def _start(
    group: ProcessGroup,
    name: str,
    port: int,
    metrics_port: int,
    policy_path: Path,
    backends: Sequence[BackendSpec],
    state_url: str | None = None,
    replica_id: str | None = None,
    extra_args: Sequence[str] = (),
) -> ServiceProcess:
    argv = service_argv(port, metrics_port, policy_path, backends, state_url, replica_id)
    argv += extra_args
    return ServiceProcess(group.start(name, argv), port, metrics_port, replica_id)
