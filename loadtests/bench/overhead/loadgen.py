"""The overhead measurement's load generator: raw keep-alive POSTs from one event loop.

Raw asyncio connections in the caller's event loop (one core). Fixed rates are open loop
(request *i* is sent at ``t0 + i/rate`` whatever is still outstanding, on a new connection
when all are busy, so a stall is not hidden by coordinated omission); latency counts from
the actual send, and how late the timer sent is kept apart (``late_ms``). Saturation is
closed loop.
"""

from __future__ import annotations

import asyncio
import json
import time

from loadtests.bench.overhead.wire import take_message

API_KEY = "sk-overhead"
BODY = json.dumps(
    {
        "model": "sim-llama-8b",
        "messages": [{"role": "user", "content": "Say hello in one word, please."}],
        "max_tokens": 1,
    }
).encode()


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
        message = take_message(self.buffer)
        if message is None:
            return
        head, self.buffer = message
        status = int(head[9:12])
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(status)


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
