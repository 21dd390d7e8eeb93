"""The overhead measurement's load generator: raw keep-alive POSTs from one event loop.

Raw asyncio connections in the caller's event loop (one core). Fixed rates are open loop
(request *i* is sent at ``t0 + i/rate`` whatever is still outstanding, on a new connection
when all are busy, so a stall is not hidden by coordinated omission); latency counts from
the actual send, and how late the timer sent is kept apart (``late_ms``). Saturation is
closed loop.

The overload phase and the recovery after it are open loop too, with every response
classified (:func:`classify`): a 2xx; a **gateway answer** (429 or 503 whose body is
OpenAI-shaped JSON ``{"error": {...}}``, as the fairlane service refuses); an **Envoy error**
(any other 5xx: ext_proc's ``status_on_error`` 503 has no such body, a 504 is a timeout in
Envoy); a **client timeout**; a connection error; anything else. The open connections are
bounded there (``max_connections``): a send that is due while every one is busy is not made
and counted ``unsent``, a generator problem the report flags.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from loadtests.bench.overhead.wire import take_message

API_KEY = "sk-overhead"
MODEL = "sim-llama-8b"
BODY = json.dumps(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello in one word, please."}],
        "max_tokens": 1,
    }
).encode()

OK = "ok"
GATEWAY = "gateway"
ENVOY_ERROR = "envoy_error"
TIMEOUT = "timeout"
CONNECTION_ERROR = "connection_error"
OTHER = "other"
OUTCOMES = (OK, GATEWAY, ENVOY_ERROR, TIMEOUT, CONNECTION_ERROR, OTHER)
GATEWAY_STATUSES = (429, 503)


def is_openai_error(body: bytes) -> bool:
    """Whether ``body`` is ``{"error": {...}}``, the shape of the gateway's own answers."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict)


def classify(status: int, body: bytes) -> str:
    """One response's outcome (a timeout never gets here): see the module's docstring.
    Status 0 is a connection the peer closed or refused."""
    if status == 0:
        return CONNECTION_ERROR
    if 200 <= status < 300:
        return OK
    if status in GATEWAY_STATUSES and is_openai_error(body):
        return GATEWAY
    if status >= 500:
        return ENVOY_ERROR
    return OTHER


@dataclass(slots=True)
class Sample:
    """One request of a classified open-loop phase."""

    sent_s: float
    """When it was sent, seconds after the phase's first due time."""
    outcome: str
    status: int
    latency_ms: float
    """From the send to the response (to the give-up for a timeout)."""


@dataclass
class Classified:
    """A classified open-loop phase: every request sent, and the ones that could not be."""

    samples: list[Sample] = field(default_factory=list)
    unsent: int = 0
    """Due while all ``max_connections`` were busy: not sent (a generator limit)."""
    late_ms: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    """From the first due time to the last send."""


class _ClientProtocol(asyncio.Protocol):
    def __init__(self, on_lost: Callable[[], None] | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.on_lost = on_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.on_lost is not None:
            self.on_lost()
            self.on_lost = None
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed"))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        message = take_message(self.buffer)
        if message is None:
            return
        head, rest = message
        body = self.buffer[len(head) + 4 : len(self.buffer) - len(rest)]
        self.buffer = rest
        status = int(head[9:12])
        if b"\r\nconnection: close" in head.lower():
            self.closed = True  # answered, but not reusable: the next request opens another
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((status, body))

    def expire(self) -> None:
        """The client gave up: fail the wait, drop the connection (a late answer must not
        be read as the next request's)."""
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(TimeoutError())
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class LoadGenerator:
    """Raw HTTP/1.1 keep-alive POSTs to one Envoy (or the backend), from this process's
    event loop."""

    def __init__(
        self,
        port: int,
        path: str = "/v1/chat/completions",
        api_key: str | tuple[str, ...] = API_KEY,
        max_connections: int | None = None,
    ) -> None:
        self.port = port
        keys = (api_key,) if isinstance(api_key, str) else api_key
        # Several keys are sent in turn, one request each: with service replicas, Envoy
        # hashes each key's streams to one replica, so one key would load one replica.
        self.requests = [
            (
                f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(BODY)}\r\n\r\n"
            ).encode()
            + BODY
            for key in keys
        ]
        self.sent = 0
        self.idle: list[_ClientProtocol] = []
        self.late_ms: list[float] = []
        self.max_connections = max_connections
        self.open = 0
        """Connections open or opening."""

    def _lost(self) -> None:
        self.open -= 1

    async def _connection(self) -> _ClientProtocol | None:
        """An idle connection, or a new one; None when ``max_connections`` are open."""
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        if self.max_connections is not None and self.open >= self.max_connections:
            return None
        loop = asyncio.get_running_loop()
        self.open += 1
        try:
            _, protocol = await loop.create_connection(
                lambda: _ClientProtocol(self._lost), "127.0.0.1", self.port
            )
        except OSError:
            self.open -= 1
            raise
        return protocol

    async def one(self) -> int:
        """Send one request; the response's status (0 on a connection error: a dead Envoy
        is counted as failed requests, and the runner names the process that died)."""
        status, _ = await self.exchange()
        return status

    async def exchange(self, timeout: float | None = None) -> tuple[int, bytes]:
        """One request: (status, body); status 0 on a connection error, -1 when no
        connection was free (``max_connections``); TimeoutError after ``timeout`` s."""
        try:
            conn = await self._connection()
        except OSError:
            return 0, b""
        if conn is None:
            return -1, b""
        loop = asyncio.get_running_loop()
        conn.waiter = loop.create_future()
        assert conn.transport is not None
        requests = self.requests
        conn.transport.write(requests[self.sent % len(requests)])
        self.sent += 1
        handle = loop.call_later(timeout, conn.expire) if timeout is not None else None
        try:
            result = await conn.waiter
        except ConnectionError:
            return 0, b""
        finally:
            if handle is not None:
                handle.cancel()
        self.idle.append(conn)
        return result

    async def open_loop(self, rate: float, duration: float) -> tuple[list[float], int]:
        """Requests due at ``t0 + i / rate``; latency from the send to the response.

        ``self.late_ms`` gets how late each was sent (the event loop's timer granularity,
        about 1 ms on uvloop, or a busy generator)."""
        latencies: list[float] = []
        errors = 0
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

        await paced(rate, duration, time.perf_counter() + 0.05, send, tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        return latencies, errors

    async def classified_loop(
        self, rate: float, duration: float, timeout: float
    ) -> tuple[Classified, set[asyncio.Task[None]]]:
        """Open loop at ``rate`` for ``duration`` s, every response classified, each
        request given up after ``timeout`` s. Returns as soon as the last request is sent,
        with the tasks still answering (await them, :func:`settle`): the recovery starts
        while the overload's last requests drain."""
        result = Classified()
        tasks: set[asyncio.Task[None]] = set()
        t0 = time.perf_counter() + 0.02

        async def send(due: float) -> None:
            start = time.perf_counter()
            result.late_ms.append((start - due) * 1000)
            try:
                status, body = await self.exchange(timeout)
            except TimeoutError:
                outcome, status = TIMEOUT, 0
            else:
                if status == -1:
                    result.unsent += 1
                    return
                outcome = classify(status, body)
            latency = (time.perf_counter() - start) * 1000
            result.samples.append(Sample(start - t0, outcome, status, latency))

        await paced(rate, duration, t0, send, tasks)
        result.elapsed_s = max(time.perf_counter() - t0, duration)
        return result, tasks

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

    def close(self) -> None:
        """Close the idle connections (busy ones close when their request ends)."""
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle = []

    async def timed(self) -> float | None:
        """One request's latency (ms), None when it did not get a 2xx."""
        start = time.perf_counter()
        status = await self.one()
        return (time.perf_counter() - start) * 1000 if 200 <= status < 300 else None


async def paced(
    rate: float,
    duration: float,
    t0: float,
    send: Callable[[float], Coroutine[Any, Any, None]],
    tasks: set[asyncio.Task[None]],
) -> None:
    """Open loop: start ``send(due)`` at ``t0 + i / rate`` for ``duration`` s, whatever is
    still outstanding (no coordinated omission); the running sends are kept in ``tasks``."""
    loop = asyncio.get_running_loop()
    for i in range(int(rate * duration)):
        due = t0 + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = loop.create_task(send(due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


async def settle(tasks: set[asyncio.Task[None]], timeout: float) -> None:
    """Wait for a classified loop's requests (each gives up after its own timeout, so
    ``timeout`` is a safety bound)."""
    if tasks:
        await asyncio.wait(set(tasks), timeout=timeout)


async def concurrency1(
    gateway: LoadGenerator, backend: LoadGenerator, requests: int
) -> tuple[list[float], list[float], int]:
    """One connection each, closed loop, alternating: a request through the gateway, then
    one straight to the backend, ``requests`` times. (gateway ms, backend ms, errors)."""
    through: list[float] = []
    direct: list[float] = []
    errors = 0
    for _ in range(requests):
        for gen, into in ((gateway, through), (backend, direct)):
            latency = await gen.timed()
            if latency is None:
                errors += 1
            else:
                into.append(latency)
    return through, direct, errors
