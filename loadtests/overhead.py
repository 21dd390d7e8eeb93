"""``python -m loadtests.overhead``: what the gateway itself costs.

Two arms against the same instant backend, one after the other:

* ``direct``: Envoy without ext_proc straight to the backend
  (:func:`extproc.envoy_config.render_fifo_bootstrap`);
* ``fairlane``: the same Envoy with the ext_proc filter and the completion access log, and one
  fairlane service process whose policy (``loadtests/scenarios/policies/overhead.yaml``)
  never holds a request.

Each arm is driven at fixed request rates (open loop: request *i* is sent at ``t0 + i/rate``
whatever is still outstanding, on a new connection when all are busy, so a stall is not
hidden by coordinated omission; latency counts from the actual send, and how late the
generator's timer sent is reported separately, ``send_late_p99_ms``) and then
closed-loop at saturation. The report gives p50/p99 per rate, fairlane minus direct, the
maximum requests/s and every process's CPU (service cores at saturation -> req/s per core).

The backend is :func:`serve_backend` below: a raw asyncio HTTP/1.1 server (uvloop) that
answers every POST at once with a 1-token chat completion and serves a static vLLM
``/metrics`` page (an empty engine) so the service's gates always pass. The load generator is
:class:`LoadGenerator`, raw asyncio keep-alive connections in this process (one core), its CPU
recorded and warned about like the bench harness's (``loadtests/bench/cpu.py``).

``python -m loadtests.overhead --rates 100,500,1000 --duration 10``
``python -m loadtests.overhead backend --port 8000`` (the instant backend alone)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc import envoy_config
from extproc.backends import BackendSpec
from extproc.processes import ProcessGroup, free_port, wait_http_ready
from extproc.stack import Stack, StackConfig
from loadtests.bench.cpu import machine_busy_seconds, process_cpu_seconds, self_cpu_seconds

POLICY = Path(__file__).parent / "scenarios" / "policies" / "overhead.yaml"
API_KEY = "sk-overhead"
BODY = json.dumps(
    {
        "model": "sim-llama-8b",
        "messages": [{"role": "user", "content": "Say hello in one word, please."}],
        "max_tokens": 1,
    }
).encode()

# --------------------------------------------------------------------------- instant backend

_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-overhead",
        "object": "chat.completion",
        "created": 0,
        "model": "sim-llama-8b",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
    }
).encode()
_METRICS = (
    b'vllm:num_requests_running{model_name="sim-llama-8b"} 0\n'
    b'vllm:num_requests_waiting{model_name="sim-llama-8b"} 0\n'
    b'vllm:kv_cache_usage_perc{model_name="sim-llama-8b"} 0\n'
    b'vllm:inter_token_latency_seconds_sum{model_name="sim-llama-8b"} 0\n'
    b'vllm:inter_token_latency_seconds_count{model_name="sim-llama-8b"} 0\n'
    b'vllm:cache_config_info{block_size="16",num_gpu_blocks="100000"} 1\n'
)


def _response(status: str, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


_ANSWERS: dict[object, bytes] = {
    "POST": _response("200 OK", _COMPLETION, "application/json"),
    b"/metrics": _response("200 OK", _METRICS, "text/plain; version=0.0.4"),
    b"/health": _response("200 OK", b"", "text/plain"),
}


class _BackendProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, requests with ``content-length`` bodies, answered at once."""

    def __init__(self) -> None:
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            method, _, rest = head.partition(b" ")
            path = rest.split(b" ", 1)[0]
            answer = _ANSWERS["POST"] if method == b"POST" else _ANSWERS.get(path)
            assert self.transport is not None
            self.transport.write(answer or _response("404 Not Found", b"", "text/plain"))


async def serve_backend(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_BackendProtocol, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# --------------------------------------------------------------------------- load generator


class _ClientProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.waiter: asyncio.Future[int] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed"))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end]
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(self.buffer) < end + 4 + length:
            return
        self.buffer = self.buffer[end + 4 + length :]
        status = int(head[9:12])
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(status)


@dataclass
class RunResult:
    """One load phase of one arm."""

    mode: str
    """``rate`` (open loop at ``target_rps``) or ``saturation`` (closed loop)."""
    target_rps: float | None
    duration_s: float
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    late_ms: list[float] = field(default_factory=list)
    """Open loop: how late each request was sent (ms)."""
    cpu_s: dict[str, float] = field(default_factory=dict)
    loadgen_cpu_s: float = 0.0
    machine_busy_fraction: float = 0.0


class LoadGenerator:
    """Raw HTTP/1.1 keep-alive POSTs to one Envoy, from this process's event loop."""

    def __init__(self, port: int, path: str = "/v1/chat/completions") -> None:
        self.port = port
        self.request = (
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"authorization: Bearer {API_KEY}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(BODY)}\r\n\r\n"
        ).encode() + BODY
        self.idle: list[_ClientProtocol] = []
        self.late_ms: list[float] = []

    async def _connection(self) -> _ClientProtocol:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(_ClientProtocol, "127.0.0.1", self.port)
        return protocol

    async def one(self) -> int:
        """Send one request; the response's status (0 on a connection error)."""
        conn = await self._connection()
        loop = asyncio.get_running_loop()
        conn.waiter = loop.create_future()
        assert conn.transport is not None
        conn.transport.write(self.request)
        try:
            status = await conn.waiter
        except ConnectionError:
            return 0
        self.idle.append(conn)
        return status

    async def open_loop(self, rate: float, duration: float) -> tuple[list[float], int]:
        """Requests due at ``t0 + i / rate``; latency from the send to the response.

        ``self.late_ms`` gets how late each was sent (the event loop's timer granularity,
        about 1 ms on uvloop, or a busy generator)."""
        latencies: list[float] = []
        errors = 0
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()

        self.late_ms = []

        async def send(due: float) -> None:
            nonlocal errors
            start = time.perf_counter()
            self.late_ms.append((start - due) * 1000)
            status = await self.one()
            if status == 200:
                latencies.append((time.perf_counter() - start) * 1000)
            else:
                errors += 1

        count = int(rate * duration)
        t0 = time.perf_counter() + 0.05
        for i in range(count):
            due = t0 + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = loop.create_task(send(due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        return latencies, errors

    async def closed_loop(self, concurrency: int, duration: float) -> tuple[list[float], int]:
        """``concurrency`` connections, each sending the next request when one returns."""
        latencies: list[float] = []
        errors = 0
        loop = asyncio.get_running_loop()
        stop = loop.time() + duration

        async def worker() -> None:
            nonlocal errors
            while loop.time() < stop:
                start = time.perf_counter()
                status = await self.one()
                if status == 200:
                    latencies.append((time.perf_counter() - start) * 1000)
                else:
                    errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, errors


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(run: RunResult) -> dict[str, Any]:
    """The reported numbers of one phase."""
    done = len(run.latencies_ms)
    achieved = done / run.duration_s if run.duration_s > 0 else 0.0
    service_cpu = run.cpu_s.get("service")
    return {
        "mode": run.mode,
        "target_rps": run.target_rps,
        "achieved_rps": round(achieved, 1),
        "requests": done,
        "errors": run.errors,
        "send_late_p99_ms": _round(percentile(run.late_ms, 99)),
        "p50_ms": _round(percentile(run.latencies_ms, 50)),
        "p99_ms": _round(percentile(run.latencies_ms, 99)),
        "cpu_cores": {k: round(v / run.duration_s, 3) for k, v in run.cpu_s.items()},
        "loadgen_cores": round(run.loadgen_cpu_s / run.duration_s, 3),
        "machine_busy": round(run.machine_busy_fraction, 3),
        "rps_per_service_core": (
            round(done / service_cpu, 0) if service_cpu and service_cpu > 0 else None
        ),
    }


def added_latency(direct: dict[str, Any], fairlane: dict[str, Any]) -> dict[str, float | None]:
    """fairlane minus direct at the same phase, for p50 and p99 (ms)."""
    return {
        key: _round(fairlane[key] - direct[key])
        if fairlane.get(key) is not None and direct.get(key) is not None
        else None
        for key in ("p50_ms", "p99_ms")
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def render_report(results: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> str:
    """report.md: per phase, both arms' p50/p99, the added latency, CPU per process."""
    lines = [
        "# fairlane overhead: Envoy direct vs Envoy + fairlane ext_proc",
        "",
        f"- load generator: {meta['loadgen']}",
        f"- backend: {meta['backend']}",
        f"- machine: {meta['cpus']} cores; phase duration {meta['duration_s']} s",
        "",
        "| phase | arm | req/s | p50 ms | p99 ms | added p50 | added p99 | errors "
        "| service cores | envoy cores | backend cores | loadgen cores | machine busy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    direct = results.get("direct", [])
    fairlane = results.get("fairlane", [])
    for index in range(max(len(direct), len(fairlane))):
        for arm, rows in (("direct", direct), ("fairlane", fairlane)):
            if index >= len(rows):
                continue
            row = rows[index]
            phase = f"{row['target_rps']:g} req/s" if row["mode"] == "rate" else "saturation"
            added: dict[str, float | None] = {"p50_ms": None, "p99_ms": None}
            if arm == "fairlane" and index < len(direct):
                added = added_latency(direct[index], row)
            cores = row["cpu_cores"]
            lines.append(
                f"| {phase} | {arm} | {row['achieved_rps']} | {row['p50_ms']} | {row['p99_ms']}"
                f" | {_fmt(added['p50_ms'])} | {_fmt(added['p99_ms'])} | {row['errors']}"
                f" | {_fmt(cores.get('service'))} | {_fmt(cores.get('envoy'))}"
                f" | {_fmt(cores.get('backend'))} | {row['loadgen_cores']}"
                f" | {row['machine_busy']} |"
            )
    for row in fairlane:
        if row["mode"] == "saturation":
            lines += [
                "",
                f"Saturation through fairlane: {row['achieved_rps']} req/s with the service at "
                f"{_fmt(row['cpu_cores'].get('service'))} cores = "
                f"{_fmt(row['rps_per_service_core'])} req/s per service core.",
            ]
    warnings = []
    for arm, rows in results.items():
        for row in rows:
            if row["loadgen_cores"] > 0.85:
                warnings.append(f"{arm}: load generator at {row['loadgen_cores']} cores")
            if (row.get("send_late_p99_ms") or 0) > 2:
                warnings.append(f"{arm}: sends {row['send_late_p99_ms']} ms late at p99")
            if row["machine_busy"] > 0.9:
                warnings.append(f"{arm}: machine {row['machine_busy']:.0%} busy")
    if warnings:
        lines += ["", "Warnings (numbers at these phases measure the machine too):", ""]
        lines += [f"- {w}" for w in warnings]
    return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


# --------------------------------------------------------------------------- arms


def start_backend(group: ProcessGroup) -> BackendSpec:
    port = free_port()
    child = group.start(
        "backend", [sys.executable, "-m", "loadtests.overhead", "backend", "--port", str(port)]
    )
    spec = BackendSpec("127.0.0.1", port, "local")
    wait_http_ready(f"{spec.url}/health", child, timeout=30)
    return spec


def start_arm(arm: str, group: ProcessGroup) -> tuple[int, dict[str, int]]:
    """Start ``arm``'s processes; (Envoy's client port, pids by role)."""
    backend = start_backend(group)
    if arm == "direct":
        port, admin = free_port(), free_port()
        params = envoy_config.EnvoyParams(listen_port=port, admin_port=admin, backends=(backend,))
        path = group.log_dir / "envoy-direct.yaml"
        path.write_text(yaml.safe_dump(envoy_config.render_fifo_bootstrap(params), sort_keys=False))
        envoy = group.start("envoy", envoy_config.envoy_argv(path))
        wait_http_ready(f"http://127.0.0.1:{admin}/ready", envoy, timeout=30)
    else:
        port = free_port()
        Stack(StackConfig(port=port, policy_path=POLICY, backends=(backend,)), group).start()
    pids = {child.name: child.popen.pid for child in group.children}
    return port, pids


async def _measure(
    gen: LoadGenerator, pids: dict[str, int], mode: str, rate: float | None, args: Any
) -> RunResult:
    before = {name: process_cpu_seconds(pid) or 0.0 for name, pid in pids.items()}
    self_before = self_cpu_seconds()
    busy0, total0 = machine_busy_seconds()
    start = time.monotonic()
    if mode == "rate":
        assert rate is not None
        latencies, errors = await gen.open_loop(rate, args.duration)
        late = gen.late_ms
    else:
        latencies, errors = await gen.closed_loop(args.concurrency, args.duration)
    elapsed = time.monotonic() - start
    busy1, total1 = machine_busy_seconds()
    result = RunResult(mode, rate, elapsed if mode != "rate" else max(elapsed, args.duration))
    result.latencies_ms, result.errors = latencies, errors
    if mode == "rate":
        result.late_ms = late
    for name, pid in pids.items():
        after = process_cpu_seconds(pid)
        if after is not None:
            result.cpu_s[name] = after - before[name]
    result.loadgen_cpu_s = self_cpu_seconds() - self_before
    result.machine_busy_fraction = (busy1 - busy0) / max(total1 - total0, 1e-9)
    return result


async def _drive(port: int, pids: dict[str, int], args: Any) -> list[dict[str, Any]]:
    gen = LoadGenerator(port)
    for _ in range(200):  # warm up: connections, Envoy's upstream pool, the service's stream
        await gen.one()
    rows = []
    for rate in args.rates:
        rows.append(summarize(await _measure(gen, pids, "rate", rate, args)))
        print(f"  {rows[-1]}", flush=True)
    if args.concurrency > 0:
        rows.append(summarize(await _measure(gen, pids, "saturation", None, args)))
        print(f"  {rows[-1]}", flush=True)
    return rows


def run(args: argparse.Namespace) -> int:
    out = args.out or Path("/tmp/fairlane-bench") / f"overhead-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {}
    for arm in args.arms:
        print(f"arm {arm}", flush=True)
        with ProcessGroup(out / "logs" / arm) as group:
            port, pids = start_arm(arm, group)
            pids = {_role(name): pid for name, pid in pids.items()}
            results[arm] = _run_loop(_drive(port, pids, args))
    meta = {
        "loadgen": "in-process asyncio (uvloop) raw HTTP/1.1 keep-alive client, one core; "
        "open loop at fixed rates, closed loop at saturation "
        f"({args.concurrency} connections)",
        "backend": "loadtests/overhead.py instant backend (1-token completion, no delay)",
        "cpus": os.cpu_count(),
        "duration_s": args.duration,
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "arms": results}, indent=2))
    report = render_report(results, meta)
    (out / "report.md").write_text(report)
    print(report)
    print(f"written to {out}")
    return 0


def _role(name: str) -> str:
    return "backend" if name.startswith("backend") else name


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    return uvloop.run(coro)


def _rates(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.overhead", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    backend = sub.add_parser("backend", help="the instant backend alone")
    backend.add_argument("--port", type=int, required=True)
    parser.add_argument("--rates", type=_rates, default=[100.0, 500.0, 1000.0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    parser.add_argument(
        "--concurrency", type=int, default=32, help="connections at saturation (0: skip)"
    )
    parser.add_argument("--arms", type=lambda s: s.split(","), default=["direct", "fairlane"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "backend":
        _run_loop(serve_backend(args.port))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
