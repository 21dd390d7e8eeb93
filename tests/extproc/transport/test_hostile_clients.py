"""The service's gRPC server against clients that break HTTP/2 on purpose, or by accident.

Each attack runs on its own raw connection (``loadtests.hostile.h2raw``) while a well-behaved
grpc.aio client calls the server on another, and asserts three things: what the attacker
could make the server hold stays bounded (streams, buffered input, unsent output, open
connections), the legit client is still answered, and the attacker hears the code RFC 9113
gives its fault (GOAWAY or RST_STREAM). Memory in figures (RSS of a real ``fairlane serve``)
is the benchmark's job: ``python -m loadtests.hostile``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from extproc.transport import http2
from extproc.transport.h2grpc import WRITE_BUFFER_HIGH, GrpcServer, _Connection
from extproc.transport.limits import ServerLimits
from loadtests.hostile import h2raw
from loadtests.hostile.h2raw import RawConnection, frame, grpc_message
from tests.polling import until

SERVICE = "test.Hostile"
WAIT_S = 10.0
LIMITS = ServerLimits(
    max_message_bytes=1 << 20,
    max_concurrent_streams=1000,
    max_connections=20,
    handshake_timeout_s=0.5,
    idle_timeout_s=0.5,
    stream_window_bytes=64 << 10,
)


class Handlers:
    """Three methods, each a stage a stream can be reset in; counts starts and ends."""

    def __init__(self) -> None:
        self.started = 0
        self.finished = 0

    async def echo(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        """Answer every message with itself."""
        self.started += 1
        try:
            async for message in requests:
                yield message
        finally:
            self.finished += 1

    async def hold(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        """Read one message, then never read again: a held request."""
        self.started += 1
        try:
            async for _ in requests:
                await asyncio.Event().wait()
            yield b""
        finally:
            self.finished += 1

    async def answer_then_hold(
        self, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        """Answer the first message, then wait: a request whose answer has started."""
        self.started += 1
        try:
            async for message in requests:
                yield message
                await asyncio.Event().wait()
        finally:
            self.finished += 1

    def register(self, server: GrpcServer) -> None:
        server.add_registered_method_handlers(
            SERVICE,
            {
                "Echo": grpc.stream_stream_rpc_method_handler(self.echo),
                "Hold": grpc.stream_stream_rpc_method_handler(self.hold),
                "AnswerThenHold": grpc.stream_stream_rpc_method_handler(self.answer_then_hold),
            },
        )


@dataclass
class Legit:
    """A well-behaved client calling Echo every 20 ms for as long as the attack lasts."""

    answered: int = 0
    failed: int = 0

    @property
    def share_answered(self) -> float:
        return self.answered / max(1, self.answered + self.failed)


@dataclass
class Served:
    server: GrpcServer
    port: int
    handlers: Handlers
    legit: Legit
    legit_share: float | None = 0.9
    """The legit client's least share of answers over the test; None where the attack
    fills the port's streams on purpose (it is then only answered again after)."""


class LegitThread(threading.Thread):
    """The legit client: grpc's blocking client in a thread of its own, as Envoy is a
    process of its own (grpc.aio in the server's loop would change how that loop runs
    tasks, and hide what the attacks do to it)."""

    def __init__(self, port: int, legit: Legit) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.legit = legit
        self.stopping = threading.Event()

    def run(self) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            echo: Any = channel.stream_stream(f"/{SERVICE}/Echo")
            while not self.stopping.wait(0.02):
                try:
                    answers = list(echo(iter([b"ping"]), timeout=2.0))
                    self.legit.answered += answers == [b"ping"]
                except grpc.RpcError:
                    self.legit.failed += 1


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    handlers = Handlers()
    server = GrpcServer(LIMITS)
    handlers.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    legit = Legit()
    caller = LegitThread(port, legit)
    caller.start()
    await until(lambda: legit.answered > 0, "the legit client is answered before the attack")
    try:
        served = Served(server, port, handlers, legit)
        yield served
        answered_before = legit.answered
        await until(lambda: legit.answered > answered_before, "the legit client after it")
        if served.legit_share is not None:
            assert legit.share_answered >= served.legit_share, legit
    finally:
        caller.stopping.set()
        await asyncio.to_thread(caller.join, 5.0)
        await server.stop(None)


async def attacker(served: Served, reading: bool = True) -> RawConnection:
    receive_buffer = None if reading else 4096
    connection = await RawConnection.open(
        served.port, reading=reading, receive_buffer=receive_buffer
    )
    await until(lambda: served.server.open_connections == 2, "the attacker connected")
    return connection


def handler_streams(server: GrpcServer) -> int:
    return sum(len(c.streams) for c in server._connections)


def server_side(served: Served, connection: RawConnection) -> _Connection:
    """The server's end of the attacker's connection."""
    port = connection.writer.get_extra_info("sockname")[1]
    (found,) = [
        c
        for c in served.server._connections
        if c.transport is not None and c.transport.get_extra_info("peername")[1] == port
    ]
    return found


async def nothing_left_open(served: Served) -> None:
    server, handlers = served.server, served.handlers
    await until(lambda: server.open_streams <= 1, "every attacker stream gone (legit's: 1)")
    await until(lambda: handler_streams(server) <= 1, "every handler's stream forgotten")
    await until(lambda: handlers.finished >= handlers.started - 1, "every started handler finished")
    # the port-wide count the stream limit reads agrees with the streams really there
    await until(lambda: server.handler_streams == handler_streams(server), "the port's count")


# -- rapid reset ---------------------------------------------------------------------------

STAGES = ["with the headers", "mid-message", "handler waiting", "answer started", "ended"]
RESETS = 10_000
BATCH = 500


@pytest.mark.parametrize("stage", STAGES)
async def test_streams_reset_at_any_stage_leave_nothing_open(served: Served, stage: str) -> None:
    connection = await attacker(served)
    ours = server_side(served, connection)
    heard = connection.heard
    cancel = http2.CANCEL.to_bytes(4, "big")
    method = {"answer started": "AnswerThenHold", "ended": "Echo"}.get(stage, "Hold")
    for batch in range(1, RESETS // BATCH + 1):
        opened: list[int] = []
        out = bytearray()
        for _ in range(BATCH):
            stream_id, headers = connection.open_stream(f"/{SERVICE}/{method}")
            opened.append(stream_id)
            out += headers
            if stage == "mid-message":
                out += frame(h2raw.DATA, 0, stream_id, grpc_message(b"x" * 100)[:50])
            elif stage in ("answer started", "ended"):
                flags = h2raw.END_STREAM if stage == "ended" else 0
                out += frame(h2raw.DATA, flags, stream_id, grpc_message(b"x"))
            if stage in ("with the headers", "mid-message"):
                out += frame(h2raw.RST_STREAM, 0, stream_id, cancel)
        connection.send(bytes(out))
        goal = batch * BATCH
        await until(lambda: ours.opened >= goal, "the server read the batch")  # noqa: B023
        if stage == "handler waiting":
            await until(
                lambda: (
                    not any(not ours.streams[s].started for s in opened if s in ours.streams)  # noqa: B023
                ),
                "the batch's handlers run",
            )
        elif stage == "answer started":
            assert await connection.wait_for(lambda: heard.data_streams.issuperset(opened), WAIT_S)  # noqa: B023
        elif stage == "ended":
            assert await connection.wait_for(lambda: heard.ended_streams.issuperset(opened), WAIT_S)  # noqa: B023
        if stage not in ("with the headers", "mid-message"):
            connection.send(b"".join(frame(h2raw.RST_STREAM, 0, s, cancel) for s in opened))
        await until(lambda: not ours.http2.streams, "the server read the batch's resets")
    await until(lambda: not ours.streams, "every handler's stream forgotten")
    await nothing_left_open(served)
    assert not heard.closed and heard.goaway is None  # resets are not a fault: Envoy sends them
    await connection.close()


async def test_streams_reset_in_the_read_that_opened_them_cost_no_task(served: Served) -> None:
    # Unpaced: the whole burst at once, so each read holds hundreds of HEADERS and their
    # resets. A task per stream, even one cancelled before it ran, would pile up per read.
    connection = await attacker(served)
    ours = server_side(served, connection)
    cancel = http2.CANCEL.to_bytes(4, "big")
    out = bytearray()
    for _ in range(RESETS):
        stream_id, headers = connection.open_stream(f"/{SERVICE}/Hold")
        out += headers + frame(h2raw.RST_STREAM, 0, stream_id, cancel)
    loop = asyncio.get_running_loop()
    created = 0

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        nonlocal created
        created += 1
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(counting)
    try:
        connection.send(bytes(out))
        await until(lambda: ours.opened >= RESETS, "the server read the burst")
    finally:
        loop.set_task_factory(None)
    assert created < RESETS / 100  # a stream reset in a later read than its HEADERS has one
    await nothing_left_open(served)
    await connection.close()


# -- floods --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flood", "code"),
    [
        (frame(h2raw.PING, 0, 0, bytes(16384)), http2.FRAME_SIZE_ERROR),
        (frame(h2raw.PING, 0, 0, bytes(8)), http2.ENHANCE_YOUR_CALM),
        (frame(h2raw.CONTINUATION, 0, 1), http2.ENHANCE_YOUR_CALM),
        (frame(h2raw.DATA, 0, 1), http2.ENHANCE_YOUR_CALM),
        (frame(0x42, 0, 0, b"?"), http2.ENHANCE_YOUR_CALM),
    ],
    ids=["oversized PING", "PING", "empty CONTINUATION", "empty DATA", "unknown type"],
)
async def test_a_flood_closes_the_connection_with_the_floods_code(
    served: Served, flood: bytes, code: int
) -> None:
    connection = await attacker(served)
    stream_id, headers = connection.open_stream(f"/{SERVICE}/Hold")
    if flood[3] == h2raw.CONTINUATION:  # the flood continues an unfinished header block
        headers = frame(h2raw.HEADERS, 0, stream_id, headers[9:])
    connection.send(headers)
    with contextlib.suppress(ConnectionError):
        for _ in range(200):
            connection.send(flood * 1000)
            await connection.drain()
            if connection.heard.closed:
                break
    assert await connection.wait_for(lambda: connection.heard.closed, 2.0)
    assert connection.heard.goaway == code
    await until(lambda: served.server.open_connections == 1, "only the legit client is left")
    await nothing_left_open(served)
    await connection.close()


@pytest.mark.parametrize("flood", ["ping", "settings"])
async def test_a_client_that_never_reads_stops_being_read(served: Served, flood: str) -> None:
    # Every PING and SETTINGS asks for an acknowledgement: a client that never reads them
    # must not make the server queue them without end.
    connection = await attacker(served, reading=False)
    one = (
        frame(h2raw.PING, 0, 0, bytes(8))
        if flood == "ping"
        else frame(h2raw.SETTINGS, 0, 0, b"\x00\x04\x00\x01\x00\x00")
    )
    stream_id, headers = connection.open_stream(f"/{SERVICE}/Hold")  # not idle: one stream
    connection.send(headers + frame(h2raw.DATA, 0, stream_id, grpc_message(b"x")))
    ours = server_side(served, connection)
    await until(lambda: ours.opened == 1, "the attacker's stream opened")
    transport = ours.transport
    assert transport is not None
    most_queued, paused = 0, False
    with contextlib.suppress(ConnectionError, TimeoutError):
        for _ in range(400):
            connection.send(one * 2000)
            await asyncio.wait_for(connection.drain(), 0.5)
            most_queued = max(most_queued, transport.get_write_buffer_size())
            paused = paused or not transport.is_reading()
    most_queued = max(most_queued, transport.get_write_buffer_size())
    assert most_queued <= WRITE_BUFFER_HIGH + (64 << 10)  # one read's acknowledgements past
    assert paused or transport.is_closing()
    if flood == "ping":  # pings that come too often are a fault of their own
        await until(lambda: served.server.open_connections == 1, "the pinger closed")
    await connection.close()
    await until(lambda: served.server.open_connections == 1, "the attacker gone")


# -- flow control and stream exhaustion ------------------------------------------------------


async def test_a_held_stream_accepts_no_more_than_a_message_and_its_window(
    served: Served,
) -> None:
    connection = await attacker(served)
    heard = connection.heard
    await connection.wait_for(lambda: h2raw.INITIAL_WINDOW_SIZE in heard.settings, WAIT_S)
    window = heard.settings[h2raw.INITIAL_WINDOW_SIZE]
    assert window == LIMITS.stream_window_bytes
    stream_id, headers = connection.open_stream(f"/{SERVICE}/Hold")
    connection.send(headers)
    chunk = 16 << 10
    message = grpc_message(b"m" * (chunk - 5))  # one message per DATA frame
    sent = 0

    def room() -> int:
        granted = window + heard.window_updates.get(stream_id, 0)
        connection_room = h2raw.DEFAULT_WINDOW + heard.window_updates.get(0, 0)
        return min(granted, connection_room) - sent

    bound = LIMITS.max_message_bytes + 2 * window
    while sent <= 2 * bound:  # honour flow control, as a well-behaved sender would
        if room() < chunk and not await connection.wait_for(lambda: room() >= chunk, 0.5):
            break
        connection.send(frame(h2raw.DATA, 0, stream_id, message))
        sent += chunk
        await connection.drain()
    assert sent <= bound
    assert not heard.closed and stream_id not in heard.resets
    await connection.close()
    await nothing_left_open(served)


async def test_streams_past_the_limit_are_refused_on_one_connection_or_over_several(
    served: Served,
) -> None:
    limit = LIMITS.max_concurrent_streams
    served.legit_share = None  # the port is full by design while the attack lasts
    first, second = await attacker(served), await RawConnection.open(served.port)
    await first.wait_for(
        lambda: first.heard.settings.get(h2raw.MAX_CONCURRENT_STREAMS) == limit, WAIT_S
    )
    # half the limit on the second connection, then as many again and ten more on the first:
    # the port's streams over all connections stay within the limit, as Envoy's breaker does
    half = [second.open_stream(f"/{SERVICE}/Hold") for _ in range(limit // 2)]
    second.send(b"".join(headers for _, headers in half))
    await until(lambda: served.server.handler_streams >= limit // 2, "the second's streams")
    streams = [first.open_stream(f"/{SERVICE}/Hold") for _ in range(limit // 2 + 10)]
    first.send(b"".join(headers for _, headers in streams))
    refused = first.heard.resets
    assert await first.wait_for(lambda: len(refused) >= 10, WAIT_S)
    assert set(refused.values()) == {http2.REFUSED_STREAM}
    assert served.server.handler_streams <= limit
    await first.close()
    await second.close()
    await nothing_left_open(served)


# -- slow, silent and too many connections -------------------------------------------------


@pytest.mark.parametrize(
    "sends",
    [b"", h2raw.PREFACE[:10], h2raw.PREFACE + frame(h2raw.SETTINGS, 0, 0)],
    ids=["silent", "half a preface", "idle after the handshake"],
)
async def test_slow_and_silent_connections_are_closed(served: Served, sends: bytes) -> None:
    connection = await RawConnection.open(served.port, handshake=False)
    connection.send(sends)
    limit = max(LIMITS.handshake_timeout_s, LIMITS.idle_timeout_s)
    assert await connection.wait_for(lambda: connection.heard.closed, limit + 1.5)
    if sends.endswith(frame(h2raw.SETTINGS, 0, 0)):
        assert connection.heard.goaway == http2.NO_ERROR
    await until(lambda: served.server.open_connections == 1, "only the legit client is left")
    await connection.close()


async def test_connections_past_the_limit_are_closed_at_once(served: Served) -> None:
    allowed = LIMITS.max_connections - 1  # the legit client holds one
    kept = [await RawConnection.open(served.port) for _ in range(allowed)]
    await until(lambda: served.server.open_connections == LIMITS.max_connections, "all open")
    extra = [await RawConnection.open(served.port) for _ in range(5)]
    for connection in extra:
        assert await connection.wait_for(lambda c=connection: c.heard.closed, WAIT_S)
    assert served.server.refused_connections == 5
    assert not any(connection.heard.closed for connection in kept)
    for connection in (*kept, *extra):
        await connection.close()
    await until(lambda: served.server.open_connections == 1, "only the legit client is left")


# -- drain ---------------------------------------------------------------------------------


async def test_draining_sends_goaway_at_once_and_lets_open_streams_finish() -> None:
    handlers = Handlers()
    server = GrpcServer(LIMITS)
    handlers.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    connection = await RawConnection.open(port)
    heard = connection.heard
    first, headers = connection.open_stream(f"/{SERVICE}/Echo")
    connection.send(headers)
    await until(lambda: handlers.started == 1, "the stream's handler runs")
    stopping = asyncio.create_task(server.stop(WAIT_S))
    try:
        assert await connection.wait_for(lambda: heard.goaway is not None, 1.0)
        assert heard.goaway == http2.NO_ERROR and not heard.closed
        late, headers = connection.open_stream(f"/{SERVICE}/Echo")
        connection.send(headers)
        await connection.wait_for(lambda: late in heard.resets, WAIT_S)
        assert heard.resets[late] == http2.REFUSED_STREAM
        connection.send(frame(h2raw.DATA, h2raw.END_STREAM, first, grpc_message(b"bye")))
        assert await connection.wait_for(lambda: first in heard.ended_streams, WAIT_S)
        await asyncio.wait_for(stopping, WAIT_S)
    finally:
        await connection.close()
        stopping.cancel()
