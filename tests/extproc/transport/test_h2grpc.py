"""The in-loop gRPC server against grpc's own client (grpc.aio), on loopback.

grpc's client is the strictest peer at hand besides Envoy (which the integration tests put in
front of it): each test registers small raw-bytes handlers the way the generated
``add_*_to_server`` code does and checks what a caller sees.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import hpack
import pytest

from extproc.transport import http2
from extproc.transport.h2grpc import GrpcServer, _Connection
from extproc.transport.limits import ServerLimits
from tests.extproc.transport.test_http2 import frame
from tests.loopback_grpc import serving
from tests.polling import until

WAIT_S = 10.0
SERVICE = "test.Echo"


class Calls:
    """What the handlers saw: started, finished, and how."""

    def __init__(self) -> None:
        self.cancelled = 0
        self.finished = 0
        self.started = asyncio.Event()


def handlers(calls: Calls) -> dict[str, Any]:
    async def chat(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        """Answer every message with it reversed; b"hold" waits until cancelled."""
        try:
            async for message in requests:
                if message == b"hold":
                    calls.started.set()
                    await asyncio.Event().wait()
                if message == b"fail":
                    raise RuntimeError("asked to fail")
                yield message[::-1]
        except asyncio.CancelledError:
            calls.cancelled += 1
            raise
        finally:
            calls.finished += 1

    async def total(requests: AsyncIterator[bytes], context: Any) -> bytes:
        """The byte count of every message, once the client is done."""
        count = 0
        async for message in requests:
            count += len(message)
        return str(count).encode()

    return {
        "Chat": grpc.stream_stream_rpc_method_handler(chat),
        "Total": grpc.stream_unary_rpc_method_handler(total),
        "Unary": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
    }


@pytest.fixture
async def served() -> AsyncIterator[tuple[GrpcServer, grpc.aio.Channel, Calls]]:
    calls = Calls()
    server = GrpcServer(ServerLimits(max_message_bytes=1 << 20))

    def register(server: GrpcServer) -> None:
        server.add_registered_method_handlers(SERVICE, handlers(calls))

    # Without BDP probing grpc's client keeps HTTP/2's 64 KiB window, so a bigger answer
    # must wait for its WINDOW_UPDATEs.
    async with serving(server, register, [("grpc.http2.bdp_probe", 0)]) as channel:
        yield server, channel, calls


def open_streams(server: GrpcServer) -> int:
    return sum(len(c.streams) for c in server._connections)


def chat(channel: grpc.aio.Channel, messages: list[bytes]) -> Any:
    method: Any = channel.stream_stream(f"/{SERVICE}/Chat")
    return method(iter(messages), timeout=WAIT_S)  # a server that stalls fails the test


async def test_messages_in_order_each_answered(
    served: tuple[GrpcServer, grpc.aio.Channel, Calls],
) -> None:
    _, channel, calls = served
    call = chat(channel, [b"abc", b"", b"12345"])
    answers = [answer async for answer in call]
    assert answers == [b"cba", b"", b"54321"]
    assert await call.code() == grpc.StatusCode.OK
    assert calls.finished == 1


async def test_messages_larger_than_a_frame_and_the_default_window(
    served: tuple[GrpcServer, grpc.aio.Channel, Calls],
) -> None:
    # 200 KiB: over h2's 16 KiB frames and the client's 64 KiB window.
    _, channel, _ = served
    big = bytes(range(256)) * 800
    call = chat(channel, [big, big[:70_000]])
    answers = [answer async for answer in call]
    assert answers == [big[::-1], big[:70_000][::-1]]


async def test_a_client_streaming_method_answers_after_the_last_message(
    served: tuple[GrpcServer, grpc.aio.Channel, Calls],
) -> None:
    _, channel, _ = served
    total: Any = channel.stream_unary(f"/{SERVICE}/Total")
    assert await total(iter([b"ab", b"cde", b""]), timeout=WAIT_S) == b"5"


async def test_unknown_and_unary_methods_are_unimplemented(
    served: tuple[GrpcServer, grpc.aio.Channel, Calls],
) -> None:
    _, channel, _ = served
    for method in ("Nope", "Unary"):
        call: Any = channel.unary_unary(f"/{SERVICE}/{method}")
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call(b"x", timeout=WAIT_S)
        assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_failing_handler_ends_its_stream_only(
    served: tuple[GrpcServer, grpc.aio.Channel, Calls],
) -> None:
    _, channel, _ = served
    failing = chat(channel, [b"ok", b"fail"])
    healthy = chat(channel, [b"still", b"fine"])
    assert await failing.read() == b"ko"
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await failing.read()
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "asked to fail" in (failed.value.details() or "")
    assert [answer async for answer in healthy] == [b"llits", b"enif"]


async def test_an_oversized_message_is_refused(
    served: tuple[GrpcServer, grpc.aio.Channel, Calls],
) -> None:
    _, channel, _ = served
    call = chat(channel, [b"x" * ((1 << 20) + 1)])
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call.read()
    assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_cancelled_call_cancels_its_handler(
    served: tuple[GrpcServer, grpc.aio.Channel, Calls],
) -> None:
    server, channel, calls = served
    call = chat(channel, [b"hold"])
    await asyncio.wait_for(calls.started.wait(), WAIT_S)
    call.cancel()
    await until(
        lambda: calls.cancelled and not any(c.streams for c in server._connections),
        "the handler cancelled and its stream gone",
    )
    assert calls.finished == 1


async def test_more_streams_at_once_than_h2s_default_limit(
    served: tuple[GrpcServer, grpc.aio.Channel, Calls],
) -> None:
    # Held requests are open streams: h2 (the library) refused the 101st by default.
    server, channel, calls = served
    held = [chat(channel, [b"hold"]) for _ in range(300)]
    await until(lambda: open_streams(server) >= 300, "300 streams open")
    answer = chat(channel, [b"after"])
    assert await answer.read() == b"retfa"
    for call in held:
        call.cancel()
    await until(lambda: calls.cancelled >= 300, "300 handlers cancelled")


async def test_stop_refuses_new_streams_and_cancels_the_rest_after_the_grace(
    served: tuple[GrpcServer, grpc.aio.Channel, Calls],
) -> None:
    server, channel, calls = served
    held = chat(channel, [b"hold"])
    await asyncio.wait_for(calls.started.wait(), WAIT_S)
    stopping = asyncio.create_task(server.stop(0.3))
    await until(lambda: server._stopping, "the server to start stopping")
    with pytest.raises(grpc.aio.AioRpcError):
        await chat(channel, [b"late"]).read()
    await asyncio.wait_for(stopping, WAIT_S)
    assert calls.cancelled == 1
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await held.read()
    assert failed.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


async def test_finished_streams_do_not_pile_up_behind_held_ones(
    served: tuple[GrpcServer, grpc.aio.Channel, Calls],
) -> None:
    # The framing forgets a stream when its trailers go out: the tables hold the held ones.
    server, channel, _ = served
    held = [chat(channel, [b"hold"]) for _ in range(100)]
    await until(lambda: open_streams(server) >= 100, "100 streams open")
    for _ in range(500):
        assert await chat(channel, [b"x"]).read() == b"x"
    (connection,) = server._connections
    # the last answer's message can reach the client before its trailers leave the server
    await until(lambda: len(connection.streams) == 100, "the finished streams forgotten")
    assert len(connection.http2.streams) == 100
    assert not connection.blocked
    for call in held:
        call.cancel()


class Written:
    """A transport that keeps what the server writes."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def get_extra_info(self, name: str) -> None:
        return None

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int) -> None:
        pass


async def test_a_goaway_from_the_client_lets_its_open_streams_finish() -> None:
    # Envoy drains a connection with GOAWAY and waits for its streams: a held request on
    # it must still be answered (h2 the library made the server cancel them all).
    calls = Calls()
    server = GrpcServer(ServerLimits(max_message_bytes=1 << 20))
    release = asyncio.Event()

    async def wait_then_echo(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for message in requests:
            calls.started.set()
            await release.wait()
            yield message

    server.add_registered_method_handlers(
        SERVICE, {"Wait": grpc.stream_stream_rpc_method_handler(wait_then_echo)}
    )
    connection = _Connection(server)
    transport = Written()
    connection.connection_made(transport)  # type: ignore[arg-type]

    headers = [
        (b":method", b"POST"),
        (b":path", f"/{SERVICE}/Wait".encode()),
        (b"content-type", b"application/grpc"),
    ]
    block = hpack.Encoder().encode(headers)
    connection.data_received(
        http2.PREFACE
        + frame(http2.SETTINGS, 0, 0, b"")
        + frame(http2.HEADERS, http2.END_HEADERS, 1, block)
        + frame(http2.DATA, http2.END_STREAM, 1, b"\x00\x00\x00\x00\x02hi")
    )
    await asyncio.wait_for(calls.started.wait(), WAIT_S)
    connection.data_received(frame(http2.GOAWAY, 0, 0, bytes(8)))
    connection.data_received(frame(http2.HEADERS, http2.END_HEADERS, 3, block))  # too late
    release.set()
    await until(lambda: not connection.streams, "the held stream answered and closed")
    written = bytes(transport.data)
    assert b"\x00\x00\x00\x00\x02hi" in written  # the held stream's answer went out
    assert frame(http2.RST_STREAM, 0, 3, http2.REFUSED_STREAM.to_bytes(4, "big")) in written
