"""Held requests on the event loop: deadlines, cancellation and shutdown around the core."""

import asyncio
import dataclasses

import pytest

from extproc.core.decisions import Forward, Hold, Respond
from extproc.core.events import Completion
from extproc.transport.held import HeldRequests
from tests.extproc.factories import make_gateway, request


def saturated(limit: int = 1) -> HeldRequests:
    """A gateway whose two backends each run ``limit`` requests (``run0``, ``run1`` ...)."""
    held = HeldRequests(make_gateway(limit=limit))
    for i in range(2 * limit):
        assert isinstance(held.handle(request(request_id=f"run{i}")), Forward)
    return held


def hold(held: HeldRequests, request_id: str, key: str = "sk-chat-demo") -> Hold:
    answer = held.handle(request(key, request_id=request_id))
    assert isinstance(answer, Hold), answer
    return answer


async def test_a_completion_wakes_the_held_request_it_made_room_for() -> None:
    held = saturated()
    waiting = hold(held, "next")
    outcome = asyncio.create_task(held.outcome(waiting))
    await asyncio.sleep(0)
    assert not outcome.done()
    address = held.gateway.admission.backend_of("run0").address  # type: ignore[union-attr]
    held.completed(Completion("run0", 200, address, 0.5, 1_000))
    forward = await asyncio.wait_for(outcome, 1)
    assert isinstance(forward, Forward) and forward.endpoints[0] == address
    assert len(held) == 0


def test_completions_of_other_replicas_are_told_apart() -> None:
    held = saturated()
    assert held.in_flight("run0") and not held.in_flight("another-replicas")
    backend = held.gateway.admission.backend_of("run0")
    assert backend is not None
    before = backend.completed_since_scrape
    held.done_elsewhere(backend.address)  # another replica's request finished there
    held.done_elsewhere("10.9.9.9:1")  # a backend this replica does not know: ignored
    assert backend.completed_since_scrape == before + 1
    assert backend.in_flight == 1  # ours is still running


async def test_deadline_passed_is_a_503_and_leaves_the_queue() -> None:
    held = saturated()
    late = dataclasses.replace(hold(held, "late"), deadline_s=0.01)
    answer = await held.outcome(late)
    assert isinstance(answer, Respond) and answer.status == 503
    assert b"queue_deadline_exceeded" in answer.body
    assert len(held.gateway.admission.scheduler) == 0 and len(held) == 0


async def test_cancelled_waiter_leaves_the_queue_at_once() -> None:
    held = saturated()
    admission = held.gateway.admission
    task = asyncio.create_task(held.outcome(hold(held, "gone")))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(admission.scheduler) == 0
    admission.release("run0")  # the slot goes to nobody; nothing leaks
    assert admission.in_flight == 1 and len(held) == 0


async def test_thousands_of_cancelled_waiters_leave_nothing_behind() -> None:
    held = saturated()
    admission = held.gateway.admission
    holds = [hold(held, f"b{i}", "sk-batch-demo") for i in range(3000)]
    tasks = [asyncio.create_task(held.outcome(h)) for h in holds]
    await asyncio.sleep(0)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert len(admission.scheduler) == 0 and len(held) == 0
    admission.release("run0")
    admission.release("run1")
    assert admission.in_flight == 0
    assert all(b.in_flight == 0 for b in admission.pool.backends)
    assert admission.scheduler.tracked_flows() == 0


async def test_a_grant_made_in_the_instant_its_client_left_is_given_back() -> None:
    held = saturated()
    admission = held.gateway.admission
    task = asyncio.create_task(held.outcome(hold(held, "racy")))
    await asyncio.sleep(0)
    admission.release("run0")  # a seat frees: "racy" is granted...
    held.dispatch()
    task.cancel()  # ...but its client leaves before the stream forwards it
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not admission.knows("racy") and admission.in_flight == 1


async def test_shutting_down_turns_every_held_request_away_with_a_503() -> None:
    held = saturated()
    holds = [hold(held, "h0", "sk-api-demo"), hold(held, "h1", "sk-batch-demo")]
    assert held.turn_away("restarting", "gateway_restarting", retry_after_s=1) == 2
    for waiting, tier in zip(holds, ("api", "batch"), strict=True):
        answer = await held.outcome(waiting)
        assert isinstance(answer, Respond) and answer.status == 503
        assert answer.headers == {"retry-after": "1"}
        assert held.gateway.stats.shed[(tier, "gateway_restarting")] == 1
    admission = held.gateway.admission
    assert len(admission.scheduler) == 0 and admission.in_flight == 2  # the running stay
