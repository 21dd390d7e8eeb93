"""The KV event subscriber against the simulator's publisher, over real ZMQ sockets on
loopback: in order, a gap replayed, a gap that cannot be, restarts, broken payloads, stop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import zmq
import zmq.asyncio

from extproc.fleet.kv_subscriber import KVEventSubscriber
from extproc.ops.processes import free_port
from loadtests.sim.kv_events import ALL_BLOCKS_CLEARED, Event, block_removed, block_stored
from loadtests.sim.kv_publisher import KVEventPublisher, KVEventsConfig
from tests.polling import until


def stored(*keys: int) -> list[Event]:
    return [block_stored(list(keys), None, list(range(16 * len(keys))), 16)]


def removed(*keys: int) -> list[Event]:
    return [block_removed(key) for key in keys]


class Publisher(KVEventPublisher):
    """The simulator's publisher, able to lose chosen batches (still buffered for replay,
    as a batch the network dropped is) and to send junk."""

    def __init__(self, config: KVEventsConfig, lose: Callable[[int], bool] = lambda s: False):
        super().__init__(config, bind_host="127.0.0.1")  # tcp://* on loopback only
        self.lose = lose

    def _send(self, seq: int, payload: bytes) -> None:
        if not self.lose(seq):
            super()._send(seq, payload)

    def resend(self, seq: int) -> None:
        self._send(seq, dict(self._buffer)[seq])

    def send_raw(self, frames: list[bytes]) -> None:
        self._pub.send_multipart(frames)


class Ports:
    def __init__(self, replay: bool) -> None:
        self.pub = free_port()
        self.replay = free_port() if replay else None

    def config(self, buffer_steps: int = 10_000) -> KVEventsConfig:
        return KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://*:{self.pub}",
            replay_endpoint=None if self.replay is None else f"tcp://*:{self.replay}",
            buffer_steps=buffer_steps,
        )

    def subscriber(self, **kwargs: Any) -> KVEventSubscriber:
        replay = None if self.replay is None else f"tcp://127.0.0.1:{self.replay}"
        return KVEventSubscriber(
            f"tcp://127.0.0.1:{self.pub}", replay_endpoint=replay, replay_timeout_s=1.0, **kwargs
        )


@asynccontextmanager
async def publishing(pub: Publisher) -> AsyncIterator[Publisher]:
    pub.start()
    try:
        yield pub
    finally:
        await pub.close()


async def first_batch(pub: Publisher, sub: KVEventSubscriber, events: list[Event]) -> None:
    """Publish batch 0 and send it again until it is in: PUB drops what it sends before the
    subscription reaches it (the subscriber skips the same batch seen twice)."""
    seq = pub.publish(events)
    assert seq == 0

    def arrived() -> bool:
        # live: a replay may have brought batch 0 before the subscription is in place
        if sub.last_seq != 0 or not sub.messages:
            pub.resend(0)
            return False
        return True

    await until(arrived, "batch 0 reaches the subscriber live")


def held(sub: KVEventSubscriber) -> set[int]:
    return set(sub.index.held)


async def test_an_in_order_stream_fills_the_index_and_is_live() -> None:
    ports = Ports(replay=False)
    async with publishing(Publisher(ports.config())) as pub, ports.subscriber() as sub:
        assert not sub.index.live  # before the first message nothing is known
        await first_batch(pub, sub, stored(1, 2))
        pub.publish(stored(3))
        pub.publish(removed(1))
        await until(lambda: sub.last_seq == 2, "batch 2 applied")
        assert held(sub) == {2, 3}
        assert sub.index.live
        assert (sub.gaps, sub.gaps_lost, sub.restarts, sub.decode_errors) == (0, 0, 0, 0)
        assert sub.events == 3 and sub.index_size == 2
        assert sub.index.block_size == 16


async def test_a_gap_is_replayed_from_the_engine_buffer() -> None:
    ports = Ports(replay=True)
    pub = Publisher(ports.config(), lose=lambda seq: seq in (2, 3))
    async with publishing(pub), ports.subscriber() as sub:
        await first_batch(pub, sub, stored(1))
        pub.publish(stored(2))
        pub.publish(stored(3))  # lost on the way
        pub.publish(removed(1))  # lost on the way
        pub.publish(stored(5))
        await until(lambda: sub.last_seq == 4, "the stream repaired up to batch 4")
        assert held(sub) == {2, 3, 5}
        assert sub.index.live
        assert (sub.gaps, sub.gaps_lost, sub.restarts) == (1, 0, 0)
        assert sub.replays_ok >= 1 and sub.replays_failed == 0
        # the live stream goes on; nothing is applied twice
        pub.publish(removed(2))
        await until(lambda: sub.last_seq == 5, "batch 5 applied")
        assert held(sub) == {3, 5}


async def test_a_probe_makes_an_idle_engine_live_and_a_late_joiner_fills_from_the_buffer() -> None:
    ports = Ports(replay=True)
    async with publishing(Publisher(ports.config())) as pub:
        async with ports.subscriber() as idle:
            await until(lambda: idle.index.live, "the empty replay says the stream is complete")
            assert idle.last_seq == -1 and idle.index_size == 0
        pub.publish(stored(1))
        pub.publish(stored(2))  # nobody listens: only the replay buffer has them
        async with ports.subscriber() as late:
            await until(lambda: late.last_seq == 1, "the buffer replayed")
            assert held(late) == {1, 2} and late.index.live  # the buffer reaches seq 0


@pytest.mark.parametrize("replay", [False, True], ids=["no-replay-endpoint", "buffer-too-short"])
async def test_a_gap_that_cannot_be_replayed_clears_the_index(replay: bool) -> None:
    ports = Ports(replay=replay)
    pub = Publisher(ports.config(buffer_steps=1), lose=lambda seq: seq == 2)
    async with publishing(pub), ports.subscriber() as sub:
        await first_batch(pub, sub, stored(1))
        pub.publish(stored(2))
        pub.publish(removed(1))  # lost, and the buffer keeps only the newest batch
        pub.publish(stored(4))
        await until(lambda: sub.last_seq == 3, "the stream goes on after the gap")
        # 1 was removed in the lost batch and 2 may have been too: only what followed stays
        assert held(sub) == {4}
        assert not sub.index.live
        assert (sub.gaps, sub.gaps_lost) == (1, 1)
        assert sub.replays_failed == 0
        pub.publish([ALL_BLOCKS_CLEARED, *stored(7)])
        await until(lambda: sub.index.live, "the engine's cache reset makes the index whole")
        assert held(sub) == {7}


async def test_after_a_lost_gap_the_index_is_live_again_once_the_cache_turned_over() -> None:
    ports = Ports(replay=False)
    pub = Publisher(ports.config(), lose=lambda seq: seq == 1)
    async with publishing(pub), ports.subscriber(relive_after_blocks=4) as sub:
        await first_batch(pub, sub, stored(1))
        pub.publish(stored(2))  # lost
        pub.publish(stored(3, 4))
        await until(lambda: sub.last_seq == 2, "batch 2 applied")
        assert not sub.index.live
        pub.publish(stored(5, 6))
        await until(lambda: sub.index.live, "four blocks stored since the loss")


async def test_a_replay_endpoint_that_never_answers_times_out() -> None:
    ports = Ports(replay=True)
    ctx = zmq.asyncio.Context.instance()
    mute = ctx.socket(zmq.ROUTER)  # takes the requests, answers nothing
    mute.bind(f"tcp://127.0.0.1:{ports.replay}")
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{ports.pub}")
    pub = Publisher(config, lose=lambda seq: seq == 1)
    try:
        async with publishing(pub), ports.subscriber() as sub:
            sub.replay_timeout_s = 0.2
            await until(lambda: sub.replays_failed == 1, "the probe timed out")
            await first_batch(pub, sub, stored(1))
            pub.publish(stored(2))  # lost
            pub.publish(stored(3))
            await until(lambda: sub.last_seq == 2, "the stream goes on")
            assert (sub.replays_failed, sub.gaps_lost) == (2, 1)
            assert held(sub) == {3} and not sub.index.live
    finally:
        mute.close(linger=0)


async def test_an_engine_restart_clears_the_index() -> None:
    ports = Ports(replay=True)
    async with ports.subscriber() as sub:
        async with publishing(Publisher(ports.config())) as old:
            await first_batch(old, sub, stored(1))
            old.publish(stored(2))
            old.publish(stored(3))
            await until(lambda: sub.last_seq == 2, "the old engine's batches applied")
        new = await rebind(ports)
        async with publishing(new):
            await first_batch(new, sub, stored(9))
            assert held(sub) == {9}
            assert sub.restarts == 1 and sub.index.live


async def test_a_restarted_engine_that_published_past_the_last_seq_is_told_apart() -> None:
    """The subscriber was away while the new engine published batches 0..3: batch 4
    looks like a gap after 2, and the replay's batch 2 is not the one applied."""
    ports = Ports(replay=True)
    async with ports.subscriber() as sub:
        async with publishing(Publisher(ports.config())) as old:
            await first_batch(old, sub, stored(1))
            old.publish(stored(2))
            old.publish(stored(3))
            await until(lambda: sub.last_seq == 2, "the old engine's batches applied")
        new = await rebind(ports, lose=lambda seq: seq < 4)
        async with publishing(new):
            for key in (10, 11, 12, 13):
                new.publish(stored(key))
            new.lose = lambda seq: False
            new.publish(stored(14))

            live = sub.messages

            def arrived() -> bool:
                if sub.last_seq != 4 or sub.messages == live:
                    new.resend(4)
                    return False
                return True

            await until(arrived, "batch 4 of the new engine applied")
            assert held(sub) == {10, 11, 12, 13, 14}
            assert sub.restarts == 1 and sub.index.live and sub.gaps_lost == 0


async def rebind(ports: Ports, lose: Callable[[int], bool] = lambda s: False) -> Publisher:
    """A new engine process on the same ports (the old sockets are closed asynchronously)."""
    found: list[Publisher] = []

    def bound() -> bool:
        try:
            found.append(Publisher(ports.config(), lose=lose))
        except zmq.ZMQError:
            return False
        return True

    await until(bound, "the ports free again")
    return found[0]


async def test_broken_payloads_are_counted_and_skipped() -> None:
    ports = Ports(replay=False)
    async with publishing(Publisher(ports.config())) as pub, ports.subscriber() as sub:
        await first_batch(pub, sub, stored(1))
        pub.send_raw([b"", (1).to_bytes(8, "big"), b"\xc1 not msgpack"])
        pub.send_raw([b"", (2).to_bytes(8, "big"), b"\x93\x01\x02\x03"])  # [1, 2, 3]
        pub.send_raw([b"", b"short"])
        pub._next_seq = 3  # the two broken batches took seqs 1 and 2
        pub.publish(stored(4))
        await until(lambda: sub.last_seq == 3, "the good batch after the broken ones")
        assert sub.decode_errors == 3
        assert held(sub) == {1, 4} and sub.index.live and sub.gaps == 0


async def test_stop_leaves_no_task_and_closes_its_sockets_even_mid_replay() -> None:
    ports = Ports(replay=True)
    ctx = zmq.asyncio.Context.instance()
    mute = ctx.socket(zmq.ROUTER)
    mute.bind(f"tcp://127.0.0.1:{ports.replay}")
    try:
        sub = ports.subscriber()
        sub.replay_timeout_s = 60.0
        await sub.start()
        requests = await asyncio.wait_for(mute.recv_multipart(), 5)  # the probe waits
        assert requests[-1] == (0).to_bytes(8, "big")
        await sub.stop()
        assert sub._task is None and sub._sub is None
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-events")]
        await sub.stop()  # twice is fine
    finally:
        mute.close(linger=0)
