"""vllm-router in front of the engines: its command line, and starting it.

The router is one process (a Python launcher around its Rust core) with every engine a
worker (``--worker-urls``) and one routing ``--policy``. Its Prometheus endpoint gets a port
of its own (its default, 29000, would collide with anything else on the machine). For
``kv_aware`` each engine's KV event endpoints are given statically (``--kv-event-source
URL=tcp://HOST:PORT``, the replay socket likewise), with the model every worker serves and
the block size the engines hash with; the router subscribes to them and asks the engines
for a prompt's ids (``/v1/chat/completions/render``, then ``/tokenize``). Everything else
(retries, circuit breaker, its queue of 100 behind 32,768 concurrent requests) is left at
the router's defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from extproc.fleet.backend import BackendSpec
from extproc.ops.processes import ProcessGroup, free_port, wait_http_ready
from loadtests.bench.peers.install import VLLM_ROUTER, require

READY_TIMEOUT_S = 60.0
"""The router answers ``/health`` once every worker answered its own."""


@dataclass(frozen=True)
class KvSources:
    """What ``kv_aware`` needs beside the workers: the model they serve and their block size."""

    model: str
    block_size: int


def _tcp(backend: BackendSpec, port: int) -> str:
    host = f"[{backend.host}]" if ":" in backend.host else backend.host
    return f"tcp://{host}:{port}"


def kv_flags(backends: Sequence[BackendSpec], kv: KvSources) -> list[str]:
    """``--kv-event-source`` (and ``--kv-event-replay-source``) per engine; ValueError when
    an engine names no KV events port (``kv_aware`` would have nothing to follow)."""
    silent = [b.url for b in backends if b.kv_events is None]
    if silent:
        raise ValueError(
            "vllm-router's kv_aware follows the engines' KV events: no kv-events port for "
            f"{', '.join(silent)} (give --backend URL#kv-events=PORT,kv-replay=PORT)"
        )
    flags: list[str] = []
    for b in backends:
        assert b.kv_events is not None
        flags += ["--kv-event-source", f"{b.url}={_tcp(b, b.kv_events.port)}"]
        if b.kv_events.replay_port is not None:
            flags += ["--kv-event-replay-source", f"{b.url}={_tcp(b, b.kv_events.replay_port)}"]
    return [
        *flags,
        "--kv-event-block-size",
        str(kv.block_size),
        "--kv-event-model",
        kv.model,
    ]


def router_argv(
    binary: Path,
    port: int,
    metrics_port: int,
    backends: Sequence[BackendSpec],
    policy: str,
    kv: KvSources | None = None,
) -> list[str]:
    """The router's command line: loopback only, every backend a worker, ``policy``."""
    argv = [
        str(binary),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--policy",
        policy,
        "--worker-urls",
        *(b.url for b in backends),
        "--log-level",
        "warning",
    ]
    if kv is not None:
        argv += kv_flags(backends, kv)
    return argv


def start_vllm_router(
    group: ProcessGroup,
    backends: Sequence[BackendSpec],
    policy: str,
    kv: KvSources | None = None,
    name: str = "vllm-router",
) -> str:
    """Start the router in ``group`` and wait until it serves; its base URL."""
    port = free_port()
    argv = router_argv(require(VLLM_ROUTER), port, free_port(), backends, policy, kv)
    child = group.start(name, argv)
    url = f"http://127.0.0.1:{port}"
    wait_http_ready(f"{url}/health", child, timeout=READY_TIMEOUT_S)
    return url
