"""The HTTP/2 framing, frame by frame, without sockets.

A client is played by hand (frames built here, header blocks by ``hpack``'s encoder); what
the framing tells its listener and what it queues to send are checked. The same server
against grpc's real client is ``test_h2grpc.py``; behind Envoy, every integration test.
"""

from __future__ import annotations

import random
import struct

import hpack
import pytest

from extproc.transport import http2
from extproc.transport.http2 import Http2Error, Limits, ServerConnection

HEADERS = [(b":method", b"POST"), (b":path", b"/s/M"), (b"content-type", b"application/grpc")]


class Heard:
    """A listener that writes down every callback."""

    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []

    def on_request(
        self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool
    ) -> None:
        self.events.append(("request", stream_id, dict(headers), end_stream))

    def on_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        self.events.append(("data", stream_id, data, end_stream))

    def on_trailers(self, stream_id: int) -> None:
        self.events.append(("trailers", stream_id))

    def on_reset(self, stream_id: int) -> None:
        self.events.append(("reset", stream_id))

    def on_window(self, stream_id: int) -> None:
        self.events.append(("window", stream_id))

    def on_goaway(self) -> None:
        self.events.append(("goaway",))


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    length = len(payload)
    return struct.pack(">BHBBL", length >> 16, length & 0xFFFF, kind, flags, stream_id) + payload


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """What the server queued, split into (type, flags, stream, payload)."""
    out = []
    while data:
        high, low, kind, flags, stream_id = struct.unpack_from(">BHBBL", data)
        length = high << 16 | low
        out.append((kind, flags, stream_id, data[9 : 9 + length]))
        data = data[9 + length :]
    return out


def settings(**values: int) -> bytes:
    ids = {"initial_window": http2.INITIAL_WINDOW_SIZE, "max_frame": http2.MAX_FRAME_SIZE}
    return b"".join(struct.pack(">HL", ids[key], value) for key, value in values.items())


@pytest.fixture
def served() -> tuple[ServerConnection, Heard, hpack.Encoder]:
    """A connection past both prefaces, its queue emptied."""
    heard = Heard()
    connection = ServerConnection(heard)
    connection.initiate()
    connection.receive(http2.PREFACE + frame(http2.SETTINGS, 0, 0))
    connection.take()
    heard.events.clear()
    return connection, heard, hpack.Encoder()


def test_the_server_preface_states_the_limits_and_the_widest_connection_window() -> None:
    connection = ServerConnection(Heard(), Limits(max_concurrent_streams=7, stream_window=4096))
    connection.initiate()
    (kind, _, _, payload), (update, _, stream, step) = frames(connection.take())
    assert kind == http2.SETTINGS
    advertised = set(struct.iter_unpack(">HL", payload))
    assert {(http2.MAX_CONCURRENT_STREAMS, 7), (http2.INITIAL_WINDOW_SIZE, 4096)} <= advertised
    assert update == http2.WINDOW_UPDATE and stream == 0
    assert int.from_bytes(step, "big") == http2.MAX_WINDOW - http2.DEFAULT_WINDOW


def test_a_bad_preface_is_a_connection_error() -> None:
    connection = ServerConnection(Heard())
    with pytest.raises(Http2Error):
        connection.receive(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert frames(connection.take())[-1][0] == http2.GOAWAY


def test_frames_split_anywhere_arrive_whole(served: tuple) -> None:
    connection, heard, encoder = served
    data = frame(http2.HEADERS, http2.END_HEADERS, 1, encoder.encode(HEADERS))
    data += frame(http2.DATA, http2.END_STREAM, 1, b"hello")
    for byte in range(len(data)):
        connection.receive(data[byte : byte + 1])
    assert heard.events == [
        ("request", 1, dict(HEADERS), False),
        ("data", 1, b"hello", True),
    ]


def test_settings_and_pings_are_acknowledged(served: tuple) -> None:
    connection, _, _ = served
    connection.receive(frame(http2.SETTINGS, 0, 0, settings(max_frame=1 << 20)))
    connection.receive(frame(http2.PING, 0, 0, b"12345678"))
    sent = frames(connection.take())
    assert (http2.SETTINGS, http2.ACK, 0, b"") in sent
    assert (http2.PING, http2.ACK, 0, b"12345678") in sent
    assert connection.max_frame_size == 1 << 20


def test_continuation_padding_and_priority_are_read(served: tuple) -> None:
    connection, heard, encoder = served
    block = encoder.encode(HEADERS)
    padded = bytes([3]) + bytes(5) + block[:4] + b"pad"  # pad length, priority, fragment
    connection.receive(frame(http2.HEADERS, http2.PADDED | http2.PRIORITY_FLAG, 1, padded))
    connection.receive(frame(http2.CONTINUATION, http2.END_HEADERS, 1, block[4:]))
    connection.receive(frame(http2.DATA, http2.PADDED, 1, bytes([2]) + b"ab" + b"xx"))
    assert heard.events == [("request", 1, dict(HEADERS), False), ("data", 1, b"ab", False)]


def test_an_interrupted_header_block_is_a_connection_error(served: tuple) -> None:
    connection, _, encoder = served
    connection.receive(frame(http2.HEADERS, 0, 1, encoder.encode(HEADERS)[:3]))
    with pytest.raises(Http2Error):
        connection.receive(frame(http2.DATA, 0, 1, b"x"))


def test_trailers_end_the_input(served: tuple) -> None:
    connection, heard, encoder = served
    connection.receive(frame(http2.HEADERS, http2.END_HEADERS, 1, encoder.encode(HEADERS)))
    trailer = encoder.encode([(b"x-done", b"1")])
    connection.receive(frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 1, trailer))
    assert heard.events[-1] == ("trailers", 1)


def test_sends_respect_the_stream_and_connection_windows(served: tuple) -> None:
    connection, heard, encoder = served
    connection.receive(frame(http2.SETTINGS, 0, 0, settings(initial_window=10)))
    connection.receive(frame(http2.HEADERS, http2.END_HEADERS, 1, encoder.encode(HEADERS)))
    connection.take()
    assert connection.send_data(1, b"x" * 25) == 10
    assert connection.send_window(1) == 0
    connection.receive(frame(http2.WINDOW_UPDATE, 0, 1, (100).to_bytes(4, "big")))
    assert ("window", 1) in heard.events
    assert connection.send_data(1, b"x" * 15) == 15
    # the connection's window (65,535 by default) binds as well as the stream's
    connection.receive(frame(http2.SETTINGS, 0, 0, settings(initial_window=1 << 20)))
    assert connection.send_window(1) == http2.DEFAULT_WINDOW - 25
    sent = [f for f in frames(connection.take()) if f[0] == http2.DATA]
    assert sum(len(f[3]) for f in sent) == 25


def test_data_larger_than_a_frame_goes_in_several(served: tuple) -> None:
    connection, _, encoder = served
    connection.receive(frame(http2.SETTINGS, 0, 0, settings(initial_window=1 << 20)))
    connection.receive(frame(http2.WINDOW_UPDATE, 0, 0, (1 << 20).to_bytes(4, "big")))
    connection.receive(frame(http2.HEADERS, http2.END_HEADERS, 1, encoder.encode(HEADERS)))
    connection.take()
    assert connection.send_data(1, b"y" * 40_000) == 40_000
    sizes = [len(f[3]) for f in frames(connection.take()) if f[0] == http2.DATA]
    assert sizes == [16_384, 16_384, 40_000 - 2 * 16_384]


def test_a_reset_stream_is_forgotten_and_its_late_frames_dropped(served: tuple) -> None:
    connection, heard, encoder = served
    connection.receive(frame(http2.HEADERS, http2.END_HEADERS, 1, encoder.encode(HEADERS)))
    connection.receive(frame(http2.RST_STREAM, 0, 1, http2.CANCEL.to_bytes(4, "big")))
    connection.receive(frame(http2.DATA, 0, 1, b"late"))
    assert heard.events[1:] == [("reset", 1)]
    assert 1 not in connection.streams
    # a new stream after it still decodes: the HPACK table stayed in step
    connection.receive(frame(http2.HEADERS, http2.END_HEADERS, 3, encoder.encode(HEADERS)))
    assert heard.events[-1] == ("request", 3, dict(HEADERS), False)


def test_the_server_ends_a_stream_with_trailers_or_a_reset(served: tuple) -> None:
    connection, _, encoder = served
    for stream_id in (1, 3):
        connection.receive(
            frame(http2.HEADERS, http2.END_HEADERS, stream_id, encoder.encode(HEADERS))
        )
    connection.send_headers(1, http2.encode_headers([(b":status", b"200")]), end_stream=True)
    connection.reset(3, http2.CANCEL)
    sent = frames(connection.take())
    assert sent[0][:3] == (http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 1)
    assert hpack.Decoder().decode(sent[0][3], raw=True) == [(b":status", b"200")]
    assert sent[1] == (http2.RST_STREAM, 0, 3, http2.CANCEL.to_bytes(4, "big"))
    assert not connection.streams


def test_the_connection_window_is_topped_up_in_large_steps(
    served: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http2, "TOP_UP_AFTER", 100)
    connection, _, encoder = served
    connection.receive(frame(http2.HEADERS, http2.END_HEADERS, 1, encoder.encode(HEADERS)))
    connection.receive(frame(http2.DATA, 0, 1, b"z" * 60))
    assert connection.take() == b""  # no WINDOW_UPDATE per frame
    connection.receive(frame(http2.DATA, 0, 1, b"z" * 60))
    updates = {(f[2], int.from_bytes(f[3], "big")) for f in frames(connection.take())}
    assert updates == {(0, 120)}  # the stream's window only when its reader says so


def limited(**limits: float) -> tuple[ServerConnection, Heard, hpack.Encoder]:
    """Like ``served``, with these limits and a clock the test sets (``connection.now``)."""
    heard = Heard()
    now = [0.0]
    connection = ServerConnection(heard, Limits(**limits), clock=lambda: now[0])  # type: ignore[arg-type]
    connection.now = now  # type: ignore[attr-defined]
    connection.initiate()
    connection.receive(http2.PREFACE + frame(http2.SETTINGS, 0, 0))
    connection.take()
    return connection, heard, hpack.Encoder()


def test_a_stream_window_is_given_back_only_when_its_reader_acknowledges() -> None:
    connection, _, encoder = limited(stream_window=100)
    connection.receive(frame(http2.HEADERS, http2.END_HEADERS, 1, encoder.encode(HEADERS)))
    connection.receive(frame(http2.DATA, 0, 1, b"z" * 40))
    connection.acknowledge(1)
    assert connection.take() == b""  # under half the window: the sender still has room
    connection.receive(frame(http2.DATA, 0, 1, b"z" * 60))
    assert connection.take() == b""  # the reader has not read it yet
    connection.acknowledge(1)
    assert frames(connection.take()) == [(http2.WINDOW_UPDATE, 0, 1, (100).to_bytes(4, "big"))]


def test_a_stream_sending_past_its_window_is_a_flow_control_error() -> None:
    connection, _, encoder = limited(stream_window=100)
    connection.receive(frame(http2.HEADERS, http2.END_HEADERS, 1, encoder.encode(HEADERS)))
    connection.receive(frame(http2.DATA, 0, 1, b"z" * 100))
    with pytest.raises(Http2Error) as error:
        connection.receive(frame(http2.DATA, 0, 1, b"z"))
    assert error.value.code == http2.FLOW_CONTROL_ERROR


def test_streams_past_the_limit_are_refused_and_count_nowhere() -> None:
    connection, heard, encoder = limited(max_concurrent_streams=2)
    block = encoder.encode(HEADERS)
    for stream_id in (1, 3, 5):
        connection.receive(frame(http2.HEADERS, http2.END_HEADERS, stream_id, block))
    assert [e[1] for e in heard.events if e[0] == "request"] == [1, 3]
    refused = http2.REFUSED_STREAM.to_bytes(4, "big")
    assert frames(connection.take()) == [(http2.RST_STREAM, 0, 5, refused)]
    assert sorted(connection.streams) == [1, 3]
    connection.receive(frame(http2.RST_STREAM, 0, 1, http2.CANCEL.to_bytes(4, "big")))
    connection.receive(frame(http2.HEADERS, http2.END_HEADERS, 7, block))
    assert sorted(connection.streams) == [3, 7]


@pytest.mark.parametrize(
    "empty",
    [
        frame(http2.DATA, 0, 1),
        frame(http2.CONTINUATION, 0, 1),
        frame(0x42, 0, 0),
        frame(http2.PRIORITY, 0, 1, bytes(5)),
    ],
    ids=["empty DATA", "empty CONTINUATION", "unknown type", "PRIORITY"],
)
def test_a_flood_of_frames_that_carry_nothing_ends_the_connection(empty: bytes) -> None:
    connection, _, encoder = limited(max_idle_frames=5)
    flags = 0 if empty[3] == http2.CONTINUATION else http2.END_HEADERS
    connection.receive(frame(http2.HEADERS, flags, 1, encoder.encode(HEADERS)))
    connection.receive(empty * 5)
    with pytest.raises(Http2Error) as error:
        connection.receive(empty)
    assert error.value.code == http2.ENHANCE_YOUR_CALM
    assert frames(connection.take())[-1][0] == http2.GOAWAY


def test_frames_that_carry_something_reset_the_flood_count(served: tuple) -> None:
    connection, _, encoder = served
    connection.receive(frame(http2.HEADERS, http2.END_HEADERS, 1, encoder.encode(HEADERS)))
    for _ in range(3 * http2.MAX_IDLE_FRAMES):
        connection.receive(frame(http2.DATA, 0, 1) + frame(http2.DATA, 0, 1, b"x"))
    assert not connection.closed


def test_pings_closer_than_the_interval_are_strikes_until_too_many() -> None:
    connection, _, _ = limited(ping_min_interval_s=1.0, max_ping_strikes=2)
    ping = frame(http2.PING, 0, 0, bytes(8))
    for _ in range(5):  # a keepalive every 10 s is never a strike
        connection.now[0] += 10  # type: ignore[attr-defined]
        connection.receive(ping)
    assert [f[:2] for f in frames(connection.take())] == [(http2.PING, http2.ACK)] * 5
    connection.receive(ping * 2)  # two strikes
    with pytest.raises(Http2Error) as error:
        connection.receive(ping)
    assert error.value.code == http2.ENHANCE_YOUR_CALM


@pytest.mark.parametrize(
    "bad",
    [
        frame(http2.PING, 0, 0, bytes(16384)),
        frame(http2.PING, 0, 1, bytes(8)),
        frame(http2.RST_STREAM, 0, 1, bytes(3)),
        frame(http2.PRIORITY, 0, 1, bytes(4)),
        frame(http2.SETTINGS, http2.ACK, 0, bytes(6)),
        frame(http2.SETTINGS, 0, 1, b""),
    ],
    ids=[
        "oversized PING",
        "PING on a stream",
        "short RST_STREAM",
        "short PRIORITY",
        "SETTINGS ACK with a payload",
        "SETTINGS on a stream",
    ],
)
def test_malformed_control_frames_are_connection_errors(served: tuple, bad: bytes) -> None:
    connection, _, _ = served
    with pytest.raises(Http2Error):
        connection.receive(bad)
    assert frames(connection.take())[-1][0] == http2.GOAWAY


def test_the_first_frame_after_the_preface_must_be_settings() -> None:
    connection = ServerConnection(Heard())
    with pytest.raises(Http2Error):
        connection.receive(http2.PREFACE + frame(http2.PING, 0, 0, bytes(8)))
    assert not connection.preface_seen


@pytest.mark.parametrize(
    "bad",
    [
        frame(http2.PUSH_PROMISE, http2.END_HEADERS, 1, bytes(4)),
        frame(http2.HEADERS, http2.END_HEADERS, 2, b""),
        frame(http2.HEADERS, http2.END_HEADERS, 1, b"\xff\xff\xff\xff"),
        frame(http2.DATA, 0, 1, bytes(http2.DEFAULT_FRAME_SIZE + 1)),
        frame(http2.WINDOW_UPDATE, 0, 0, (http2.MAX_WINDOW).to_bytes(4, "big")),
        frame(http2.SETTINGS, 0, 0, b"\x00\x04"),
    ],
    ids=["push", "even-stream", "hpack", "frame-size", "window-overflow", "settings-size"],
)
def test_protocol_violations_end_the_connection_with_goaway(served: tuple, bad: bytes) -> None:
    connection, _, _ = served
    with pytest.raises(Http2Error):
        connection.receive(bad)
    assert frames(connection.take())[-1][0] == http2.GOAWAY
    connection.receive(frame(http2.PING, 0, 0, bytes(8)))  # nothing more is read
    assert connection.take() == b""


def test_header_blocks_are_hpack_integers_past_their_prefix() -> None:
    long_value = b"v" * 300
    block = http2.encode_headers([(b"grpc-message", long_value)])
    assert hpack.Decoder().decode(block, raw=True) == [(b"grpc-message", long_value)]


def test_a_repeated_header_block_decodes_the_same_until_the_table_changes(
    served: tuple,
) -> None:
    connection, heard, encoder = served
    first = encoder.encode(HEADERS)  # fills the dynamic table
    again = encoder.encode(HEADERS)  # indexed only: the same bytes every time from here
    assert encoder.encode(HEADERS) == again
    for stream_id, block in ((1, first), (3, again), (5, again)):
        connection.receive(frame(http2.HEADERS, http2.END_HEADERS, stream_id, block))
    assert again in connection._decoded
    # a new entry shifts every dynamic index: the remembered meaning is dropped
    other = [(b":method", b"POST"), (b":path", b"/s/Other"), (b"x-new", b"1")]
    connection.receive(frame(http2.HEADERS, http2.END_HEADERS, 7, encoder.encode(other)))
    assert not connection._decoded
    connection.receive(frame(http2.HEADERS, http2.END_HEADERS, 9, encoder.encode(HEADERS)))
    assert [event[2] for event in heard.events] == [dict(HEADERS)] * 3 + [
        dict(other),
        dict(HEADERS),
    ]


def random_frame(rng: random.Random, encoder: hpack.Encoder, opened: list[int]) -> bytes:
    """Mostly a frame a client could send (new streams, data on them, window updates,
    pings, resets), sometimes any type, flags, stream and bytes."""
    if rng.random() < 0.15:
        kind = rng.choice([*range(10), 0xFA])
        stream_id = rng.choice([0, 2, rng.randrange(1 << 31), *opened[-2:]])
        payload = rng.randbytes(rng.choice([0, 1, 4, 8, 40]))
        return frame(kind, rng.randrange(256), stream_id, payload)
    roll = rng.random()
    if roll < 0.3 or not opened:
        opened.append(opened[-1] + 2 if opened else 1)
        flags = http2.END_HEADERS | (http2.END_STREAM if rng.random() < 0.2 else 0)
        return frame(http2.HEADERS, flags, opened[-1], encoder.encode(HEADERS))
    stream_id = rng.choice(opened)
    if roll < 0.7:
        padded = rng.random() < 0.2
        body = rng.randbytes(rng.randrange(0, 300))
        payload = bytes([3]) + body + b"pad" if padded else body
        flags = (http2.PADDED if padded else 0) | (http2.END_STREAM if rng.random() < 0.3 else 0)
        return frame(http2.DATA, flags, stream_id, payload)
    if roll < 0.8:
        step = rng.randrange(1, 1 << 16).to_bytes(4, "big")
        return frame(http2.WINDOW_UPDATE, 0, rng.choice([0, stream_id]), step)
    if roll < 0.9:
        return frame(http2.PING, 0, 0, rng.randbytes(8))
    if roll < 0.95:
        return frame(http2.SETTINGS, 0, 0, settings(initial_window=rng.randrange(1 << 20)))
    return frame(http2.RST_STREAM, 0, stream_id, http2.CANCEL.to_bytes(4, "big"))


@pytest.mark.parametrize("seed", range(200))
def test_any_frame_sequence_ends_in_frames_or_a_connection_error(seed: int) -> None:
    """Whatever a peer sends, the framing answers with frames or ``Http2Error`` (GOAWAY
    queued): never another exception, which would escape the server's ``data_received``."""
    rng = random.Random(seed)
    heard = Heard()
    connection = ServerConnection(heard)
    connection.initiate()
    encoder = hpack.Encoder()
    opened: list[int] = []
    data = http2.PREFACE + b"".join(random_frame(rng, encoder, opened) for _ in range(60))
    try:
        while data:
            cut = rng.randrange(1, 64)
            connection.receive(data[:cut])
            data = data[cut:]
            for stream_id in list(connection.streams):  # the owner answers as it goes
                connection.send_data(stream_id, b"answer")
    except Http2Error:
        assert connection.closed
        assert frames(connection.take())[-1][0] == http2.GOAWAY
    assert all(stream_id % 2 == 1 for stream_id in connection.streams)
