"""The overhead measurement's parts: an instant backend, an open/closed-loop load generator
and the per-phase statistics. ``fairlane bench overhead`` (``loadtests/bench/overhead_runner.py``)
runs them; ``python -m loadtests.overhead`` is an alias for it.

The backend is :func:`serve_backend`: a raw asyncio HTTP/1.1 server (uvloop) that answers
every POST at once with a 1-token chat completion and serves a static vLLM ``/metrics`` page
(an empty engine) so the service's gates always pass. It is not the simulator on purpose: the
simulator models engine steps and token timing, work this measurement must not include.

The load generator is :class:`LoadGenerator`, raw asyncio keep-alive connections in the
caller's event loop (one core). Fixed rates are open loop (request *i* is sent at
``t0 + i/rate`` whatever is still outstanding, on a new connection when all are busy, so a
stall is not hidden by coordinated omission); latency counts from the actual send, and how
late the timer sent is kept apart (``send_late_p99_ms``). Saturation is closed loop.

``python -m loadtests.overhead [--rates 100,500 --duration 10 --concurrency 32 --arms ...]``
``python -m loadtests.overhead backend --port 8000`` (the instant backend alone)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from loadtests.bench.report import percentile

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


def _take_message(buffer: bytes) -> tuple[bytes, bytes] | None:
    """Split one whole HTTP/1.1 message (head without its blank line, plus a
    ``content-length`` body) off the front of ``buffer``: ``(head, rest)``, or None while it is
    incomplete. Both ends of the measurement frame messages this way; neither uses chunking."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buffer[:end]
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if len(buffer) < end + 4 + length:
        return None
    return head, buffer[end + 4 + length :]


class _BackendProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, requests with ``content-length`` bodies, answered at once."""

    def __init__(self) -> None:
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (message := _take_message(self.buffer)) is not None:
            head, self.buffer = message
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
        message = _take_message(self.buffer)
        if message is None:
            return
        head, self.buffer = message
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
        """Send one request; the response's status (0 on a connection error: a dead Envoy
        is counted as failed requests, and the runner names the process that died)."""
        try:
            conn = await self._connection()
        except OSError:
            return 0
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


T = TypeVar("T")


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on uvloop (the generator's timers and sockets are cheaper there)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(coro)
    return uvloop.run(coro)


def _rates(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """``backend`` alone, or an alias for ``fairlane bench overhead`` with its old flags."""
    parser = argparse.ArgumentParser(prog="python -m loadtests.overhead", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    backend = sub.add_parser("backend", help="the instant backend alone")
    backend.add_argument("--port", type=int, required=True)
    parser.add_argument("--rates", type=_rates, default=None, help="req/s list, e.g. 100,500")
    parser.add_argument("--duration", type=float, default=None, help="wall seconds per phase")
    parser.add_argument(
        "--concurrency", type=int, default=None, help="connections at saturation (0: skip)"
    )
    parser.add_argument("--arms", type=lambda s: s.split(","), default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "backend":
        run_loop(serve_backend(args.port))
        return 0
    from loadtests.bench import overhead_runner
    from loadtests.bench.overhead_scenario import parse_overhead
    from loadtests.bench.scenario import ScenarioError, read_document

    try:
        scenario = parse_overhead(read_document("overhead")).with_overrides(
            duration_s=args.duration, arms=args.arms
        )
    except ScenarioError as exc:
        print(f"python -m loadtests.overhead: {exc}", file=sys.stderr)
        return 1
    changes: dict[str, Any] = {}
    if args.rates is not None:
        changes["rates"] = tuple(args.rates)
        changes["targets"] = tuple(
            t for t in scenario.targets if t.rate is None or t.rate in args.rates
        )
    if args.concurrency is not None:
        changes["saturation_connections"] = max(0, args.concurrency)
    return overhead_runner.run_scenario(dataclasses.replace(scenario, **changes), args.out)


if __name__ == "__main__":
    sys.exit(main())
