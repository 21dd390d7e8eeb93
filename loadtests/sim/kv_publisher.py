"""``--kv-events-config``: the simulator publishes its KV cache events as vLLM 0.32 does.

vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``; ``shared/reference/vllm.md``
A3), as seen from the wire: a PUB socket sends ``[topic, seq, payload]`` once per engine step
that produced events, and a ROUTER on ``replay_endpoint`` answers a replay of the last
``buffer_steps`` batches (``KVEventPublisher`` has the framing). Unlike vLLM, ``tcp://*:PORT``
binds on the simulator's own ``--host`` (loopback by default), so a test or ``fairlane up``
opens no port beyond the machine. vLLM publishes from a thread fed by a queue; the
simulator's engine loop is one asyncio task, so it encodes and sends on the loop (one msgpack
encoding and one non-blocking ``send`` per step: a PUB socket drops, never blocks, past its
``hwm``), and serves replays from a task on the same loop. ``max_queue_size`` is accepted and
has nothing to bound; data-parallel ranks do not exist here: the rank is 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

import zmq
import zmq.asyncio

from loadtests.sim.kv_events import Event, encode_batch

log = logging.getLogger("fairlane.sim.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay's last frame's sequence number."""
REPLAY_YIELD_EVERY = 64
"""A long replay lets the engine loop run between this many frames."""


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``: the same fields, defaults and JSON."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    """``"zmq"`` or ``"null"``; unset: ``"zmq"`` when events are enabled, else ``"null"``."""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")

    @property
    def publishes(self) -> bool:
        """Whether an engine so configured sends anything (vLLM's ``EventPublisherFactory``)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """The ``--kv-events-config`` JSON; unknown keys are refused, as vLLM's pydantic
        config (``extra="forbid"``) refuses them."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        types = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(raw) - set(types))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}")
        for name, value in raw.items():
            if not _fits(str(types[name]), value):
                raise ValueError(f"--kv-events-config: {name} = {value!r} ({types[name]})")
        return cls(**raw)


def _fits(annotation: str, value: Any) -> bool:
    if value is None:
        return "None" in annotation
    if annotation.startswith("bool"):
        return isinstance(value, bool)
    if annotation.startswith("int"):
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, str)


def on_host(endpoint: str, host: str | None) -> str:
    """``tcp://*:PORT`` as ``tcp://HOST:PORT`` when a host is given; any other endpoint as is."""
    if host is None or not endpoint.startswith("tcp://*:"):
        return endpoint
    address = f"[{host}]" if ":" in host else host
    return f"tcp://{address}:{endpoint.removeprefix('tcp://*:')}"


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints; connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """One engine's PUB socket, its sequence numbers and its replay ROUTER.

    ``publish`` is called once per engine step that produced events; ``start`` (on the
    running loop) begins answering replays; ``close`` ends both. The sockets are bound in
    the constructor, so a port in use fails the server's start rather than a later step.

    On the wire: ``seq`` counts batches from 0 as 8 bytes big-endian and the payload is the
    step's ``KVEventBatch`` (``loadtests.sim.kv_events``). The PUB socket *binds* when the
    endpoint contains ``*``, ``::``, ``ipc://`` or ``inproc://`` and *connects* otherwise (then
    the subscriber binds). The ROUTER (always bound) keeps the last ``buffer_steps`` batches: a
    request ``[b"", start_seq]`` (8 bytes big-endian) is answered with ``[b"", topic, seq,
    payload]`` for every buffered batch from ``start_seq`` on, then ``[b"", b"", -1 (8 bytes,
    signed), b""]`` (vLLM's ``_service_replay``). Like vLLM's, it sets no high-water mark of its
    own, so a huge replay to a slow reader may lose frames.
    """

    def __init__(
        self,
        config: KVEventsConfig,
        context: zmq.Context[Any] | None = None,
        bind_host: str | None = None,
    ) -> None:
        self.config = config
        self._ctx: zmq.Context[Any] = context or zmq.Context.instance()
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._task: asyncio.Task[None] | None = None
        self._pub: zmq.Socket[Any] = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.asyncio.Socket | None = None
        try:
            if is_bind_endpoint(config.endpoint):
                self._pub.bind(on_host(config.endpoint, bind_host))
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(config.endpoint)
                self.endpoint = config.endpoint
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                replay = zmq.asyncio.Context.shadow(self._ctx.underlying).socket(zmq.ROUTER)
                self._replay = replay
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(on_host(config.replay_endpoint, bind_host))
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise

    @property
    def seq(self) -> int:
        """The sequence number the next batch will carry (batches published so far)."""
        return self._next_seq

    def publish(self, events: list[Event], ts: float | None = None) -> int:
        """Send one step's events as one batch; its sequence number."""
        seq = self._next_seq
        self._next_seq = seq + 1
        payload = encode_batch(time.time() if ts is None else ts, events)
        self._send(seq, payload)
        self._buffer.append((seq, payload))
        return seq

    def _send(self, seq: int, payload: bytes) -> None:
        """The step's one non-blocking send (a seam the tests use to lose a message)."""
        # A PUB drops what no subscriber can take; zmq.Again only from a connecting PUB
        # with no peer yet, whose message vLLM's would lose too.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)

    def start(self) -> None:
        """Answer replay requests from now on (a task on the running loop)."""
        if self._replay is not None and self._task is None:
            self._task = asyncio.create_task(self._serve_replays(self._replay), name="kv-replay")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    async def _serve_replays(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            try:
                await self._answer(router, frames)
            except zmq.ZMQError as exc:  # a client gone mid-answer: the next one still gets its
                log.warning("kv events: replay failed: %s", exc)

    async def _answer(self, router: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        if len(frames) != 3:
            log.warning("kv events: invalid replay request: %r", frames)
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        # A snapshot: steps published while this answer yields are the live stream's.
        batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        for sent, (seq, payload) in enumerate(batches, 1):
            await router.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            if sent % REPLAY_YIELD_EVERY == 0:
                await asyncio.sleep(0)
        await router.send_multipart((client, b"", b"", END_SEQ, b""))
