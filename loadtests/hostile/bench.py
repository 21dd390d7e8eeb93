"""A real ``fairlane serve`` under hostile HTTP/2 clients: what each attack costs it.

The unit suite (``tests/extproc/transport/test_hostile_clients.py``) proves the gRPC server's
limits hold on an in-process server; this measures them in figures on the process Envoy
really talks to: one ``fairlane serve`` (default policy, its one backend an engine that is
always full, so a keyed request is held), attacked by raw HTTP/2 clients, one attack after
the other, while a legit grpcio client in a process of its own calls ``Process`` every 100 ms
with a 1 s deadline, and the service's RSS is sampled every 50 ms. Each attack is bounded in
streams, bytes and seconds, on loopback only, and prints its row of the markdown table as it
finishes (PASS or FAIL where it has a target). The service is always stopped at the end, on
failure and Ctrl-C too. When the server has read a batch is learnt from a ``probe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TextIO

import grpc
import psutil  # type: ignore[import-untyped]  # locust's dependency; no stubs here
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.fleet.backend import parse_backend
from extproc.ops.processes import Child, ProcessGroup, free_port, wait_port_open
from extproc.ops.service_replicas import service_argv
from extproc.policy import load_policy
from extproc.transport.limits import ServerLimits
from loadtests.hostile import h2raw
from loadtests.hostile.h2raw import RawConnection, frame, grpc_message

PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
DEFAULT_POLICY = Path(__file__).resolve().parents[2] / "policies" / "default.yaml"

LEGIT_PERIOD_S = 0.1
LEGIT_TIMEOUT_S = 1.0
LEGIT_SHARE_TARGET = 0.9
LEGIT_WINDOW_S = 1.0
"""The legit calls of a row: from its attack's start to its end, and at least this long."""
RSS_PERIOD_S = 0.05
SETTLE_S = 0.5
"""After an attack's connections are closed, before the end RSS is read."""
PROBE_TIMEOUT_S = 30.0
BATCH = 500
"""Streams per write in the rapid-reset and open-stream attacks."""
FLOOD_FRAMES = 1000
"""Frames per write in the floods."""
STALL_S = 1.0
"""The flow-control attack stops once no window was left for this long."""
SLOW_WAIT_S = 20.0
"""How long the silent and half-preface connections are given to be closed (the server's
handshake timeout is 10 s, checked every second)."""
MIB = 1 << 20
MB = 1_000_000

CANCEL_CODE = h2raw.CANCEL.to_bytes(4, "big")
ERROR_NAMES = {
    0x0: "NO_ERROR",
    0x1: "PROTOCOL_ERROR",
    0x3: "FLOW_CONTROL_ERROR",
    0x6: "FRAME_SIZE_ERROR",
    0x7: "REFUSED_STREAM",
    0x8: "CANCEL",
    0x9: "COMPRESSION_ERROR",
    0xB: "ENHANCE_YOUR_CALM",
}


# -- what each call sends ---------------------------------------------------------------------


def headers_message(
    headers: Sequence[tuple[str, str]], end_of_stream: bool
) -> pb.ProcessingRequest:
    """Envoy's first ext_proc message of a request: its headers (``raw_value``, as Envoy
    sends them), pseudo-headers included."""
    message = pb.ProcessingRequest()
    for key, value in headers:
        header = message.request_headers.headers.headers.add()
        header.key = key
        header.raw_value = value.encode()
    message.request_headers.end_of_stream = end_of_stream
    return message


CHAT_HEADERS = (
    (":method", "POST"),
    (":path", "/v1/chat/completions"),
    (":authority", "fairlane"),
    (":scheme", "http"),
    ("content-type", "application/json"),
)
LEGIT_REQUEST = headers_message(CHAT_HEADERS, end_of_stream=True).SerializeToString()
"""The legit call: a chat request with no key and no body, answered at once (an
immediate response: 400, the body is empty) and its stream ended: a complete call that
costs the service little."""
PROBE_MESSAGE = grpc_message(LEGIT_REQUEST)


def held_request_messages() -> bytes:
    """A chat request of the demo key, headers then body: its one engine always full, the
    service holds it in its queue and stops reading its stream."""
    headers = headers_message(
        (*CHAT_HEADERS, ("authorization", "Bearer sk-chat-demo")), end_of_stream=False
    )
    body = pb.ProcessingRequest()
    body.request_body.body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    body.request_body.end_of_stream = True
    return grpc_message(headers.SerializeToString()) + grpc_message(body.SerializeToString())


def body_message(size: int) -> bytes:
    """One more ``request_body`` message with ``size`` bytes of body, framed."""
    message = pb.ProcessingRequest()
    message.request_body.body = b"x" * size
    return grpc_message(message.SerializeToString())


# -- the legit client -------------------------------------------------------------------------


@dataclass
class LegitStats:
    answered: int = 0
    failed: int = 0
    max_latency_s: float = 0.0

    @property
    def calls(self) -> int:
        return self.answered + self.failed

    @property
    def share(self) -> float:
        return self.answered / self.calls if self.calls else 0.0


def legit_loop(port: int, pipe: Connection) -> None:
    """The legit client's process: ``Process`` every 100 ms on one channel, each call
    recorded as (answered, seconds); ``take`` on the pipe hands the records over and starts
    anew, ``stop`` (or the parent gone) ends it."""
    records: list[tuple[bool, float]] = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call: Any = channel.stream_stream(PROCESS_METHOD)
        next_call = time.monotonic()
        while True:
            try:
                if pipe.poll(max(0.0, next_call - time.monotonic())):
                    if pipe.recv() != "take":
                        return
                    pipe.send(records)
                    records = []
                    continue
            except (EOFError, OSError):
                return
            started = time.monotonic()
            next_call = started + LEGIT_PERIOD_S
            try:
                answers = list(call(iter([LEGIT_REQUEST]), timeout=LEGIT_TIMEOUT_S))
                answered = bool(answers) and bool(
                    pb.ProcessingResponse.FromString(answers[0]).WhichOneof("response")
                )
            except (grpc.RpcError, ValueError):
                answered = False
            records.append((answered, time.monotonic() - started))


class LegitClient:
    """The legit client in a process of its own (spawned: no state shared with the
    attacker's loop, nor its GIL), as Envoy is a process of its own."""

    def __init__(self, port: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(
            target=legit_loop, args=(port, theirs), name="legit-client", daemon=True
        )
        self.process.start()
        theirs.close()

    def take(self) -> LegitStats:
        """The calls made since the last ``take``; waits for the one under way."""
        try:
            self.pipe.send("take")
            if not self.pipe.poll(LEGIT_TIMEOUT_S + 10):
                raise RuntimeError("the legit client did not answer")
            records: list[tuple[bool, float]] = self.pipe.recv()
        except (EOFError, OSError):
            self.process.join(1)
            raise RuntimeError(f"the legit client exited (code {self.process.exitcode})") from None
        stats = LegitStats()
        for answered, seconds in records:
            if answered:
                stats.answered += 1
            else:
                stats.failed += 1
            stats.max_latency_s = max(stats.max_latency_s, seconds)
        return stats

    def stop(self) -> None:
        if not self.process.is_alive():
            return
        with contextlib.suppress(OSError):
            self.pipe.send("stop")
        self.process.join(LEGIT_TIMEOUT_S + 5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


# -- the service and its memory -------------------------------------------------------------


@dataclass
class Service:
    child: Child
    port: int
    metrics_port: int
    limits: ServerLimits
    """What the service derives from its policy (``ServerLimits.for_policy``)."""

    @property
    def pid(self) -> int:
        return self.child.popen.pid

    def open_streams(self) -> int | None:
        """``fairlane_grpc_streams``: HTTP/2 streams open on its gRPC port now."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("fairlane_grpc_streams "):
                return round(float(line.split()[1]))
        return None


SATURATED_METRICS = b"""\
vllm:num_requests_running{engine="0",model_name="m"} 256.0
vllm:num_requests_waiting{engine="0",model_name="m"} 100.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.99
"""
MODELS = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'


class _FullEngine(http.server.BaseHTTPRequestHandler):
    """An engine that is up and always full (every gate closed): the service holds every
    request that needs it, and none ever reaches it (anything but a read: 503)."""

    def do_GET(self) -> None:
        body = {"/metrics": SATURATED_METRICS, "/v1/models": MODELS, "/health": b""}.get(
            self.path.split("?")[0]
        )
        self.send_response(404 if body is None else 200)
        self.send_header("content-length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def do_POST(self) -> None:
        self.send_response(503)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: it is scraped ten times a second."""


@contextlib.contextmanager
def full_engine() -> Iterator[int]:
    """The full engine on a free port, in a thread of its own; its port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _FullEngine)
    thread = threading.Thread(target=server.serve_forever, name="full-engine", daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def running_service(policy: Path, log_dir: Path) -> Iterator[Service]:
    """``fairlane serve`` on free ports, its one backend an engine that is always full (so
    a keyed request is held, not refused, however long the service has run); stopped
    (SIGTERM, then SIGKILL) however the block ends."""
    with full_engine() as engine_port, ProcessGroup(log_dir) as group:
        port, metrics_port = free_port(), free_port()
        engine = parse_backend(f"http://127.0.0.1:{engine_port}")
        child = group.start("service", service_argv(port, metrics_port, policy, [engine]))
        wait_port_open(port, child)
        yield Service(child, port, metrics_port, ServerLimits.for_policy(load_policy(policy)))


class RssSampler(threading.Thread):
    """The service's RSS every 50 ms: the latest, and the most since ``mark``."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.process = psutil.Process(pid)
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self.peak = 0
        self.now()

    def now(self) -> int | None:
        """A sample now (None once the process is gone); counted in the peak."""
        try:
            rss = int(self.process.memory_info().rss)
        except psutil.Error:
            return None
        with self._lock:
            self.peak = max(self.peak, rss)
        return rss

    def mark(self) -> int:
        """Start a new peak from now; the RSS now."""
        rss = self.now() or 0
        with self._lock:
            self.peak = rss
        return rss

    def run(self) -> None:
        while not self.stopping.wait(RSS_PERIOD_S):
            if self.now() is None:
                return


# -- rows -----------------------------------------------------------------------------------


@dataclass
class Row:
    key: str
    attack: str
    result: str
    target: str = "—"
    ok: bool | None = None
    """The target met (None: the attack has no target)."""
    rss: tuple[int, int, int | None] | None = None
    """Start, peak, end (bytes; end None: the process is gone)."""
    legit: LegitStats | None = None

    @property
    def verdict(self) -> str:
        return "—" if self.ok is None else "PASS" if self.ok else "FAIL"

    def cells(self) -> list[str]:
        if self.rss is None:
            rss = "—"
        else:
            start, peak, end = self.rss
            rss = f"{start / MB:.0f} / {peak / MB:.0f} / " + (
                "gone" if end is None else f"{end / MB:.0f}"
            )
        if self.legit is None or not self.legit.calls:
            legit = "—"
        else:
            legit = (
                f"{self.legit.answered}/{self.legit.calls} ({self.legit.share:.0%}), "
                f"max {self.legit.max_latency_s * 1000:.0f} ms"
            )
        return [self.key, self.attack, self.result, rss, legit, self.target, self.verdict]


HEADER = [
    "#",
    "attack",
    "result",
    "RSS MB start / peak / end",
    "legit answered, max latency",
    "target",
    "verdict",
]


def markdown_line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def table(rows: Sequence[Row]) -> str:
    lines = [markdown_line(HEADER), markdown_line(["---"] * len(HEADER))]
    lines += [markdown_line(row.cells()) for row in rows]
    return "\n".join(lines)


# -- options --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    rounds: int = 3
    streams_per_round: int = 20_000
    unpaced_streams: int = 150_000
    fresh_connections: int = 150
    streams_per_connection: int = 1000
    seconds: float = 4.0
    """Each flood's and the flow-control attack's limit."""
    open_streams: int = 20_000
    slow_connections: int = 50
    """Silent connections, and as many half-preface ones."""
    policy: Path = DEFAULT_POLICY
    one_service: bool = False
    """All attacks on one service, in turn (default: a new service for each, so that no
    attack's aftermath, such as memory kept by the allocator or the overload controller's
    shedding, is counted in the next one's figures)."""
    only: frozenset[str] = frozenset()
    """Attack numbers to run (empty: all)."""

    def quick(self) -> Options:
        """A run of seconds: every attack, small."""
        return replace(
            self,
            rounds=2,
            streams_per_round=2000,
            unpaced_streams=5000,
            fresh_connections=10,
            streams_per_connection=200,
            seconds=1.0,
            open_streams=2000,
            slow_connections=5,
        )


# -- the attacker's tools ---------------------------------------------------------------------


class Attacker(RawConnection):
    """A raw connection that also keeps what the server sends on the streams in
    ``answers`` (add a stream id to watch it)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.answers: dict[int, bytearray] = {}

    def _heard(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        super()._heard(kind, flags, stream_id, payload)
        if kind == h2raw.DATA and stream_id in self.answers:
            self.answers[stream_id] += payload

    def responses(self, stream_id: int) -> list[pb.ProcessingResponse]:
        """The complete ProcessingResponses the server sent on ``stream_id`` so far."""
        data = bytes(self.answers.get(stream_id, b""))
        messages = []
        while len(data) >= 5:
            end = 5 + int.from_bytes(data[1:5], "big")
            if len(data) < end:
                break
            messages.append(pb.ProcessingResponse.FromString(data[5:end]))
            data = data[end:]
        return messages


def answer_text(response: pb.ProcessingResponse) -> str:
    kind = response.WhichOneof("response") or "nothing"
    if kind == "immediate_response":
        immediate = response.immediate_response
        return f"immediate_response {immediate.status.code}: {immediate.body[:80]!r}"
    if response.HasField("override_message_timeout"):
        return "held (override_message_timeout)"
    return kind


@dataclass
class Bench:
    service: Service
    options: Options
    sampler: RssSampler
    legit: LegitClient
    out: TextIO = sys.stdout
    rows: list[Row] = field(default_factory=list)

    async def connect(self, reading: bool = True, handshake: bool = True) -> Attacker:
        """A raw connection; a client that never reads has a small receive buffer (the
        kernel does not absorb for it what the server would otherwise have to queue)."""
        connection = await Attacker.open(
            self.service.port,
            handshake=handshake,
            reading=reading,
            receive_buffer=None if reading else 4096,
        )
        assert isinstance(connection, Attacker)
        # Each write goes out at once: Nagle would hold a probe behind the batch before it
        # until the server's delayed ACK (40 ms), and pace the attack by that.
        sock = connection.writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return connection


def reset_batch(connection: RawConnection, count: int) -> bytes:
    """``count`` new streams, each HEADERS then RST_STREAM(CANCEL) at once: rapid reset."""
    out = bytearray()
    for _ in range(count):
        stream_id, headers = connection.open_stream(PROCESS_METHOD)
        out += headers
        out += frame(h2raw.RST_STREAM, 0, stream_id, CANCEL_CODE)
    return bytes(out)


async def probe(connection: RawConnection, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """A complete call on ``connection``, waited for: once it is answered (or refused), the
    server has read and acted on everything sent before it.

    A probe is a complete call sent on the attacker's own connection after the batch: the server
    reads a connection's frames in order and answers a stream only after the handlers started
    before it ran, so its answer means every frame before it was read and acted on. The legit
    client's calls are one headers message, no body: answered at once, 400, with an immediate
    response.
    """
    stream_id, headers = connection.open_stream(PROCESS_METHOD)
    connection.send(headers + frame(h2raw.DATA, h2raw.END_STREAM, stream_id, PROBE_MESSAGE))
    heard = connection.heard
    return await connection.wait_for(
        lambda: stream_id in heard.ended_streams or stream_id in heard.resets, timeout_s
    )


async def flood_read(connection: RawConnection, flood: bytes, seconds: float) -> float | None:
    """Send ``flood`` over and over for up to ``seconds``; when the server closed the
    connection (seconds since the flood began), None if it did not."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    with contextlib.suppress(ConnectionError, OSError):
        while not connection.heard.closed and loop.time() - start < seconds:
            connection.send(flood)
            await connection.drain()
            await asyncio.sleep(0)  # drain need not yield: let the reader see a close
    remaining = max(0.0, start + seconds - loop.time())
    if await connection.wait_for(lambda: connection.heard.closed, remaining):
        return loop.time() - start
    return None


@dataclass
class Unread:
    """What a flood from a client that never reads got through."""

    sent: int
    """Bytes the server's side took (the kernel's buffers included)."""
    closed_after_s: float | None


async def flood_unread(connection: RawConnection, flood: bytes, seconds: float) -> Unread:
    """Send ``flood`` for up to ``seconds``, never reading; a write waits while the server
    takes nothing (no more is queued here meanwhile)."""
    loop = asyncio.get_running_loop()
    transport = connection.writer.transport
    start = loop.time()
    sent = 0
    while (remaining := start + seconds - loop.time()) > 0:
        if transport.is_closing():
            return Unread(sent - transport.get_write_buffer_size(), loop.time() - start)
        try:
            if transport.get_write_buffer_size() == 0:
                connection.send(flood)
                sent += len(flood)
            await asyncio.wait_for(connection.drain(), min(0.5, remaining))
            await asyncio.sleep(0)
        except TimeoutError:
            continue
        except (ConnectionError, OSError):
            return Unread(sent - transport.get_write_buffer_size(), loop.time() - start)
    return Unread(sent - transport.get_write_buffer_size(), None)


def closed_text(
    closed_after_s: float | None, within: float, reading: bool = False, code: int | None = None
) -> str:
    """``reading``: the client read the server's frames, so whether a GOAWAY came is known."""
    if closed_after_s is None:
        return f"not closed in {within:g} s"
    closed = f"closed after {closed_after_s * 1000:.0f} ms"
    if not reading:
        return closed
    if code is None:
        return f"{closed}, no GOAWAY heard (the reset may have dropped it)"
    return f"{closed}, GOAWAY {ERROR_NAMES.get(code, hex(code))}"


def mib(size: int) -> str:
    return f"{size / MIB:.2f} MiB"


# -- the attacks ------------------------------------------------------------------------------


async def rapid_reset_one_connection(bench: Bench) -> Row:
    options = bench.options
    connection = await bench.connect()
    after_round: list[int] = []
    loop = asyncio.get_running_loop()
    elapsed = 0.0  # attacking, without the pauses before each round's RSS
    try:
        for _ in range(options.rounds):
            start = loop.time()
            left = options.streams_per_round
            while left > 0:
                count = min(BATCH, left)
                left -= count
                connection.send(reset_batch(connection, count))
                await connection.drain()
                if not await probe(connection):
                    raise RuntimeError("the server did not answer the probe after a batch")
            elapsed += loop.time() - start
            await asyncio.sleep(SETTLE_S)
            after_round.append(bench.sampler.now() or 0)
        kept = not connection.heard.closed and connection.heard.goaway is None
    finally:
        await connection.close()
    await asyncio.sleep(SETTLE_S)
    left_open = bench.service.open_streams()
    total = options.rounds * options.streams_per_round
    growth = after_round[-1] - after_round[0]
    rounds = " / ".join(f"{rss / MB:.1f}" for rss in after_round)
    result = (
        f"{total:,} streams reset in {options.rounds} rounds on one connection, "
        f"{elapsed:.1f} s ({total / elapsed:,.0f}/s); RSS after each round {rounds} MB "
        f"(round 1 to {options.rounds}: {growth / MB:+.1f} MB); connection "
        f"{'kept open' if kept else 'closed by the server'}; streams open after: {left_open}"
    )
    return Row(
        "1",
        "rapid reset, one connection",
        result,
        target=f"RSS round 1 to {options.rounds} ≤ +40 MB; legit ≥ 90 %",
        ok=growth <= 40 * MB,
    )


async def rapid_reset_unpaced(bench: Bench) -> Row:
    """Rapid reset as an attacker sends it: every stream written as fast as the socket
    takes them, never waiting for the server to catch up (the kernel's buffers on loopback
    take megabytes at once)."""
    count = bench.options.unpaced_streams
    connection = await bench.connect()
    writes = []
    left = count
    while left > 0:  # encoded before the clock starts: the attacker's own cost is not timed
        writes.append(reset_batch(connection, min(10 * BATCH, left)))
        left -= 10 * BATCH
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        for data in writes:
            connection.send(data)
            await connection.drain()
        written = loop.time() - start
        if not await probe(connection, 5 * PROBE_TIMEOUT_S):
            raise RuntimeError("the server did not answer the probe after the streams")
        read = loop.time() - start
        kept = not connection.heard.closed and connection.heard.goaway is None
    finally:
        await connection.close()
    await asyncio.sleep(SETTLE_S)
    size = sum(len(data) for data in writes)
    result = (
        f"{count:,} streams reset on one connection without waiting ({size / MB:.1f} MB "
        f"written in {written:.1f} s): all read and answered after {read:.1f} s "
        f"({count / read:,.0f}/s); connection {'kept open' if kept else 'closed by the server'}; "
        f"streams open after: {bench.service.open_streams()}"
    )
    return Row("1b", "rapid reset, unpaced", result)


async def rapid_reset_fresh_connections(bench: Bench) -> Row:
    options = bench.options
    failures: list[str] = []
    concurrency = asyncio.Semaphore(10)

    async def one() -> None:
        async with concurrency:
            connection = await bench.connect()
            try:
                left = options.streams_per_connection
                while left > 0:
                    count = min(BATCH, left)
                    left -= count
                    connection.send(reset_batch(connection, count))
                    await connection.drain()
                if not await probe(connection):
                    failures.append("a probe unanswered")
                if connection.heard.goaway is not None:
                    failures.append(f"GOAWAY {ERROR_NAMES.get(connection.heard.goaway)}")
            finally:
                await connection.close()

    loop = asyncio.get_running_loop()
    start = loop.time()
    await asyncio.gather(*(one() for _ in range(options.fresh_connections)))
    elapsed = loop.time() - start
    await asyncio.sleep(SETTLE_S)
    total = options.fresh_connections * options.streams_per_connection
    result = (
        f"{total:,} streams reset over {options.fresh_connections} fresh connections "
        f"x {options.streams_per_connection:,} (10 at a time), {elapsed:.1f} s "
        f"({total / elapsed:,.0f}/s); streams open after: {bench.service.open_streams()}"
    )
    if failures:
        result += f"; {len(failures)} connections went wrong: {sorted(set(failures))}"
    return Row("2", "rapid reset, fresh connections", result)


async def flood_unread_from(bench: Bench, flood: bytes, open_stream: bool) -> tuple[Unread, float]:
    """``flood`` sent over and over by a client that never reads (with one stream open, so
    the connection is not idle, when ``open_stream``): what it took, and the service's peak
    RSS above its size at the start."""
    connection = await bench.connect(reading=False)
    start_rss = bench.sampler.now() or 0
    try:
        if open_stream:
            _, headers = connection.open_stream(PROCESS_METHOD)
            connection.send(headers)
        got = await flood_unread(connection, flood, bench.options.seconds)
    finally:
        await connection.close()
    return got, bench.sampler.peak - start_rss


async def oversized_pings(bench: Bench) -> Row:
    ping = frame(h2raw.PING, 0, 0, bytes(16 << 10))
    got, above = await flood_unread_from(bench, ping * 64, open_stream=False)
    result = (
        f"16 KiB PINGs, never reading: {mib(got.sent)} taken, "
        f"{closed_text(got.closed_after_s, bench.options.seconds)}; "
        f"peak RSS {above / MB:+.1f} MB above start"
    )
    return Row(
        "3",
        "16 KiB PING flood (never reads)",
        result,
        target="peak ≤ +120 MB",
        ok=above <= 120 * MB,
    )


async def unread_acknowledgements(bench: Bench, key: str, what: str, one: bytes) -> Row:
    """A flood of frames each asking for an acknowledgement the client never reads."""
    got, above = await flood_unread_from(bench, one * 2000, open_stream=True)
    result = (
        f"{what}, never reading: {mib(got.sent)} taken "
        f"({got.sent // len(one):,} frames), "
        f"{closed_text(got.closed_after_s, bench.options.seconds)}; "
        f"peak RSS {above / MB:+.1f} MB above start"
    )
    return Row(key, f"{what} (never reads)", result)


async def ping_flood(bench: Bench) -> Row:
    return await unread_acknowledgements(
        bench, "4a", "8-byte PING flood", frame(h2raw.PING, 0, 0, bytes(8))
    )


async def settings_flood(bench: Bench) -> Row:
    one = frame(
        h2raw.SETTINGS,
        0,
        0,
        h2raw.INITIAL_WINDOW_SIZE.to_bytes(2, "big") + h2raw.DEFAULT_WINDOW.to_bytes(4, "big"),
    )
    return await unread_acknowledgements(bench, "4b", "SETTINGS flood", one)


async def empty_frame_flood(bench: Bench, key: str, what: str, target: str | None) -> Row:
    """Frames that carry nothing, as fast as the server reads them: how long until the
    server closes the connection."""
    connection = await bench.connect()
    stream_id, headers = connection.open_stream(PROCESS_METHOD)
    if what == "empty CONTINUATION":  # continues a header block that never ends
        connection.send(frame(h2raw.HEADERS, 0, stream_id, headers[9:]))
        one = frame(h2raw.CONTINUATION, 0, stream_id)
    elif what == "empty DATA":
        connection.send(headers)
        one = frame(h2raw.DATA, 0, stream_id)
    else:
        one = frame(0x42, 0, 0, b"?")
    try:
        closed_after = await flood_read(connection, one * FLOOD_FRAMES, bench.options.seconds)
    finally:
        await connection.close()
    result = closed_text(
        closed_after, bench.options.seconds, reading=True, code=connection.heard.goaway
    )
    if target is None:
        return Row(key, f"{what} flood", result)
    return Row(
        key,
        f"{what} flood",
        result,
        target=target,
        ok=closed_after is not None and closed_after <= 2.0,
    )


async def continuation_flood(bench: Bench) -> Row:
    return await empty_frame_flood(bench, "5a", "empty CONTINUATION", "closed ≤ 2 s")


async def data_flood(bench: Bench) -> Row:
    return await empty_frame_flood(bench, "5b", "empty DATA", "closed ≤ 2 s")


async def unknown_flood(bench: Bench) -> Row:
    return await empty_frame_flood(bench, "6", "unknown-type frame", None)


HOLD_TRIES = 5
"""Requests tried, a second apart, until the service holds one (an overloaded service
refuses some at once)."""


def is_held(response: pb.ProcessingResponse) -> bool:
    return response.HasField("override_message_timeout")


async def held_stream_flow_control(bench: Bench) -> Row:
    """A held request's stream, then more input, sent within every window the server
    grants: what it accepts while the handler reads nothing. The filler messages are the
    largest the service takes (a body of the policy's ``max_body_bytes``): a message is
    accepted whole even unread, so this is the most one stream can be made to hold."""
    limits = bench.service.limits
    body_size = limits.max_message_bytes - limits.max_message_bytes % MIB - MIB
    filler = body_message(body_size) * 2
    connection = await bench.connect()
    heard = connection.heard
    loop = asyncio.get_running_loop()
    not_held: list[str] = []
    try:
        if not await connection.wait_for(lambda: h2raw.INITIAL_WINDOW_SIZE in heard.settings, 10):
            raise RuntimeError("no SETTINGS_INITIAL_WINDOW_SIZE from the server")
        window = heard.settings[h2raw.INITIAL_WINDOW_SIZE]
        head = held_request_messages()
        for _ in range(HOLD_TRIES):
            stream_id, headers = connection.open_stream(PROCESS_METHOD)
            connection.answers[stream_id] = bytearray()
            connection.send(headers + frame(h2raw.DATA, 0, stream_id, head))

            def gone(stream_id: int = stream_id) -> bool:
                return heard.closed or stream_id in heard.resets or stream_id in heard.ended_streams

            def held(stream_id: int = stream_id) -> bool:
                return any(map(is_held, connection.responses(stream_id)))

            await connection.wait_for(lambda: held() or gone(), 5)
            if held() and not gone():
                break
            answers = connection.responses(stream_id)
            not_held.append(answer_text(answers[-1]) if answers else "no answer")
            await asyncio.sleep(1)
        else:
            return Row(
                "7",
                "flow control on a held stream",
                f"NOT MEASURED: the service held none of {HOLD_TRIES} requests "
                f"({'; '.join(sorted(set(not_held)))})",
                target="≤ 16 MiB accepted",
            )
        sent = len(head)

        def room() -> int:
            stream_room = window + heard.window_updates.get(stream_id, 0)
            connection_room = h2raw.DEFAULT_WINDOW + heard.window_updates.get(0, 0)
            return min(stream_room, connection_room) - sent

        deadline = loop.time() + bench.options.seconds
        why = "time up"
        offset = 0  # into the filler
        while offset < len(filler):
            if gone():
                why = "stream ended by the server"
                break
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            if room() <= 0:
                waited = min(STALL_S, remaining)
                opened = await connection.wait_for(lambda: room() > 0 or gone(), waited)
                if not opened and waited >= STALL_S:
                    why = f"no window left for {STALL_S:g} s"
                    break
                continue
            size = min(room(), 16 << 10, len(filler) - offset)
            connection.send(frame(h2raw.DATA, 0, stream_id, filler[offset : offset + size]))
            offset += size
            sent += size
            await connection.drain()
            await asyncio.sleep(0)
        still_held = not gone()
    finally:
        await connection.close()
    result = (
        f"{mib(sent)} accepted on one held stream (advertised stream window "
        f"{mib(window)}, messages of {mib(body_size)}): {why}; the request "
        f"{'held throughout' if still_held else 'answered or reset meanwhile'}"
    )
    if not_held:
        result += f" (held at try {len(not_held) + 1}; before: {'; '.join(not_held)})"
    return Row(
        "7",
        "flow control on a held stream",
        result,
        target="≤ 16 MiB accepted",
        ok=sent <= 16 * MIB,
    )


async def many_open_streams(bench: Bench) -> Row:
    count = bench.options.open_streams
    connection = await bench.connect()
    heard = connection.heard
    try:
        await connection.wait_for(lambda: h2raw.MAX_CONCURRENT_STREAMS in heard.settings, 10)
        advertised = heard.settings.get(h2raw.MAX_CONCURRENT_STREAMS)
        opened: list[int] = []
        while len(opened) < count:
            out = bytearray()
            for _ in range(min(BATCH, count - len(opened))):
                stream_id, headers = connection.open_stream(PROCESS_METHOD)
                opened.append(stream_id)
                out += headers
            connection.send(bytes(out))
            await connection.drain()
        if not await probe(connection):
            raise RuntimeError("the server did not answer the probe after the streams")
        refused = sum(heard.resets.get(s) == h2raw.REFUSED_STREAM for s in opened)
        other = sum(s in heard.resets for s in opened) - refused
        server_open = bench.service.open_streams()
    finally:
        await connection.close()
    await asyncio.sleep(SETTLE_S)
    result = (
        f"{count:,} streams opened and kept open on one connection: "
        f"{count - refused - other:,} accepted, {refused:,} refused (REFUSED_STREAM)"
        + (f", {other} reset otherwise" if other else "")
        + f"; advertised MAX_CONCURRENT_STREAMS {advertised}; server's open streams "
        f"{server_open}, after the close {bench.service.open_streams()}"
    )
    return Row("8", "streams kept open", result)


async def slow_connections(bench: Bench) -> Row:
    each = bench.options.slow_connections
    connections = [await bench.connect(handshake=False) for _ in range(2 * each)]
    for connection in connections[each:]:
        connection.send(h2raw.PREFACE[:10])
    loop = asyncio.get_running_loop()
    start = loop.time()
    closed_at: dict[int, float] = {}
    try:
        while len(closed_at) < len(connections) and loop.time() - start < SLOW_WAIT_S:
            for index, connection in enumerate(connections):
                if index not in closed_at and connection.heard.closed:
                    closed_at[index] = loop.time() - start
            await asyncio.sleep(0.05)
    finally:
        for connection in connections:
            await connection.close()
    if len(closed_at) < len(connections):
        result = (
            f"{len(connections) - len(closed_at)} of {len(connections)} still open after "
            f"{SLOW_WAIT_S:g} s"
        )
    else:
        times = sorted(closed_at.values())
        result = f"all closed after {times[-1]:.1f} s (the first after {times[0]:.1f} s)"
    return Row(
        "9",
        f"{each} silent + {each} half-preface connections",
        f"{result} (handshake timeout {bench.service.limits.handshake_timeout_s:g} s)",
    )


async def sigterm_with_open_stream(bench: Bench) -> Row:
    bench.legit.stop()  # it would only count the stop as failures
    connection = await bench.connect()
    heard = connection.heard
    loop = asyncio.get_running_loop()
    try:
        stream_id, headers = connection.open_stream(PROCESS_METHOD)
        connection.send(headers)
        if not await probe(connection):
            raise RuntimeError("the server did not answer the probe")
        popen = bench.service.child.popen
        start = loop.time()
        popen.send_signal(signal.SIGTERM)
        got_goaway = await connection.wait_for(lambda: heard.goaway is not None, 10)
        goaway_s = loop.time() - start
        await connection.wait_for(
            lambda: stream_id in heard.resets or stream_id in heard.ended_streams, 30
        )
        stream_s = loop.time() - start
        code = await asyncio.to_thread(popen.wait, 60)
        exit_s = loop.time() - start
    finally:
        await connection.close()
    if not got_goaway:
        result = "no GOAWAY within 10 s"
    else:
        result = f"GOAWAY {ERROR_NAMES.get(heard.goaway or 0)} after {goaway_s * 1000:.1f} ms"
    if stream_id in heard.resets:
        fate = f"reset ({ERROR_NAMES.get(heard.resets[stream_id])})"
    elif stream_id in heard.ended_streams:
        fate = "ended"
    else:
        fate = "still open"
    result += (
        f"; the open stream {fate} after {stream_s:.2f} s; the process exited "
        f"(code {code}) after {exit_s:.2f} s"
    )
    return Row("10", "SIGTERM with an open stream", result)


Attack = Callable[[Bench], Awaitable[Row]]
ATTACKS: tuple[tuple[str, Attack], ...] = (
    ("1", rapid_reset_one_connection),
    ("1", rapid_reset_unpaced),
    ("2", rapid_reset_fresh_connections),
    ("3", oversized_pings),
    ("4", ping_flood),
    ("4", settings_flood),
    ("5", continuation_flood),
    ("5", data_flood),
    ("6", unknown_flood),
    ("7", held_stream_flow_control),
    ("8", many_open_streams),
    ("9", slow_connections),
    ("10", sigterm_with_open_stream),
)


# -- the run ----------------------------------------------------------------------------------


@dataclass
class Report:
    rows: list[Row]
    pids: list[int]
    """The service processes attacked (all stopped by the time ``run`` returns)."""
    preamble: str

    @property
    def failed(self) -> bool:
        return any(row.ok is False for row in self.rows)

    @property
    def summary(self) -> str:
        verdicts = [row.ok for row in self.rows if row.ok is not None]
        pids = ", ".join(map(str, self.pids))
        return f"{sum(verdicts)} of {len(verdicts)} targets met; service pids {pids}, stopped"

    def markdown(self) -> str:
        return f"{self.preamble}\n\n{table(self.rows)}\n\n{self.summary}\n"


@contextlib.contextmanager
def attacked_service(options: Options, log_dir: Path, out: TextIO) -> Iterator[Bench]:
    """A service, its RSS sampled and the legit client answered by it; all stopped after."""
    with running_service(options.policy, log_dir) as service:
        sampler = RssSampler(service.pid)
        sampler.start()
        legit = LegitClient(service.port)
        try:
            warm = time.monotonic() + 30
            while not legit.take().answered:
                if time.monotonic() > warm:
                    raise RuntimeError("the legit client was not answered before the attacks")
                time.sleep(0.2)
            yield Bench(service, options, sampler, legit, out)
        finally:
            legit.stop()
            sampler.stopping.set()


async def attack_one(bench: Bench, number: str, attack: Attack) -> bool:
    """Run one attack and print its row; whether the service is still up."""
    await asyncio.to_thread(bench.legit.take)  # the calls before this attack
    start = bench.sampler.mark()
    began = time.monotonic()
    try:
        row = await attack(bench)
    except Exception as error:  # the row says what broke; the next attack still runs
        row = Row(number, attack.__name__.replace("_", " "), f"broke: {error!r}", ok=False)
    if number != "10":  # a flood closed in a millisecond: the legit calls just after it
        await asyncio.sleep(max(0.0, began + LEGIT_WINDOW_S - time.monotonic()))
    end = bench.sampler.now()
    row.rss = (start, max(bench.sampler.peak, end or 0), end)
    if number != "10":  # the service is stopped on purpose there
        row.legit = await asyncio.to_thread(bench.legit.take)
        if row.key == "1" and row.ok is not None:
            row.ok = row.ok and row.legit.share >= LEGIT_SHARE_TARGET
    bench.rows.append(row)
    print(markdown_line(row.cells()), file=bench.out, flush=True)
    if number == "10" or bench.service.child.alive():
        return True
    code = bench.service.child.popen.returncode
    bench.rows.append(
        Row(number, "the service", f"exited (code {code}) during this attack", ok=False)
    )
    print(markdown_line(bench.rows[-1].cells()), file=bench.out, flush=True)
    return False


async def attack_in_turn(bench: Bench, attacks: Sequence[tuple[str, Attack]]) -> None:
    for number, attack in attacks:
        if not await attack_one(bench, number, attack):
            return


def run(options: Options, out: TextIO = sys.stdout) -> Report:
    """Start the service, attack it, stop it (a new service for each attack, unless
    ``options.one_service``); the rows are printed as they come."""
    limits = ServerLimits.for_policy(load_policy(options.policy))
    log_root = Path(tempfile.mkdtemp(prefix="fairlane-hostile-"))
    preamble = (
        f"Hostile HTTP/2 clients against `fairlane serve` (policy {options.policy.name}; "
        f"limits: {limits.max_concurrent_streams:,} streams per connection, "
        f"{limits.max_connections:,} connections, messages ≤ {mib(limits.max_message_bytes)}, "
        f"stream window {mib(limits.stream_window_bytes)}), "
        + ("one service for all attacks" if options.one_service else "a new service per attack")
        + f", on {os.cpu_count()} cores; legit client: Process every "
        f"{LEGIT_PERIOD_S * 1000:.0f} ms, {LEGIT_TIMEOUT_S:g} s deadline, its calls counted "
        f"from each attack's start to its end (at least {LEGIT_WINDOW_S:g} s); service logs "
        f"under {log_root}"
    )
    print(preamble + "\n", file=out)
    print(markdown_line(HEADER), file=out)
    print(markdown_line(["---"] * len(HEADER)), file=out, flush=True)
    selected = [(n, a) for n, a in ATTACKS if not options.only or n in options.only]
    rows: list[Row] = []
    pids: list[int] = []
    if options.one_service:
        with attacked_service(options, log_root, out) as bench:
            pids.append(bench.service.pid)
            bench.rows = rows
            asyncio.run(attack_in_turn(bench, selected))
    else:
        for number, attack in selected:
            log_dir = log_root / attack.__name__
            with attacked_service(options, log_dir, out) as bench:
                pids.append(bench.service.pid)
                bench.rows = rows
                asyncio.run(attack_in_turn(bench, [(number, attack)]))
    report = Report(rows, pids, preamble)
    print(f"\n{report.summary}", file=out, flush=True)
    return report
