"""Where held requests wait: one bounded FIFO per tier, served in strict tier order.

This is the first version of the scheduler's queues (the fair scheduler replaces what happens
inside a tier); the hold / release / shed plumbing around it stays. Removal is O(1) because a
client that disconnects while held must leave its queue at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False, slots=True)
class Waiter:
    """A request waiting for a backend; its future resolves to the admission grant."""

    request_id: str
    tier: str
    rank: int
    enqueued_at: float
    future: asyncio.Future[Any]
    payload: Any = None
    """Whatever the admission layer needs to grant it (the request's class)."""


class QueueFull(Exception):
    def __init__(self, tier: str, limit: int, retry_after_s: int) -> None:
        super().__init__(f"queue for tier {tier!r} is full ({limit} waiting)")
        self.tier = tier
        self.limit = limit
        self.retry_after_s = retry_after_s


@dataclass
class DrainMeter:
    """How fast a queue empties: dequeues over a sliding window, for ``retry-after``."""

    window_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _times: deque[float] = field(default_factory=deque)

    def record(self) -> None:
        now = self.clock()
        self._times.append(now)
        self._trim(now)

    def rate(self) -> float:
        """Dequeues per second over the window (0 when nothing left lately)."""
        self._trim(self.clock())
        return len(self._times) / self.window_s

    def _trim(self, now: float) -> None:
        while self._times and self._times[0] < now - self.window_s:
            self._times.popleft()


class TierQueues:
    """Bounded FIFO queues keyed by tier name, popped most urgent tier (lowest rank) first."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._queues: dict[str, OrderedDict[str, Waiter]] = {}
        self._ranks: dict[str, int] = {}
        self._order: list[str] = []
        self._meters: dict[str, DrainMeter] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def depth(self, tier: str) -> int:
        queue = self._queues.get(tier)
        return len(queue) if queue else 0

    def contains(self, request_id: str) -> bool:
        return any(request_id in queue for queue in self._queues.values())

    def depths(self) -> dict[str, int]:
        return {tier: len(queue) for tier, queue in self._queues.items()}

    def push(self, waiter: Waiter, limit: int) -> None:
        """Append ``waiter`` to its tier; ``QueueFull`` when the tier already holds ``limit``."""
        queue = self._queue_for(waiter.tier, waiter.rank)
        if len(queue) >= limit:
            raise QueueFull(waiter.tier, limit, self.retry_after_s(waiter.tier))
        queue[waiter.request_id] = waiter

    def pop(self) -> Waiter | None:
        """The oldest waiter of the most urgent non-empty tier."""
        for tier in self._order:
            queue = self._queues[tier]
            if queue:
                _, waiter = queue.popitem(last=False)
                self._meters[tier].record()
                return waiter
        return None

    def remove(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out (client gone, deadline passed); False if it was not queued."""
        queue = self._queues.get(waiter.tier)
        return queue is not None and queue.pop(waiter.request_id, None) is not None

    def retry_after_s(self, tier: str) -> int:
        """Seconds until a full queue has likely drained enough to take one more request."""
        rate = self._meters[tier].rate() if tier in self._meters else 0.0
        depth = self.depth(tier)
        if rate <= 0:
            return 30
        return max(1, min(300, math.ceil(depth / rate)))

    def _queue_for(self, tier: str, rank: int) -> OrderedDict[str, Waiter]:
        queue = self._queues.get(tier)
        if queue is None or self._ranks[tier] != rank:
            if queue is None:
                queue = self._queues[tier] = OrderedDict()
                self._meters[tier] = DrainMeter(clock=self._clock)
            self._ranks[tier] = rank  # a policy reload may re-rank tiers
            self._order = sorted(self._queues, key=self._ranks.__getitem__)
        return queue
