"""Preemption: cancellable requests give their seat to more urgent ones, and lend it to
reserves (``extproc.core.preemption`` and its use in ``Admission``)."""

from __future__ import annotations

import dataclasses

from extproc.core.preemption import LEND_MAX_SEATS, Cancellable
from extproc.policy.model import Gate
from tests.extproc.factories import (
    API,
    BATCH,
    INTERACTIVE,
    Request,
    make_admission,
    scraped,
    with_gate,
)

PREEMPTIBLE_BATCH = dataclasses.replace(BATCH, preemptible=True)


def test_the_victim_is_the_newest_of_the_least_urgent_tier_on_that_backend() -> None:
    cancellable = Cancellable()
    cancellable.add("a", "old-batch", 2)
    cancellable.add("a", "api", 1)
    cancellable.add("a", "new-batch", 2)
    cancellable.add("b", "other-backend", 2)
    assert cancellable.victim("a", 0) == "new-batch"
    assert cancellable.victim("a", 1) == "new-batch"
    assert cancellable.victim("a", 2) is None  # never for its own tier
    cancellable.discard("new-batch")
    assert cancellable.victim("a", 1) == "old-batch"
    assert cancellable.victim("a", 0) == "old-batch"  # batch before api
    cancellable.discard("old-batch")
    assert cancellable.victim("a", 0) == "api"
    assert cancellable.victim("a", 1) is None
    assert cancellable.victim("c", 0) is None
    assert cancellable.spare(2) == 1 and cancellable.spare(1) == 2
    cancellable.discard("never-added")
    assert len(cancellable) == 2


def test_a_chat_request_takes_the_seat_of_a_cancellable_batch_request() -> None:
    admission, pool, _ = make_admission(
        limit=100, seats=2, tiers=(INTERACTIVE, API, PREEMPTIBLE_BATCH)
    )
    for i in range(2):
        (grant,) = admission.submit(f"b{i}", Request(PREEMPTIBLE_BATCH))  # type: ignore[arg-type]
        admission.cancellable(grant.request_id)
    assert pool.backends[0].free_seats() == 0
    assert admission.take_preempted() == []
    grants = admission.submit("chat", Request(INTERACTIVE))  # type: ignore[arg-type]
    assert [g.request_id for g in grants] == ["chat"]
    assert admission.take_preempted() == ["b1"]  # the newest
    assert admission.take_preempted() == []
    assert admission.grant_of("b1") is None  # its seat is chat's now
    assert admission.release("b1") == []  # its late completion changes nothing


def test_nothing_is_preempted_when_a_seat_is_free_or_no_request_can_be_cancelled() -> None:
    admission, _, _ = make_admission(
        limit=100, seats=2, tiers=(INTERACTIVE, API, PREEMPTIBLE_BATCH)
    )
    (first,) = admission.submit("b0", Request(PREEMPTIBLE_BATCH))  # type: ignore[arg-type]
    admission.cancellable(first.request_id)
    admission.submit("chat", Request(INTERACTIVE))  # type: ignore[arg-type]
    assert admission.take_preempted() == []  # there was a free seat
    admission.not_cancellable("b0")  # its answer started
    admission.submit("chat-2", Request(INTERACTIVE))  # type: ignore[arg-type]
    assert admission.take_preempted() == []


def _batch_granted(seats: int) -> int:
    """How many cancellable batch requests one engine of ``seats`` takes while chat is
    active (it keeps a reserve)."""
    chat = dataclasses.replace(INTERACTIVE, reserved_share=0.25)
    admission, _, _ = make_admission(limit=100, seats=seats, tiers=(chat, API, PREEMPTIBLE_BATCH))
    admission.submit("chat", Request(chat))  # type: ignore[arg-type]
    admission.release("chat")  # chat is active: it holds its reserve
    granted = 0
    for i in range(seats + 2):
        for grant in admission.submit(f"b{i}", Request(PREEMPTIBLE_BATCH)):  # type: ignore[arg-type]
            admission.cancellable(grant.request_id)
            granted += 1
    return granted


def test_a_small_engine_lends_its_reserve_to_cancellable_batch_a_big_one_keeps_it() -> None:
    assert LEND_MAX_SEATS == 16
    assert _batch_granted(4) == 4  # the reserved seat too: chat would preempt for it
    assert _batch_granted(32) < 32  # a re-prefill stalls all 32 seats: the reserve idles


def test_chat_held_by_a_full_kv_cache_cancels_one_batch_request_at_a_time() -> None:
    chat = with_gate(
        dataclasses.replace(INTERACTIVE, reserved_share=0.25),
        Gate(max_waiting=3, max_kv_cache_usage=0.95),
    )
    admission, pool, clock = make_admission(
        limit=100, seats=64, tiers=(chat, API, PREEMPTIBLE_BATCH)
    )
    for i in range(3):
        (grant,) = admission.submit(f"b{i}", Request(PREEMPTIBLE_BATCH))  # type: ignore[arg-type]
        admission.cancellable(grant.request_id)
    backend = pool.backends[0]
    scraped(backend, clock, kv=0.99)  # the batch requests grew into the whole cache
    assert admission.submit("chat", Request(chat)) == []  # type: ignore[arg-type]
    assert admission.take_preempted() == ["b2"]  # its blocks are free at the next step
    clock.now += 0.1
    scraped(backend, clock, kv=0.99)  # the others grew into them meanwhile
    admission.dispatch()
    assert admission.take_preempted() == []  # one at a time: each costs a prefill again
    clock.now += 1.0  # stale_after_s: those blocks went elsewhere, another may go
    scraped(backend, clock, kv=0.99)
    admission.dispatch()
    assert admission.take_preempted() == ["b1"]
    clock.now += 0.1
    scraped(backend, clock, kv=0.5)
    assert [g.request_id for g in admission.dispatch()] == ["chat"]
    assert admission.take_preempted() == []  # a seat was free


def _chat_on_a_full_engine(batch_runs_s: float) -> list[str]:
    """What a chat request (TTFT target 0.5 s) cancels on a full engine of 2 seats whose
    batch requests ran ``batch_runs_s`` each."""
    chat = dataclasses.replace(INTERACTIVE, slo_ttft_ms=500)
    admission, pool, clock = make_admission(
        limit=100, seats=2, tiers=(chat, API, PREEMPTIBLE_BATCH)
    )
    for i in range(2):  # sent together, finished together
        admission.submit(f"earlier{i}", Request(PREEMPTIBLE_BATCH))  # type: ignore[arg-type]
    clock.now += batch_runs_s
    scraped(pool.backends[0], clock)  # fresh metrics
    for i in range(2):
        admission.release(f"earlier{i}", output_tokens=10)
    for i in range(2):
        (grant,) = admission.submit(f"b{i}", Request(PREEMPTIBLE_BATCH))  # type: ignore[arg-type]
        admission.cancellable(grant.request_id)
    (grant,) = admission.submit("chat", Request(chat))  # type: ignore[arg-type]
    assert grant.request_id == "chat"  # sent at once either way
    return admission.take_preempted()


def test_chat_cancels_only_where_a_batch_seat_would_be_long_in_freeing() -> None:
    # 2 seats of 4 s requests free one every 2 s: far past half chat's 0.5 s target
    assert _chat_on_a_full_engine(4.0) == ["b1"]
    # 0.2 s requests (a big engine's rate): chat waits for one, and no work is lost
    assert _chat_on_a_full_engine(0.2) == []
