"""The server side of one HTTP/2 connection, as much of it as a gRPC server needs.

Why not python-hyper's h2, which the server used before: h2 is a general state machine that
builds a frame object and an event object for every frame and runs each through its
connection's and the stream's state machines, and at saturation that was a large share of
the service's CPU (docs/benchmarks/internals.md). Here a frame is a slice of the receive
buffer handed to a callback, the answers' header blocks are constants, and the receive
windows are so large that they are topped up once per GiB; HPACK decoding is the ``hpack``
package (h2's own decoder). Scope: RFC 9113, server side, cleartext with prior knowledge;
PRIORITY and unknown frame types are ignored, and a protocol violation is a connection error
(``Http2Error``). The caller owns stream semantics and what the socket may buffer; this
module only frames. What a hostile peer could make it hold is bounded (``Limits``).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import hpack
import hpack.exceptions

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9

END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20

# SETTINGS identifiers (RFC 9113 section 6.5.2)
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS = 1, 2, 3
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 4, 5, 6

# error codes (section 7)
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR = 0x0, 0x1, 0x3, 0x6
REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x7, 0x8, 0x9, 0xB

MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
TOP_UP_AFTER = 1 << 30
"""Received bytes after which the connection's receive window is given back: half of what
is offered, so a sender never stalls on the connection; each stream's own window is what
bounds what it may send unread."""
STREAM_WINDOW = 1 << 20
"""Each stream's receive window (SETTINGS_INITIAL_WINDOW_SIZE): what a client may send that
the handler has not read. Given back at half, so a large message flows at loopback speed."""

MAX_HEADER_LIST_SIZE_BYTES = 64 << 10
"""The largest header list accepted (advertised in SETTINGS): gRPC metadata is small."""
DECODED_BLOCKS = 64
"""Distinct header blocks remembered at most (a client sends a handful)."""
MAX_IDLE_FRAMES = 100
"""Frames in a row that carry nothing (empty DATA or CONTINUATION, PRIORITY, unknown types)
before the connection is closed: a client doing work never sends more than a few."""
PING_MIN_INTERVAL_S = 1.0
MAX_PING_STRIKES = 10
"""Pings closer together than the interval are strikes; past the last, the connection is
closed (as grpc's server does, with its ``too_many_pings``). Envoy pings every 10 s."""

_FRAME_HEADER = struct.Struct(">BHBBL")  # length (24 bits as 8 + 16), type, flags, stream
_SETTING = struct.Struct(">HL")


class Http2Error(Exception):
    """The peer broke the protocol: the connection must end with GOAWAY(code)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Listener(Protocol):
    """What a connection's owner hears. Stream ids are the client's (odd) ones."""

    def on_request(
        self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool
    ) -> None: ...

    def on_data(self, stream_id: int, data: bytes, end_stream: bool) -> None: ...

    def on_trailers(self, stream_id: int) -> None:
        """The client's trailers: the end of its input (gRPC clients send none)."""

    def on_reset(self, stream_id: int) -> None: ...

    def on_window(self, stream_id: int) -> None:
        """Room to send opened on this stream, or on every stream (0: the connection)."""

    def on_goaway(self) -> None: ...


def encode_int(value: int, prefix_bits: int, first: int) -> bytes:
    """HPACK's prefix-coded integer (RFC 7541 section 5.1), ``first`` holding the flag bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    """A header block of literals without indexing (no dynamic table, no Huffman): every
    block stands alone, so constant ones can be encoded once."""
    out = bytearray()
    for name, value in headers:
        if name == b":status" and value == b"200":
            out.append(0x88)  # static table entry 8
            continue
        out.append(0x00)
        out += encode_int(len(name), 7, 0x00)
        out += name
        out += encode_int(len(value), 7, 0x00)
        out += value
    return bytes(out)


class _Stream:
    """What the framing keeps of an open stream: its send window, the input not yet given
    back to the peer's window, and who has ended it."""

    __slots__ = ("received", "remote_closed", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self.received = 0
        self.remote_closed = False


@dataclass(frozen=True, slots=True)
class Limits:
    """What one connection lets a peer make it hold.

    Streams are bounded by SETTINGS_MAX_CONCURRENT_STREAMS (enforced with REFUSED_STREAM), each
    stream's unread input by its receive window (given back only when the caller acknowledges,
    ``acknowledge``), and frames that carry nothing and pings sent too often end the connection
    with ENHANCE_YOUR_CALM. The frames handled: the client's preface and SETTINGS, HEADERS with
    CONTINUATION, DATA, RST_STREAM, WINDOW_UPDATE, PING, GOAWAY. On a protocol violation the
    caller sends the GOAWAY queued here and closes.
    """

    max_concurrent_streams: int = 1024
    stream_window: int = STREAM_WINDOW
    max_header_list_size: int = MAX_HEADER_LIST_SIZE_BYTES
    max_idle_frames: int = MAX_IDLE_FRAMES
    ping_min_interval_s: float = PING_MIN_INTERVAL_S
    max_ping_strikes: int = MAX_PING_STRIKES


class ServerConnection:
    """Frames in (``receive``), callbacks out; frames out queued until ``take``."""

    def __init__(
        self,
        listener: Listener,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.listener = listener
        self.limits = limits = limits or Limits()
        self.streams: dict[int, _Stream] = {}
        self.last_stream_id = 0
        self.window = DEFAULT_WINDOW
        """What the peer lets this side send on the connection."""
        self.initial_window = DEFAULT_WINDOW
        """The peer's SETTINGS_INITIAL_WINDOW_SIZE: each new stream's send window."""
        self.max_frame_size = DEFAULT_FRAME_SIZE
        """The largest frame the peer accepts."""
        self.received = 0
        """Bytes received on the connection since its window was last topped up."""
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = limits.max_header_list_size
        self._decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}
        """Header blocks decoded since the HPACK table last changed (``_decode``)."""
        self._clock = clock
        self._idle_frames = 0
        """Frames in a row that carried nothing (``MAX_IDLE_FRAMES``)."""
        self._last_ping = -1e9
        self._ping_strikes = 0
        self.preface_seen = False
        """The client's preface and first SETTINGS arrived: the handshake is over."""
        self._out = bytearray()
        self._in = bytearray()
        self._preface_bytes_seen = False
        self._continuing: tuple[int, int, bytearray] | None = None
        """A header block waiting for CONTINUATION: stream, HEADERS flags, fragments."""
        self.closed = False

    # -- out -----------------------------------------------------------------------------

    def initiate(self) -> None:
        """Queue this side's preface: SETTINGS with the limits, and the connection window at
        its widest (each stream's own window bounds what waits unread)."""
        limits = self.limits
        settings = (
            _SETTING.pack(MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams)
            + _SETTING.pack(INITIAL_WINDOW_SIZE, limits.stream_window)
            + _SETTING.pack(MAX_HEADER_LIST_SIZE, limits.max_header_list_size)
        )
        self._frame(SETTINGS, 0, 0, settings)
        self._frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big"))

    @property
    def queued(self) -> int:
        """Bytes queued to send (``take`` empties it)."""
        return len(self._out)

    def take(self) -> bytes:
        """Everything queued to send, once."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def send_headers(self, stream_id: int, block: bytes, end_stream: bool = False) -> None:
        """Send an encoded header block (``encode_headers``); with ``end_stream``, the
        stream is over on this side and forgotten."""
        if stream_id not in self.streams:
            return
        self._ping_strikes = 0
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        limit = self.max_frame_size
        if len(block) <= limit:
            self._frame(HEADERS, flags, stream_id, block)
        else:  # header blocks here are tiny; kept correct anyway
            self._frame(HEADERS, flags & ~END_HEADERS, stream_id, block[:limit])
            rest = block[limit:]
            while rest:
                chunk, rest = rest[:limit], rest[limit:]
                self._frame(CONTINUATION, 0 if rest else END_HEADERS, stream_id, chunk)
        if end_stream:
            del self.streams[stream_id]

    def send_window(self, stream_id: int) -> int:
        """How many DATA bytes this stream may send now (0 if it is gone)."""
        stream = self.streams.get(stream_id)
        if stream is None:
            return 0
        return min(stream.window, self.window)

    def send_data(self, stream_id: int, data: bytes | bytearray | memoryview) -> int:
        """Send as much of ``data`` as flow control allows; returns how much."""
        stream = self.streams.get(stream_id)
        if stream is None:
            return 0
        size = min(len(data), stream.window, self.window)
        if size <= 0:
            return 0
        stream.window -= size
        self.window -= size
        limit = self.max_frame_size
        view = memoryview(data)
        for start in range(0, size, limit):
            self._frame(DATA, 0, stream_id, view[start : min(start + limit, size)])
        return size

    def acknowledge(self, stream_id: int) -> None:
        """The caller has read what arrived on this stream: give it back to the peer's
        window once half of the window is used (until then the peer still has room)."""
        stream = self.streams.get(stream_id)
        if stream is not None and stream.received >= self.limits.stream_window // 2:
            self._frame(WINDOW_UPDATE, 0, stream_id, stream.received.to_bytes(4, "big"))
            stream.received = 0

    def reset(self, stream_id: int, code: int) -> None:
        """RST_STREAM; the stream is forgotten (frames still in flight are dropped)."""
        if self.streams.pop(stream_id, None) is not None:
            self._frame(RST_STREAM, 0, stream_id, code.to_bytes(4, "big"))

    def goaway(self, code: int = NO_ERROR) -> None:
        """Tell the peer the connection ends after the streams it has opened."""
        payload = self.last_stream_id.to_bytes(4, "big") + code.to_bytes(4, "big")
        self._frame(GOAWAY, 0, 0, payload)

    def _frame(
        self, kind: int, flags: int, stream_id: int, payload: bytes | bytearray | memoryview
    ) -> None:
        length = len(payload)
        self._out += _FRAME_HEADER.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id)
        self._out += payload

    # -- in ------------------------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        """Parse what arrived; complete frames are acted on, a partial one is kept.

        Raises ``Http2Error`` on a connection error (nothing more may be received)."""
        if self.closed:
            return
        buffer = self._in
        if buffer:
            buffer += data
            data = bytes(buffer)
            buffer.clear()
        offset = 0
        if not self._preface_bytes_seen:
            if len(data) < len(PREFACE):
                if not PREFACE.startswith(data):
                    raise self._fail(PROTOCOL_ERROR, "not an HTTP/2 client preface")
                self._in += data
                return
            if not data.startswith(PREFACE):
                raise self._fail(PROTOCOL_ERROR, "not an HTTP/2 client preface")
            self._preface_bytes_seen = True
            offset = len(PREFACE)
        end = len(data)
        unpack = _FRAME_HEADER.unpack_from
        while end - offset >= 9:
            high, low, kind, flags, stream_id = unpack(data, offset)
            length = high << 16 | low
            if length > DEFAULT_FRAME_SIZE:  # this side never raises SETTINGS_MAX_FRAME_SIZE
                raise self._fail(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            if end - offset - 9 < length:
                break
            start = offset + 9
            offset = start + length
            self._dispatch(kind, flags, stream_id & MAX_WINDOW, data[start:offset])
        if offset < end:
            self._in += data[offset:]

    def _fail(self, code: int, message: str) -> Http2Error:
        self.closed = True
        self.goaway(code)
        return Http2Error(code, message)

    def _dispatch(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if not self.preface_seen:
            if kind != SETTINGS or flags & ACK:
                raise self._fail(PROTOCOL_ERROR, "the preface's first frame is not SETTINGS")
            self.preface_seen = True
        if self._continuing is not None and kind != CONTINUATION:
            raise self._fail(PROTOCOL_ERROR, "a header block interrupted")
        if kind in (DATA, HEADERS, CONTINUATION):
            if payload or (kind == DATA and flags & END_STREAM):
                self._idle_frames = 0
            else:  # empty, and it ends nothing
                self._idle()
        elif kind < CONTINUATION and kind != PRIORITY:  # control frames (PRIORITY is idle)
            self._idle_frames = 0
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == RST_STREAM:
            if len(payload) != 4 or stream_id == 0:
                raise self._fail(PROTOCOL_ERROR, "a malformed RST_STREAM")
            if self.streams.pop(stream_id, None) is not None:
                self.listener.on_reset(stream_id)
        elif kind == SETTINGS:
            if stream_id != 0:
                raise self._fail(PROTOCOL_ERROR, "SETTINGS on a stream")
            if not flags & ACK:
                self._settings(payload)
            elif payload:
                raise self._fail(FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
        elif kind == PING:
            if len(payload) != 8 or stream_id != 0:
                raise self._fail(FRAME_SIZE_ERROR, f"a PING of {len(payload)} bytes")
            if not flags & ACK:
                self._ping(payload)
        elif kind == GOAWAY:
            self.listener.on_goaway()
        elif kind == PUSH_PROMISE:
            raise self._fail(PROTOCOL_ERROR, "a client sent PUSH_PROMISE")
        elif kind == PRIORITY:
            if len(payload) != 5:
                raise self._fail(FRAME_SIZE_ERROR, "a PRIORITY frame of the wrong size")
            self._idle()
        elif kind > CONTINUATION:  # unknown types: ignored (RFC 9113 section 5.5)
            self._idle()

    def _idle(self) -> None:
        """One more frame that did nothing; a client that keeps sending them is flooding."""
        self._idle_frames += 1
        if self._idle_frames > self.limits.max_idle_frames:
            raise self._fail(ENHANCE_YOUR_CALM, "a flood of frames that carry nothing")

    def _ping(self, payload: bytes) -> None:
        now = self._clock()
        if now - self._last_ping < self.limits.ping_min_interval_s:
            self._ping_strikes += 1
            if self._ping_strikes > self.limits.max_ping_strikes:
                raise self._fail(ENHANCE_YOUR_CALM, "too many pings")
        self._last_ping = now
        self._frame(PING, ACK, 0, payload)

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        self.received += len(payload)  # padding included: flow control counts it
        if self.received >= TOP_UP_AFTER:
            self._frame(WINDOW_UPDATE, 0, 0, self.received.to_bytes(4, "big"))
            self.received = 0
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:
            return  # a stream already gone: its frames in flight are dropped
        stream.received += len(payload)
        if stream.received > self.limits.stream_window:
            raise self._fail(FLOW_CONTROL_ERROR, f"stream {stream_id} sent past its window")
        if flags & PADDED:
            payload = self._unpad(payload)
        end_stream = bool(flags & END_STREAM)
        if end_stream:
            stream.remote_closed = True
        self.listener.on_data(stream_id, payload, end_stream)

    def _unpad(self, payload: bytes) -> bytes:
        if not payload or payload[0] >= len(payload):
            raise self._fail(PROTOCOL_ERROR, "padding longer than its frame")
        return payload[1 : len(payload) - payload[0]]

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or stream_id % 2 == 0:
            raise self._fail(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        if flags & PADDED:
            payload = self._unpad(payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block(flags, stream_id, payload)
        else:
            self._continuing = (stream_id, flags, bytearray(payload))

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        pending = self._continuing
        if pending is None or pending[0] != stream_id:
            raise self._fail(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        fragments = pending[2]
        fragments += payload
        if len(fragments) > self.limits.max_header_list_size * 2:
            raise self._fail(PROTOCOL_ERROR, "a header block over the advertised limit")
        if flags & END_HEADERS:
            self._continuing = None
            self._header_block(pending[1], stream_id, bytes(fragments))

    def _header_block(self, flags: int, stream_id: int, block: bytes) -> None:
        headers = self._decoded.get(block)
        if headers is None:  # decoded even for a stream that is gone: the table must keep step
            headers = self._decode(block)
        end_stream = bool(flags & END_STREAM)
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers: the client's input is over
            if not stream.remote_closed:
                stream.remote_closed = True
                self.listener.on_trailers(stream_id)
            return
        if stream_id <= self.last_stream_id:
            return  # trailers of a stream already gone
        self.last_stream_id = stream_id
        if len(self.streams) >= self.limits.max_concurrent_streams:
            self._frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big"))
            return
        self.streams[stream_id] = stream = _Stream(self.initial_window)
        stream.remote_closed = end_stream
        self.listener.on_request(stream_id, headers, end_stream)

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """Decode a header block, and remember it if it left the HPACK table as it was.

        Envoy's gRPC client sends the same block for every stream once its dynamic table
        holds the repeated fields (indexed fields and literals without indexing): decoding
        it was ~7 % of the service's CPU at saturation. While the table does not change, the
        same bytes mean the same headers; a block that changes it (a new entry, a size
        update) moves the indices, so everything remembered is forgotten."""
        table = self._decoder.header_table.dynamic_entries
        size, newest = len(table), table[0] if table else None
        try:
            # a list of (name, value) bytes pairs with raw=True
            headers = cast(list[tuple[bytes, bytes]], self._decoder.decode(block, raw=True))
        except hpack.exceptions.HPACKError as error:
            raise self._fail(COMPRESSION_ERROR, f"bad header block: {error}") from None
        if len(table) != size or (table[0] if table else None) is not newest:
            self._decoded.clear()
        else:
            if len(self._decoded) >= DECODED_BLOCKS:
                self._decoded.clear()
            self._decoded[block] = headers
        return headers

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise self._fail(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = int.from_bytes(payload, "big") & MAX_WINDOW
        if stream_id == 0:
            self.window += increment
            if self.window > MAX_WINDOW or increment == 0:
                raise self._fail(FLOW_CONTROL_ERROR, "connection window overflow or zero step")
            self.listener.on_window(0)
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        stream.window += increment
        if stream.window > MAX_WINDOW or increment == 0:
            self.reset(stream_id, FLOW_CONTROL_ERROR)
            self.listener.on_reset(stream_id)
            return
        self.listener.on_window(stream_id)

    def _settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise self._fail(FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        for offset in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, offset)
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise self._fail(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE too big")
                delta = value - self.initial_window
                self.initial_window = value
                for stream in self.streams.values():
                    stream.window += delta
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= (1 << 24) - 1:
                    raise self._fail(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.max_frame_size = value
            # HEADER_TABLE_SIZE binds only an encoder's dynamic table, which this side
            # never uses; the others do not concern a server.
        self._frame(SETTINGS, ACK, 0, b"")
        if self.initial_window > 0:
            self.listener.on_window(0)
