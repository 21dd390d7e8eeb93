"""A gRPC server on HTTP/2 framed in the event loop's own thread.

Why not grpc.aio, which the service used before: each stream there goes through grpc's C
core, its poller thread and a cross-thread wake-up of the loop for every message; behind the
same Envoy, a servicer that decides nothing serves more than twice the requests per core on
this server (docs/benchmarks/internals.md). The per-stream work here is the framing
(``extproc.transport.http2``), a task and the servicer: the same servicers grpc.aio runs,
registered the same way (the generated ``add_XServicer_to_server``). Scope: what Envoy's gRPC
clients use towards this service: HTTP/2 with prior knowledge over cleartext TCP, streaming
methods, uncompressed messages. Errors end only their own stream, and a stream the client
resets cancels its handler's task, as grpc.aio does (a held request leaves its queue on
``CancelledError``). Safe by default against a hostile or broken client (``ServerLimits``):
connections are capped, handshakes and idle connections time out, a client that does not
read stops being read, each stream holds at most its window of unread input.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, cast

from extproc.transport import http2
from extproc.transport.limits import ServerLimits

log = logging.getLogger("fairlane.h2grpc")

GRPC_CONTENT_TYPE = b"application/grpc"

# https://grpc.github.io/grpc/core/md_doc_statuscodes.html
OK = 0
CANCELLED = 1
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
RESOURCE_EXHAUSTED = 8

WRITE_BUFFER_HIGH = 1 << 20
"""Bytes written and not yet taken by the client past which its connection is not read."""
EAGER_FLUSH_BYTES = 64 << 10
"""Frames queued by one read past which they are written at once, not at the end of the
loop iteration (a flood of pings or settings asks for that many acknowledgements)."""
CLOSE_GRACE_S = 1.0
"""How long a closed connection may take to send its last frames before it is cut."""

RESPONSE_HEADER_BLOCK = http2.encode_headers(
    [(b":status", b"200"), (b"content-type", GRPC_CONTENT_TYPE)]
)
"""Every answer's headers, encoded once."""
OK_TRAILERS = http2.encode_headers([(b"grpc-status", b"0")])
TRAILERS_ONLY_OK = RESPONSE_HEADER_BLOCK + OK_TRAILERS


class GrpcServer:
    """Serves registered streaming methods on one listening socket.

    The interface follows ``grpc.aio.Server`` where the service uses it:
    ``add_insecure_port`` binds at once and returns the port, ``start``, ``stop(grace)``.

    An unknown method is answered ``UNIMPLEMENTED``, a compressed or oversized message
    ``INTERNAL`` / ``RESOURCE_EXHAUSTED``, a handler that raises ``INTERNAL``; none of them
    disturbs the other streams. A unary method (such as xDS's Fetch*, which nothing here
    implements) is not served: only stream-stream and stream-unary methods are. Draining sends
    GOAWAY at once. The hostile-client cases are in
    ``tests/extproc/transport/test_hostile_clients.py``.
    """

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.framing_limits = http2.Limits(
            max_concurrent_streams=limits.max_concurrent_streams,
            stream_window=limits.stream_window_bytes,
        )
        self._methods: dict[bytes, Any] = {}
        self._sockets: list[socket.socket] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._connections: set[_Connection] = set()
        self._stopping = False
        self._stopped: asyncio.Event | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.handler_streams = 0
        """Streams whose handler runs or is about to, over all connections."""
        self.refused_connections = 0
        """Connections closed at once because ``max_connections`` were open."""

    # -- registration, as grpc's generated add_*_to_server call it ---------------------

    def add_generic_rpc_handlers(self, handlers: Iterable[object]) -> None:
        """Ignored: the generated code registers each method again, by name, below."""

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Any]) -> None:
        for method, handler in handlers.items():
            if handler.request_streaming:  # a unary method stays unknown: UNIMPLEMENTED
                self._methods[f"/{service}/{method}".encode()] = handler

    def method(self, path: bytes) -> Any | None:
        return self._methods.get(path)

    # -- lifecycle ---------------------------------------------------------------------

    def add_insecure_port(self, address: str) -> int:
        """Bind ``HOST:PORT`` now (port 0: any free one) and return the port."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, int(port)))
        except OSError:
            sock.close()
            raise
        self._sockets.append(sock)
        bound: int = sock.getsockname()[1]
        return bound

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        for sock in self._sockets:
            sock.listen(1024)
            server = await loop.create_server(lambda: _Connection(self), sock=sock)
            self._servers.append(server)
        self._sweeper = loop.create_task(self._sweep(), name="grpc-connection-sweep")

    async def _sweep(self) -> None:
        """Close connections that never finished their handshake, and those idle too long.

        One timer for all connections, so a request costs nothing here: a connection is idle
        when it has had no stream since the previous sweeps for ``idle_timeout_s``."""
        limits = self.limits
        period = min(1.0, limits.handshake_timeout_s / 4, limits.idle_timeout_s / 4)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for connection in list(self._connections):
                connection.sweep(now)

    async def stop(self, grace: float | None) -> None:
        """Refuse new streams at once; cancel what still runs after ``grace`` seconds.

        A second call (``stop(0)`` while a ``stop(30)`` waits) cuts the wait short; every
        call returns once all connections are closed."""
        if not self._stopping:
            self._stopping = True
            for server in self._servers:
                server.close()
            for connection in self._connections:
                connection.drain()
        if grace:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained(), grace)
        for connection in list(self._connections):
            connection.cancel_all()
        await self._drained()
        for connection in list(self._connections):
            connection.close()
        for server in self._servers:
            await server.wait_closed()
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._stopped is not None:
            self._stopped.set()

    async def wait_for_termination(self) -> None:
        if self._stopped is not None:
            await self._stopped.wait()

    async def _drained(self) -> None:
        while any(connection.streams for connection in self._connections):
            await asyncio.sleep(0.01)

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    @property
    def open_streams(self) -> int:
        """Streams open at the HTTP/2 level, those the handlers run and those ending."""
        return sum(len(connection.http2.streams) for connection in self._connections)

    def admit(self) -> bool:
        """Whether one more connection may be served (``max_connections``)."""
        if len(self._connections) < self.limits.max_connections:
            return True
        self.refused_connections += 1
        if self.refused_connections == 1 or self.refused_connections % 1000 == 0:
            log.warning(
                "refused %d connections so far: %d open, the most allowed",
                self.refused_connections,
                len(self._connections),
            )
        return False

    def connected(self, connection: _Connection) -> None:
        self._connections.add(connection)

    def disconnected(self, connection: _Connection) -> None:
        self._connections.discard(connection)


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection: frames in through ``http2``, each stream's handler a task."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.http2 = http2.ServerConnection(self, server.framing_limits)
        self.streams: dict[int, _Stream] = {}
        self.blocked: set[_Stream] = set()
        """Streams with data that flow control holds back: a WINDOW_UPDATE for the whole
        connection wakes these, not every held stream."""
        self.transport: asyncio.Transport | None = None
        self._flush_scheduled = False
        self._refusing = server.stopping
        self.opened = 0
        """Streams opened so far: the sweep tells an idle connection by it not moving."""
        self._starting: list[_Stream] = []
        """Streams opened by the read being parsed, whose handlers start after it."""
        self._opened_at = 0.0
        self._idle_mark: tuple[int, float] | None = None
        """(``opened``, when) at the first sweep that found no stream open."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)
        if not self.server.admit():
            self.transport.abort()
            self.transport = None
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        self._opened_at = asyncio.get_running_loop().time()
        self.server.connected(self)
        self.http2.initiate()
        self.transport.write(self.http2.take())

    def pause_writing(self) -> None:
        # The client reads less than it makes this side write (its own answers, or the
        # acknowledgements of its pings and settings): read nothing more until it catches up.
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def sweep(self, now: float) -> None:
        """Close this connection if its handshake is overdue or it has been idle too long."""
        limits = self.server.limits
        if not self.http2.preface_seen:
            if now - self._opened_at >= limits.handshake_timeout_s:
                log.info("closing a gRPC connection that did not finish its handshake")
                self.close()
            return
        if self.http2.streams:
            self._idle_mark = None
        elif self._idle_mark is None or self._idle_mark[0] != self.opened:
            self._idle_mark = (self.opened, now)
        elif now - self._idle_mark[1] >= limits.idle_timeout_s:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:
            return  # refused at once (``admit``)
        self.server.disconnected(self)
        self.transport = None
        self.cancel_all()

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return
        try:
            self.http2.receive(data)
        except http2.Http2Error as error:
            log.warning("closing an HTTP/2 connection that broke the protocol: %s", error)
            self._starting.clear()
            self.flush()
            self.close()
            return
        # Handlers start only now, for the streams still open: a stream reset in the same
        # read as its HEADERS (a client abort, or a rapid-reset attack) costs no task.
        if self._starting:
            create_task = asyncio.get_running_loop().create_task
            for stream in self._starting:
                if not stream.closed:
                    stream.task = create_task(stream.run())
            self._starting.clear()
        if self.http2.queued > EAGER_FLUSH_BYTES:
            # Acknowledgements a flood asked for: out now, so that a client that does not
            # read them stops being read (``pause_writing``) within this loop iteration.
            self.flush()
        # Not now: the handlers woken here answer in this loop iteration, and their answers
        # go out with the acknowledgements in one write.
        self.flush_soon()

    # -- http2.Listener ------------------------------------------------------------------

    def on_request(
        self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool
    ) -> None:
        path = b""
        content_type = b""
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"content-type":
                content_type = value
        self.opened += 1
        server = self.server
        if self._refusing or server.handler_streams >= server.limits.max_concurrent_streams:
            # Draining, or the port's streams over all connections are at the limit (the
            # one Envoy's circuit breaker keeps over its connections).
            self.http2.reset(stream_id, http2.REFUSED_STREAM)
            return
        handler = self.server.method(path)
        if handler is None or not content_type.startswith(GRPC_CONTENT_TYPE):
            why = f"unknown method {path.decode(errors='replace')}"
            self.http2.send_headers(stream_id, _trailers(UNIMPLEMENTED, why, first=True), True)
            return
        stream = _Stream(self, stream_id, handler)
        self.streams[stream_id] = stream
        server.handler_streams += 1
        if end_stream:
            stream.end_of_input()
        self._starting.append(stream)  # its task once the read is parsed (data_received)

    def on_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.feed(data)
            if end_stream:
                stream.end_of_input()

    def on_trailers(self, stream_id: int) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.end_of_input()

    def on_reset(self, stream_id: int) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.reset_by_client()

    def on_window(self, stream_id: int) -> None:
        if stream_id:
            stream = self.streams.get(stream_id)
            if stream is not None and stream.blocked:
                stream.send_pending()
        else:  # the connection's window: only streams that wait for it (not every held one)
            for stream in list(self.blocked):
                stream.send_pending()

    def on_goaway(self) -> None:
        # The client opens no new stream; those it opened may still finish (RFC 9113 6.8):
        # a held request must not fail because Envoy drains its connection. The streams
        # end with the connection if it closes first (``connection_lost``).
        self.refuse_new_streams()

    # -- out -----------------------------------------------------------------------------

    def flush_soon(self) -> None:
        """Write what is queued at the end of this loop iteration: the answers of every
        stream that runs in it go out in one write."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        data = self.http2.take()
        if data and self.transport is not None:
            self.transport.write(data)

    def refuse_new_streams(self) -> None:
        self._refusing = True

    def drain(self) -> None:
        """The server stops: GOAWAY now, so the client opens no new stream here, and the
        streams it has open may finish."""
        self.refuse_new_streams()
        if not self.http2.closed:
            self.http2.goaway()
            self.flush()

    def cancel_all(self) -> None:
        for stream in list(self.streams.values()):
            stream.cancel()

    def close(self) -> None:
        if self.transport is not None:
            if not self.http2.closed:
                self.http2.goaway()
            self.flush()
            transport = self.transport
            if transport.get_write_buffer_size() > EAGER_FLUSH_BYTES:
                # A peer that does not read: drop what it never took (it could otherwise
                # keep the connection, and what it holds, forever).
                transport.abort()
                return
            transport.close()  # the GOAWAY goes out first
            asyncio.get_running_loop().call_later(CLOSE_GRACE_S, transport.abort)

    def forget(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is not None:
            self.blocked.discard(stream)
            self.server.handler_streams -= 1


class _Stream:
    """One RPC: its incoming messages as an async iterator, its answers as DATA frames."""

    __slots__ = (
        "_buffer",
        "_ended",
        "_inbox",
        "_pending",
        "_waiter",
        "blocked",
        "closed",
        "connection",
        "handler",
        "headers_sent",
        "started",
        "stream_id",
        "task",
        "trailers",
    )

    def __init__(self, connection: _Connection, stream_id: int, handler: Any) -> None:
        self.connection = connection
        self.stream_id = stream_id
        self.handler = handler
        self.task: asyncio.Task[None] | None = None
        self._buffer = bytearray()
        self._inbox: deque[object] = deque()
        self._ended = False
        self._waiter: asyncio.Future[None] | None = None
        self._pending = bytearray()
        self.trailers: bytes | None = None
        self.headers_sent = False
        self.closed = False
        self.blocked = False
        self.started = False
        """Its handler's task has run: a task cancelled before that never runs its
        ``finally``, so whoever cancels it must forget the stream."""

    # -- in ------------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        limit = self.connection.server.limits.max_message_bytes
        while len(buffer) >= 5:
            length = int.from_bytes(buffer[1:5], "big")
            if buffer[0] != 0:
                self.fail(INTERNAL, "compressed messages are not supported")
                return
            if length > limit:
                self.fail(RESOURCE_EXHAUSTED, f"message of {length} bytes over {limit}")
                return
            if len(buffer) < 5 + length:
                break
            raw = bytes(buffer[5 : 5 + length])
            del buffer[: 5 + length]
            decode = self.handler.request_deserializer
            try:
                message = raw if decode is None else decode(raw)
            except Exception as error:  # any decode failure ends only this stream
                self.fail(INTERNAL, f"undecodable message: {error}")
                return
            self._inbox.append(message)
        if not self._inbox:
            self.connection.http2.acknowledge(self.stream_id)
        self._wake()

    def end_of_input(self) -> None:
        self._ended = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> object:
        while not self._inbox:
            if self._ended:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message = self._inbox.popleft()
        if not self._inbox:  # all read: the client may send more
            self.connection.http2.acknowledge(self.stream_id)
            self.connection.flush_soon()
        return message

    # -- the handler -------------------------------------------------------------------

    async def run(self) -> None:
        self.started = True
        handler = self.handler
        serialize: Callable[[Any], bytes] = handler.response_serializer or bytes
        status, message = OK, ""
        try:
            if handler.response_streaming:
                answers: AsyncIterator[object] = handler.stream_stream(self, _Context(self))
                try:
                    async for answer in answers:
                        if not self.send(serialize(answer)):
                            break  # the stream is gone: grpc.aio closes the handler here too
                finally:
                    aclose = getattr(answers, "aclose", None)
                    if aclose is not None:
                        await aclose()
            else:
                answer = await handler.stream_unary(self, _Context(self))
                self.send(serialize(answer))
        except asyncio.CancelledError:
            status, message = CANCELLED, "cancelled"
        except Exception as error:
            log.exception("a gRPC handler failed")
            status, message = INTERNAL, f"{type(error).__name__}: {error}"
        finally:
            self.finish(status, message)

    # -- out -----------------------------------------------------------------------------

    def send(self, message: bytes) -> bool:
        """Queue one message; False when the stream can no longer carry it."""
        if self.closed or self.stream_id not in self.connection.http2.streams:
            self.closed = True
            return False
        if not self.headers_sent:
            self.connection.http2.send_headers(self.stream_id, RESPONSE_HEADER_BLOCK)
            self.headers_sent = True
        self._pending += len(message).to_bytes(5, "big")  # flag 0, then the length
        self._pending += message
        self.send_pending()
        return True

    def send_pending(self) -> None:
        """Send what flow control allows; the rest waits for a WINDOW_UPDATE."""
        framing = self.connection.http2
        pending = self._pending
        if pending:
            sent = framing.send_data(self.stream_id, pending)
            del pending[:sent]
        if not pending and self.trailers is not None:
            framing.send_headers(self.stream_id, self.trailers, end_stream=True)
            self.trailers = None
            self._close()
        elif self.stream_id not in framing.streams:  # reset meanwhile
            self._close()
        self._block(bool(pending) and not self.closed)
        self.connection.flush_soon()

    def _block(self, blocked: bool) -> None:
        if blocked != self.blocked:
            self.blocked = blocked
            if blocked:
                self.connection.blocked.add(self)
            else:
                self.connection.blocked.discard(self)

    def finish(self, status: int, message: str = "") -> None:
        if self.closed:
            self.connection.forget(self.stream_id)
            return
        if status == CANCELLED:
            self._reset(http2.CANCEL)
            return
        self.trailers = _trailers(status, message, first=not self.headers_sent)
        self.headers_sent = True
        self.send_pending()

    def fail(self, status: int, message: str) -> None:
        """End this stream with an error status now; its handler is cancelled."""
        log.warning("gRPC stream %d failed: %s", self.stream_id, message)
        self._ended = True
        self._pending.clear()
        self.finish(status, message)
        self.cancel()

    def reset_by_client(self) -> None:
        self.closed = True
        self.cancel()

    def cancel(self) -> None:
        task = self.task
        if task is not None and not task.done():
            task.cancel()
            if not self.started:  # its ``finally`` will never run
                self._reset(http2.CANCEL)
        else:
            self._close()

    def _reset(self, code: int) -> None:
        self.connection.http2.reset(self.stream_id, code)
        self.connection.flush_soon()
        self._close()

    def _close(self) -> None:
        self.closed = True
        self.connection.forget(self.stream_id)


class _Context:
    """What a servicer may ask of its call (the servicers here ask nothing yet)."""

    __slots__ = ("_stream",)

    def __init__(self, stream: _Stream) -> None:
        self._stream = stream

    def cancelled(self) -> bool:
        return self._stream.closed


def _trailers(status: int, message: str, first: bool) -> bytes:
    """The status as a trailer block; ``first``: no headers went out yet (trailers-only)."""
    if status == OK and not message:
        return TRAILERS_ONLY_OK if first else OK_TRAILERS
    headers = [(b"grpc-status", str(status).encode())]
    if message:
        headers.append((b"grpc-message", _percent_encode(message)))
    block = http2.encode_headers(headers)
    return RESPONSE_HEADER_BLOCK + block if first else block


def _percent_encode(message: str) -> bytes:
    """grpc-message is percent-encoded UTF-8 (the gRPC HTTP/2 spec)."""
    out = bytearray()
    for byte in message.encode():
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)
