import asyncio

import pytest

from extproc.admission import Admission
from extproc.backends import BackendPool, BackendSpec
from extproc.errors import Rejection
from tests.extproc.factories import API, BATCH, INTERACTIVE, Request


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(limit: int = 1, backends: int = 1) -> tuple[Admission, BackendPool]:
    pool = BackendPool([BackendSpec("127.0.0.1", 9000 + i, "r") for i in range(backends)])
    return Admission(pool, lambda: limit, clock=FakeClock()), pool


async def test_granted_at_once_when_a_backend_has_room() -> None:
    admission, pool = make(limit=2)
    ticket = admission.submit("r1", Request(API))  # type: ignore[arg-type]
    assert ticket.granted
    grant = ticket.granted_now()
    assert grant.endpoints == ("127.0.0.1:9000",)
    assert grant.priority == API.priority
    assert pool.backends[0].in_flight == 1


async def test_held_requests_are_released_most_urgent_tier_first() -> None:
    admission, _ = make(limit=1)
    admission.submit("running", Request(BATCH))  # type: ignore[arg-type]
    batch = admission.submit("batch", Request(BATCH))  # type: ignore[arg-type]
    interactive = admission.submit("chat", Request(INTERACTIVE))  # type: ignore[arg-type]
    assert not batch.granted and not interactive.granted
    admission.release("running")
    assert interactive.granted and not batch.granted
    admission.release("chat")
    assert batch.granted


async def test_continuous_priority_counts_the_users_pending_requests() -> None:
    admission, _ = make(limit=10)
    priorities = [
        admission.submit(f"a{i}", Request(API, user="power")).granted_now().priority  # type: ignore[arg-type]
        for i in range(4)
    ]
    other = admission.submit("b", Request(API, user="casual")).granted_now().priority  # type: ignore[arg-type]
    assert priorities == [10, 11, 12, 13]
    assert other == 10
    admission.release("a0")
    assert admission.submit("a4", Request(API, user="power")).granted_now().priority == 13  # type: ignore[arg-type]


async def test_full_queue_is_a_429_with_retry_after() -> None:
    admission, _ = make(limit=1)
    admission.submit("running", Request(API))  # type: ignore[arg-type]
    for i in range(API.queue_limit):
        admission.submit(f"q{i}", Request(API))  # type: ignore[arg-type]
    with pytest.raises(Rejection) as info:
        admission.submit("one-too-many", Request(API))  # type: ignore[arg-type]
    assert info.value.status == 429
    assert int(info.value.headers["retry-after"]) >= 1


async def test_deadline_passed_is_a_503_and_leaves_the_queue() -> None:
    admission, _ = make(limit=1)
    admission.submit("running", Request(API))  # type: ignore[arg-type]
    ticket = admission.submit("late", Request(API))  # type: ignore[arg-type]
    ticket.deadline_s = 0.01
    with pytest.raises(Rejection) as info:
        await ticket.wait()
    assert info.value.status == 503
    assert len(admission.queues) == 0


async def test_cancelled_waiter_leaves_the_queue_at_once() -> None:
    admission, _ = make(limit=1)
    admission.submit("running", Request(API))  # type: ignore[arg-type]
    ticket = admission.submit("gone", Request(API))  # type: ignore[arg-type]
    task = asyncio.create_task(ticket.wait())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(admission.queues) == 0
    admission.release("running")  # the slot goes to nobody; nothing leaks
    assert admission.in_flight == 0


async def test_abandoning_a_granted_waiter_gives_its_slot_back() -> None:
    admission, pool = make(limit=1)
    admission.submit("running", Request(API))  # type: ignore[arg-type]
    ticket = admission.submit("racy", Request(API))  # type: ignore[arg-type]
    admission.release("running")  # grants "racy"...
    assert ticket.granted
    admission.abandon(ticket._waiter)  # ...but its client left before it was forwarded
    assert admission.in_flight == 0 and pool.backends[0].in_flight == 0


async def test_unhealthy_backend_holds_requests_until_it_recovers() -> None:
    admission, pool = make(limit=4)
    pool.backends[0].healthy = False
    ticket = admission.submit("r", Request(API))  # type: ignore[arg-type]
    assert not ticket.granted
    pool.backends[0].healthy = True
    pool.capacity_changed()
    assert ticket.granted


async def test_lost_completion_is_reclaimed_after_the_timeout() -> None:
    admission, _pool = make(limit=1)
    clock: FakeClock = admission._clock  # type: ignore[assignment]
    admission.submit("lost", Request(API))  # type: ignore[arg-type]
    waiting = admission.submit("next", Request(API))  # type: ignore[arg-type]
    clock.now += 100
    assert admission.expire(max_age_s=300) == 0
    clock.now += 300
    assert admission.expire(max_age_s=300) == 1
    assert waiting.granted
    assert not admission.release("lost")


async def test_knows_queued_and_in_flight_ids() -> None:
    admission, _ = make(limit=1)
    admission.submit("a", Request(API))  # type: ignore[arg-type]
    admission.submit("b", Request(API))  # type: ignore[arg-type]
    assert admission.knows("a") and admission.knows("b") and not admission.knows("c")
