"""Following one engine's KV event stream into its ``KVBlockIndex``.

A vLLM engine started with ``--kv-events-config`` publishes, once per scheduler step that
cached or evicted a block, ``[topic, seq, payload]`` on a PUB socket, and keeps its last
batches for replay on a ROUTER (``shared/reference/vllm.md`` A3;
``loadtests.sim.kv_publisher`` is the same on the wire). PUB/SUB loses messages silently
(before the subscription reaches the engine, past a high-water mark, across a reconnect): the
sequence numbers are how the subscriber notices, and the replay how it repairs. What cannot
be repaired clears the index, since what it holds may have been evicted meanwhile.
``index.live`` says whether the index has everything the engine cached since a point where
the whole cache was known; only a live index is used for routing (the approximate
per-backend LRU otherwise). ``KVEventSubscriber`` has the sequence rules. The counters are
plain attributes for the Prometheus collector; all the work happens in one task on the event
loop, a replay's wait is awaited, and a long replay yields between batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from extproc.fleet.kv_events import (
    AllCleared,
    BlocksStored,
    EventFormatError,
    KVBlockIndex,
    decode_batch,
)

log = logging.getLogger("fairlane.kv_events")

REPLAY_TIMEOUT_S = 2.0
"""How long a replay may take, first frame to end marker. vLLM's publisher thread looks at
replay requests between events, at least every 0.1 s."""
RCVHWM = 100_000
"""The SUB queue's bound: vLLM's PUB high-water mark, so live messages that arrive during a
replay wait rather than drop."""
LOG_EVERY_S = 60.0
"""At most one log line per subscriber and kind of trouble in this time."""
YIELD_EVERY = 64
"""A replay's batches are read and applied this many at a time between yields to the loop."""
END_SEQ = -1

Batch = tuple[int, bytes]


class _RateLimitedLog:
    """One line now, then at most one per ``LOG_EVERY_S`` with the count in between."""

    __slots__ = ("_last", "_suppressed")

    def __init__(self) -> None:
        self._last: float | None = None
        self._suppressed = 0

    def warning(self, now: float, message: str, *args: object) -> None:
        if self._last is not None and now - self._last < LOG_EVERY_S:
            self._suppressed += 1
            return
        if self._suppressed:
            message += f" ({self._suppressed} more since the last such line)"
        self._last = now
        self._suppressed = 0
        log.warning(message, *args)


class KVEventSubscriber:
    """One engine's KV events, followed into ``index`` until ``stop``.

    ``endpoint`` is where the engine's PUB socket is bound, as ``tcp://HOST:PORT``;
    ``replay_endpoint`` its replay ROUTER, if it has one. Use ``async with`` or
    ``start``/``stop``.

    How each message is taken, by its sequence number:

    - **in order** (``seq == last + 1``): decode, apply, done;
    - **first message**, or the first after a restart: ``seq == 0`` is the stream's start. Any
      other seq means the subscriber joined late: it asks the replay endpoint from 0;
    - **gap** (``seq > last + 1``): it asks the replay from ``last`` (not ``last + 1``): the
      engine's batch ``last`` must come back byte for byte as applied, which tells a gap in the
      same engine's stream from another engine process that restarted on the same port and has
      already published past ``last`` while the subscriber was away;
    - **backwards** (``seq <= last``, and not a batch already applied, byte for byte): the
      engine restarted and counts from 0 again. The index is cleared and the message handled as
      a first one. A restarted engine whose first batch the subscriber sees is exactly ``last +
      1`` (it published ``last + 1`` batches while the subscriber was disconnected) cannot be
      told from the old one by its sequence numbers and goes unnoticed;
    - a replay answers ``[b"", topic, seq, payload]`` frames and ends with seq -1. The frames
      that continue the stream are applied in order, then the live message that asked for it;
      live messages that arrived meanwhile wait in the SUB socket's queue (its high-water mark
      raised to vLLM's PUB one) and are skipped by seq when the replay already applied them;
    - **unreplayable** (no replay endpoint, no answer within ``replay_timeout_s``, or the
      engine's buffer no longer holds what is missing): the index is cleared, since what it
      holds may have been evicted meanwhile, and the stream goes on from the current message;
    - a payload that does not decode is counted, logged (at most once a minute), and skipped:
      its seq still counts as applied, since a replay would give the same bytes again.

    ``index.live`` (the picker uses a live index, and the approximate per-backend LRU otherwise)
    is true while the index has everything the engine cached since a point where the subscriber
    knew the whole cache: the stream's start (``seq == 0``, first-hand or replayed), a replay
    that answered with nothing (a running engine that has not cached anything yet), or an
    ``AllBlocksCleared``. It becomes false when that no longer holds: after a late join (the
    engine cached blocks before the oldest batch it still buffers) or an unreplayable gap. An
    engine that announces nothing is not a reason: an idle engine caches nothing and says
    nothing. An engine in that state may come back to live: with ``relive_after_blocks`` (its KV
    capacity in blocks, from ``vllm:cache_config_info``), once that many blocks were stored
    since, by which time LRU eviction has recycled nearly all the blocks the index missed (those
    still held by requests that were running then may remain); without it, at the next restart
    or ``AllBlocksCleared``.

    The counters (``messages`` received live, ``events`` applied, ``gaps`` seen, ``gaps_lost``:
    history that could not be had, a late join the buffer could not fill included,
    ``replays_ok``, ``replays_failed``, ``restarts``, ``decode_errors``) and ``index_size`` are
    plain attributes for the service's Prometheus collector.
    """

    def __init__(
        self,
        endpoint: str,
        index: KVBlockIndex | None = None,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        relive_after_blocks: int | None = None,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index if index is not None else KVBlockIndex()
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.relive_after_blocks = relive_after_blocks
        self._ctx = context
        self._clock = clock
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._logs: dict[str, _RateLimitedLog] = {}
        # The stream as applied: the last seq and its payload (None: following nothing yet;
        # -1: a replay said the engine has published nothing yet).
        self._last: int | None = None
        self._last_payload: bytes | None = None
        # Batches a replay applied that the live stream may still deliver: skipped, and not
        # mistaken for a restart (same seq, same bytes).
        self._replayed: dict[int, bytes] = {}
        self._replayed_top = -1
        self._stored_since_loss = 0
        self.messages = 0
        self.events = 0
        self.gaps = 0
        self.gaps_lost = 0
        self.replays_ok = 0
        self.replays_failed = 0
        self.restarts = 0
        self.decode_errors = 0

    @property
    def index_size(self) -> int:
        return len(self.index)

    @property
    def last_seq(self) -> int | None:
        """The last batch applied (-1: none yet, but the engine said so; None: unknown)."""
        return self._last

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        ctx = self._ctx or zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        self._sub = sub
        self._task = asyncio.create_task(self._run(sub), name=f"kv-events {self.endpoint}")

    async def stop(self) -> None:
        """Stop following: the task is gone and every socket closed when this returns."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    async def __aenter__(self) -> KVEventSubscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the stream -----------------------------------------------------------------------

    async def _run(self, sub: zmq.asyncio.Socket) -> None:
        if self.replay_endpoint is not None:
            await self._probe()
        while True:
            frames = await sub.recv_multipart()
            try:
                await self.on_message(frames)
            except Exception:  # a bug here must not end the following; start over instead
                self._warn("bug", "kv events %s: message handling failed", self.endpoint)
                log.debug("kv events %s: handling failed", self.endpoint, exc_info=True)
                self._forget(live=False)

    async def _probe(self) -> None:
        """Before the first message: what the engine has published so far, if it still has
        all of it (a replay from 0), so an engine with an idle past is live at once."""
        batches = await self._replay(0)
        if batches is None:
            return  # unreachable for now: the first live message decides
        if not batches:
            self._last, self._last_payload = -1, None
            self._set_complete(True)
            return
        await self._start_from(batches, None)

    async def on_message(self, frames: list[bytes]) -> None:
        """One live message (``[topic, seq, payload]``)."""
        self.messages += 1
        if len(frames) != 3 or len(frames[1]) != 8:
            self._bad(f"a message of {len(frames)} frames")
            return
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        last = self._last
        replayed = self._replayed
        if replayed:
            if replayed.get(seq) == payload:
                return  # a replay applied it already
            if seq > self._replayed_top:
                replayed.clear()
        if seq == last and payload == self._last_payload:
            return  # the same batch twice (a test's resend; PUB itself never repeats)
        if last is not None and seq <= last:
            self.restarts += 1
            self._warn(
                "restart",
                "kv events %s: seq %d after %d, engine restarted",
                self.endpoint,
                seq,
                last,
            )
            self._forget(live=False)
            last = None
        if last is None:
            if seq == 0:
                self._forget(live=True)
                self._apply(seq, payload)
            else:
                await self._join(seq, payload)
        elif seq == last + 1:
            self._apply(seq, payload)
        else:
            self.gaps += 1
            await self._recover(seq, payload)

    async def _join(self, seq: int, payload: bytes) -> None:
        """The first message is not the stream's start: whatever the engine still buffers."""
        batches = await self._replay(0)
        await self._start_from(batches or [], (seq, payload))

    async def _start_from(self, batches: list[Batch], live: Batch | None) -> None:
        """Begin following at the first replayed batch (complete if it is the stream's
        start), then the live message; without batches, at the live message."""
        first = batches[0][0] if batches else None
        self._forget(live=first == 0)
        if first is None:
            assert live is not None
            self._lost(*live)
            return
        self._last = first - 1
        await self._resume(batches, live)

    async def _recover(self, seq: int, payload: bytes) -> None:
        """A gap after ``last``: replay from ``last`` and check it is the same stream."""
        last = self._last
        assert last is not None
        verify = self._last_payload is not None
        batches = await self._replay(last if verify else last + 1)
        if batches is None:
            self._lost(seq, payload)
            return
        if verify and batches and batches[0][0] == last:
            if batches[0][1] != self._last_payload:
                self.restarts += 1
                self._warn(
                    "restart",
                    "kv events %s: replay differs at %d, engine restarted",
                    self.endpoint,
                    last,
                )
                self._forget(live=False)
                await self._join(seq, payload)
                return
            batches = batches[1:]
        await self._resume(batches, (seq, payload))

    async def _resume(self, batches: list[Batch], live: Batch | None) -> None:
        """Apply the replayed batches that continue the stream, then the live message."""
        replayed = self._replayed
        for done, (seq, payload) in enumerate(batches, 1):
            assert self._last is not None
            if seq <= self._last:
                continue
            if seq != self._last + 1:
                break  # a hole in the answer (frames past the ROUTER's high-water mark)
            self._apply(seq, payload)
            replayed[seq] = payload
            self._replayed_top = seq
            if done % YIELD_EVERY == 0:
                await asyncio.sleep(0)
        if live is None:
            return
        seq, payload = live
        assert self._last is not None
        if seq == self._last + 1:
            self._apply(seq, payload)
        elif seq > self._last + 1:
            self._lost(seq, payload)

    def _lost(self, seq: int, payload: bytes) -> None:
        """What is missing cannot be had: start afresh at this message, not live."""
        self.gaps_lost += 1
        self._warn(
            "lost",
            "kv events %s: batches %s..%d lost and not replayable; index cleared",
            self.endpoint,
            "?" if self._last is None else self._last + 1,
            seq - 1,
        )
        self._forget(live=False)
        self._apply(seq, payload)

    def _forget(self, live: bool) -> None:
        self.index.clear()
        self._replayed = {}
        self._last = None
        self._last_payload = None
        self._stored_since_loss = 0
        self._set_complete(live)

    def _set_complete(self, live: bool) -> None:
        self.index.live = live

    def _apply(self, seq: int, payload: bytes) -> None:
        self._last = seq
        self._last_payload = payload
        try:
            events = decode_batch(payload)
        except EventFormatError as exc:
            self._bad(str(exc))
            return
        self.index.apply(events)
        self.events += len(events)
        if self.index.live:
            return
        for event in events:
            if isinstance(event, AllCleared):
                self._set_complete(True)
                return
            if isinstance(event, BlocksStored):
                self._stored_since_loss += len(event.keys)
        relive = self.relive_after_blocks
        if relive is not None and self._stored_since_loss >= relive:
            self._set_complete(True)

    def _bad(self, what: str) -> None:
        self.decode_errors += 1
        self._warn("decode", "kv events %s: payload skipped: %s", self.endpoint, what)

    def _warn(self, kind: str, message: str, *args: object) -> None:
        limiter = self._logs.get(kind)
        if limiter is None:
            limiter = self._logs[kind] = _RateLimitedLog()
        limiter.warning(self._clock(), message, *args)

    # -- replays ---------------------------------------------------------------------------

    async def _replay(self, start: int) -> list[Batch] | None:
        """The engine's buffered batches from ``start`` on, in order; None when there is no
        replay endpoint or it did not answer in time. A fresh DEALER per replay, so a late
        answer to one that timed out can never be read as the next one's."""
        if self.replay_endpoint is None:
            return None
        ctx = self._ctx or zmq.asyncio.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)  # the whole answer may queue here
            dealer.connect(self.replay_endpoint)
            batches = await asyncio.wait_for(_exchange(dealer, start), self.replay_timeout_s)
        except (TimeoutError, zmq.ZMQError) as exc:
            self.replays_failed += 1
            self._warn(
                "replay",
                "kv events %s: replay from %d failed: %r",
                self.replay_endpoint,
                start,
                exc,
            )
            return None
        finally:
            dealer.close(linger=0)
        self.replays_ok += 1
        return batches


async def _exchange(dealer: zmq.asyncio.Socket, start: int) -> list[Batch]:
    """Ask for the batches from ``start`` and read them to the end marker. The request
    itself waits while the ROUTER is unreachable (a DEALER holds what it cannot send)."""
    await dealer.send_multipart((b"", start.to_bytes(8, "big")))
    batches: list[Batch] = []
    while True:
        frames: list[Any] = await dealer.recv_multipart()
        if len(frames) != 4 or len(frames[2]) != 8:
            continue  # not vLLM's shape: nothing to apply
        seq = int.from_bytes(frames[2], "big", signed=True)
        if seq == END_SEQ:
            return batches
        batches.append((seq, frames[3]))
        if len(batches) % YIELD_EVERY == 0:
            await asyncio.sleep(0)  # frames already queued are read without yielding
