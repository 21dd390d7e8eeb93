"""The service's KV event subscriptions: one per engine that publishes, following the fleet.

A backend configured with ``#kv-events=PORT[,kv-replay=PORT]`` has a ``KVBlockIndex``
(``extproc.fleet.backend``); this keeps one ``KVEventSubscriber`` filling it while the
backend is in the pool, started when it joins (at start-up, or when a DNS name resolves to
a new address) and stopped when it leaves. The engine's KV capacity, once its scrapes
report it, lets a subscriber that lost part of the stream trust its index again after that
many blocks were stored (``relive_after_blocks``).
"""

from __future__ import annotations

import asyncio
import logging

from extproc.fleet.backend import Backend, BackendPool
from extproc.fleet.kv_subscriber import KVEventSubscriber

log = logging.getLogger("fairlane.kv_events")

SYNC_EVERY_S = 2.0
"""How soon a backend that joined is followed (the service also syncs on fleet changes)."""


def endpoints(backend: Backend) -> tuple[str, str | None] | None:
    """The engine's PUB and replay endpoints, on its own host (None: it publishes none)."""
    ports = backend.spec.kv_events
    if ports is None:
        return None
    host = backend.spec.host
    if ":" in host:
        host = f"[{host}]"
    replay = f"tcp://{host}:{ports.replay_port}" if ports.replay_port is not None else None
    return f"tcp://{host}:{ports.port}", replay


class KVEventFeeds:
    """Subscribers by backend address; ``sync`` makes them match the pool."""

    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._lock = asyncio.Lock()

    async def sync(self) -> None:
        """Start a subscriber for each publishing backend in the pool, stop the others'."""
        async with self._lock:
            present = {b.address: b for b in self.pool.backends if b.kv_index is not None}
            for address in [a for a in self.subscribers if a not in present]:
                await self.subscribers.pop(address).stop()
                log.info("backend %s left: its KV events are no longer followed", address)
            for address, backend in present.items():
                subscriber = self.subscribers.get(address)
                if subscriber is None:
                    subscriber = self._subscriber(backend)
                    if subscriber is None:
                        continue
                    self.subscribers[address] = subscriber
                    await subscriber.start()
                    log.info(
                        "backend %s: following its KV events at %s", address, subscriber.endpoint
                    )
                subscriber.relive_after_blocks = self._capacity(backend)

    def _subscriber(self, backend: Backend) -> KVEventSubscriber | None:
        found = endpoints(backend)
        if found is None or backend.kv_index is None:
            return None
        endpoint, replay = found
        return KVEventSubscriber(
            endpoint,
            backend.kv_index,
            replay_endpoint=replay,
            relive_after_blocks=self._capacity(backend),
        )

    @staticmethod
    def _capacity(backend: Backend) -> int | None:
        metrics = backend.metrics
        return metrics.num_gpu_blocks if metrics is not None else None

    async def run(self, every_s: float = SYNC_EVERY_S) -> None:
        """Keep in step with the pool (backends joining and leaving, capacities learned)."""
        while True:
            await self.sync()
            await asyncio.sleep(every_s)

    async def stop(self) -> None:
        async with self._lock:
            subscribers, self.subscribers = self.subscribers, {}
        await asyncio.gather(*(s.stop() for s in subscribers.values()), return_exceptions=True)
