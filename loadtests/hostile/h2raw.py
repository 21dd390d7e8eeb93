"""A raw HTTP/2 client that can break the protocol: the attacker of the hostile-client suite.

grpc's own client cannot send a reset in the same packet as its HEADERS, a PING of 16 KiB or
a million empty frames, so the attacks are written frame by frame on a plain socket (header
blocks by ``hpack``, the library the server decodes them with). What the server sends back
is parsed just enough to see its SETTINGS, WINDOW_UPDATEs, RST_STREAMs and GOAWAY.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass, field

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
INITIAL_WINDOW_SIZE, MAX_CONCURRENT_STREAMS = 4, 3
CANCEL, REFUSED_STREAM = 0x8, 0x7
DEFAULT_WINDOW = 65_535


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    length = len(payload)
    return struct.pack(">BHBBL", length >> 16, length & 0xFFFF, kind, flags, stream_id) + payload


def grpc_message(payload: bytes) -> bytes:
    """One length-prefixed, uncompressed gRPC message."""
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


@dataclass
class Heard:
    """What the server has sent so far."""

    settings: dict[int, int] = field(default_factory=dict)
    goaway: int | None = None
    """The error code of the server's last GOAWAY (0: a graceful one)."""
    resets: dict[int, int] = field(default_factory=dict)
    """Stream -> the code of the server's RST_STREAM on it."""
    window_updates: dict[int, int] = field(default_factory=dict)
    """Stream (0: the connection) -> the sum of the server's WINDOW_UPDATEs on it."""
    data_streams: set[int] = field(default_factory=set)
    """Streams the server sent DATA or HEADERS on."""
    ended_streams: set[int] = field(default_factory=set)
    """Streams the server ended (END_STREAM)."""
    closed: bool = False
    """The server closed the connection."""


class RawConnection:
    """One TCP connection to the server, frames in and out by hand.

    ``reading`` False leaves the server's frames unread (the client that never reads);
    otherwise a task reads and parses them into ``heard``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.heard = Heard()
        self.encoder = hpack.Encoder()
        self.next_stream = 1
        self._reading: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()
        """Set whenever something is heard (wait on it, then check ``heard``)."""

    @classmethod
    async def open(
        cls,
        port: int,
        handshake: bool = True,
        reading: bool = True,
        host: str = "127.0.0.1",
        receive_buffer: int | None = None,
    ) -> RawConnection:
        """``receive_buffer``: the socket's SO_RCVBUF, small for a client that never reads
        (so the kernel does not absorb for it what the server would otherwise queue)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock)
        connection = cls(reader, writer)
        if handshake:
            connection.send(PREFACE + frame(SETTINGS, 0, 0))
        if reading:
            connection._reading = asyncio.create_task(connection._read())
        return connection

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def drain(self) -> None:
        """Wait until the kernel took what was sent (raises once the server closed)."""
        await self.writer.drain()

    def headers_block(self, path: str) -> bytes:
        return self.encoder.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "fairlane"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ]
        )

    def open_stream(self, path: str, end_stream: bool = False) -> tuple[int, bytes]:
        """A new stream's id and its HEADERS frame (not sent: the caller batches)."""
        stream_id = self.next_stream
        self.next_stream += 2
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        return stream_id, frame(HEADERS, flags, stream_id, self.headers_block(path))

    async def wait_for(self, condition: object, timeout_s: float) -> bool:
        """Wait until ``condition()`` holds or the connection closed; whether it held."""
        check = condition  # a callable; typed loosely so lambdas read naturally at call sites
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not check():  # type: ignore[operator]
            if self.heard.closed:
                return bool(check())  # type: ignore[operator]
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(remaining, 0.1))
        return True

    async def close(self) -> None:
        """Drop the connection now, unsent frames and all (an attacker that stopped reading
        would otherwise wait forever for the server to take them)."""
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading
        self.writer.transport.abort()
        with contextlib.suppress(OSError, ConnectionError):
            await self.writer.wait_closed()

    async def _read(self) -> None:
        buffer = bytearray()
        heard = self.heard
        try:
            while chunk := await self.reader.read(1 << 16):
                buffer += chunk
                while len(buffer) >= 9:
                    high, low, kind, flags, stream_id = struct.unpack_from(">BHBBL", buffer)
                    length = high << 16 | low
                    if len(buffer) < 9 + length:
                        break
                    payload = bytes(buffer[9 : 9 + length])
                    del buffer[: 9 + length]
                    self._heard(kind, flags, stream_id & 0x7FFFFFFF, payload)
                self.changed.set()
        except (ConnectionError, OSError):
            pass
        heard.closed = True
        self.changed.set()

    def _heard(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        heard = self.heard
        if kind == SETTINGS and not flags & ACK:
            for offset in range(0, len(payload) - 5, 6):
                key, value = struct.unpack_from(">HL", payload, offset)
                heard.settings[key] = value
        elif kind == GOAWAY:
            heard.goaway = int.from_bytes(payload[4:8], "big")
        elif kind == RST_STREAM:
            heard.resets[stream_id] = int.from_bytes(payload, "big")
        elif kind == WINDOW_UPDATE:
            step = int.from_bytes(payload, "big") & 0x7FFFFFFF
            heard.window_updates[stream_id] = heard.window_updates.get(stream_id, 0) + step
        elif kind in (DATA, HEADERS):
            heard.data_streams.add(stream_id)
        if kind in (DATA, HEADERS) and flags & END_STREAM:
            heard.ended_streams.add(stream_id)
