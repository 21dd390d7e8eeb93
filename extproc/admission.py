"""When may a held request go, and where: the gate between the queues and the backends.

``submit`` queues a request and immediately dispatches whatever fits; a request granted on
the spot never needs a hold message. When a backend gains room (a completion released a
slot, a backend recovered, the policy changed) ``dispatch`` hands slots to the most urgent
waiters. Each grant records the request as in flight until its completion arrives (or, if
that event is lost, until ``expire`` reclaims it), and carries the continuous vLLM priority.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from extproc.backends import Backend, BackendPool
from extproc.errors import Rejection
from extproc.picker import pick
from extproc.priority import vllm_priority
from extproc.queues import QueueFull, TierQueues, Waiter

if TYPE_CHECKING:
    from extproc.classify import RequestClass

log = logging.getLogger("fairlane.admission")


@dataclass(frozen=True, slots=True)
class Grant:
    """Permission to send one request upstream."""

    endpoints: tuple[str, ...]
    priority: int
    queued_s: float


@dataclass(slots=True)
class InFlight:
    backend: Backend
    flow: tuple[str, str]
    admitted_at: float


class Ticket:
    """A submitted request: already granted, or waiting in its tier's queue."""

    def __init__(self, admission: Admission, waiter: Waiter, deadline_s: float) -> None:
        self._admission = admission
        self._waiter = waiter
        self.deadline_s = deadline_s

    @property
    def granted(self) -> bool:
        return self._waiter.future.done()

    def granted_now(self) -> Grant:
        """The grant of a ticket that was granted on submission."""
        grant: Grant = self._waiter.future.result()
        return grant

    async def wait(self) -> Grant:
        """The grant, once a backend has room; 503 when the tier's queue deadline passes.

        Cancellation (the client went away) takes the request out of its queue at once.
        """
        waiter = self._waiter
        try:
            grant: Grant = await asyncio.wait_for(asyncio.shield(waiter.future), self.deadline_s)
            return grant
        except TimeoutError:
            self._admission.abandon(waiter)
            raise Rejection(
                503,
                f"request waited {self.deadline_s:g}s in the {waiter.tier!r} queue "
                "without a backend becoming free",
                code="queue_deadline_exceeded",
            ) from None
        except asyncio.CancelledError:
            self._admission.abandon(waiter)
            raise


class Admission:
    """Tier queues in front of a per-backend in-flight limit."""

    def __init__(
        self,
        pool: BackendPool,
        limit_per_backend: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.queues = TierQueues(clock)
        self._limit = limit_per_backend
        self._clock = clock
        self._in_flight: dict[str, InFlight] = {}
        self._pending: Counter[tuple[str, str]] = Counter()
        pool.on_capacity(self.dispatch)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def knows(self, request_id: str) -> bool:
        """Whether ``request_id`` is queued or in flight (ids must be unique to release)."""
        return request_id in self._in_flight or self.queues.contains(request_id)

    def submit(self, request_id: str, request: RequestClass) -> Ticket:
        """Queue ``request``; 429 (with ``retry-after``) when its tier's queue is full."""
        tier = request.tier
        loop = asyncio.get_running_loop()
        waiter = Waiter(
            request_id, tier.name, tier.rank, self._clock(), loop.create_future(), request
        )
        try:
            self.queues.push(waiter, tier.queue_limit)
        except QueueFull as full:
            raise Rejection(
                429,
                f"the {tier.name!r} queue is full ({full.limit} requests waiting); retry later",
                code="queue_full",
                headers={"retry-after": str(full.retry_after_s)},
            ) from None
        self.dispatch()
        return Ticket(self, waiter, tier.queue_deadline_s)

    def dispatch(self) -> None:
        """Grant queued requests, most urgent first, while some backend has room."""
        while len(self.queues):
            chosen = pick(self.pool.backends, self._limit())
            if chosen is None:
                return
            waiter = self.queues.pop()
            if waiter is None:
                return
            if waiter.future.done():  # cancelled while queued; already gone
                continue
            waiter.future.set_result(self._grant(waiter, chosen))

    def _grant(self, waiter: Waiter, chosen: list[Backend]) -> Grant:
        request: RequestClass = waiter.payload
        flow = (request.tenant.name, request.user)
        priority = vllm_priority(request.tier.priority, self._pending[flow])
        backend = chosen[0]
        backend.in_flight += 1
        self._pending[flow] += 1
        now = self._clock()
        self._in_flight[waiter.request_id] = InFlight(backend, flow, now)
        return Grant(tuple(b.address for b in chosen), priority, now - waiter.enqueued_at)

    def abandon(self, waiter: Waiter) -> None:
        """The waiter's client is gone or its deadline passed: drop it, or undo its grant."""
        if self.queues.remove(waiter):
            waiter.future.cancel()
        elif waiter.future.done() and not waiter.future.cancelled():
            self.release(waiter.request_id)  # granted in the same instant it gave up

    def release(self, request_id: str) -> bool:
        """The request finished (or will never reach a backend): free its slot."""
        entry = self._in_flight.pop(request_id, None)
        if entry is None:
            return False
        entry.backend.in_flight -= 1
        self._pending[entry.flow] -= 1
        if self._pending[entry.flow] <= 0:
            del self._pending[entry.flow]
        self.dispatch()
        return True

    def expire(self, max_age_s: float) -> int:
        """Reclaim slots whose completion never arrived (a lost access-log event)."""
        cutoff = self._clock() - max_age_s
        stale = [rid for rid, entry in self._in_flight.items() if entry.admitted_at < cutoff]
        for request_id in stale:
            log.warning(
                "no completion seen for %s after %.0fs; releasing its slot", request_id, max_age_s
            )
            with contextlib.suppress(KeyError):
                self.release(request_id)
        return len(stale)
