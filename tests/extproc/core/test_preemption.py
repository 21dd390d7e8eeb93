"""Preemption: cancellable requests give their seat to more urgent ones, and lend it to
reserves (``extproc.core.preemption`` and its use in ``Admission``)."""

from __future__ import annotations

import dataclasses

from extproc.core.admission import Admission
from extproc.core.peers import PeerView, PreemptAsks
from extproc.core.preemption import LEND_MAX_SEATS, Cancellable
from extproc.fleet.backend import BackendPool
from extproc.policy.model import Gate
from tests.extproc.factories import (
    API,
    BATCH,
    INTERACTIVE,
    FakeClock,
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


BACKEND = "127.0.0.1:9000"  # make_admission's engine, the same on every replica


def _replica() -> tuple[Admission, BackendPool, FakeClock]:
    """One replica's admission over the shared two-seat engine."""
    return make_admission(limit=100, seats=2, tiers=(INTERACTIVE, API, PREEMPTIBLE_BATCH))


def test_a_chat_request_asks_the_replica_whose_batch_fills_the_engine() -> None:
    """Each client key on one replica: chat's replica (r1) holds no batch, r2's fills the
    engine. r1 sends chat there and asks r2, in its report; r2 cancels one batch request,
    once, however many reports repeat the ask."""
    chat_side, chat_pool, clock = _replica()
    batch_side, _, _ = _replica()
    for i in range(2):
        (grant,) = batch_side.submit(f"b{i}", Request(PREEMPTIBLE_BATCH))  # type: ignore[arg-type]
        batch_side.cancellable(grant.request_id)
    batch_report = batch_side.report("r2")
    assert batch_report.cancellable == {BACKEND: {2: 2}}
    chat_side.apply_peers(PeerView.merge([batch_report], read_at=clock(), me="r1"))
    assert chat_pool.backends[0].free_seats() == 0
    grants = chat_side.submit("chat", Request(INTERACTIVE))  # type: ignore[arg-type]
    assert [g.request_id for g in grants] == ["chat"]
    assert chat_side.take_preempted() == []  # nothing of its own to cancel
    chat_report = chat_side.report("r1")
    (ask,) = chat_report.asks
    assert (ask.replica, ask.backend, ask.rank) == ("r2", BACKEND, 0)
    # a second chat request does not ask for the same batch request: one is left
    chat_side.submit("chat-2", Request(INTERACTIVE))  # type: ignore[arg-type]
    assert len(chat_side.report("r1").asks) == 2
    chat_side.submit("chat-3", Request(INTERACTIVE))  # type: ignore[arg-type]
    assert len(chat_side.report("r1").asks) == 2  # none left to ask for
    for expected in (["b1"], []):  # the same ask, read twice: answered once
        batch_side.apply_peers(PeerView.merge([chat_report], read_at=clock(), me="r2"))
        assert batch_side.take_preempted() == expected
    # an ask addressed to another replica is not r2's to answer
    assert PeerView.merge([chat_report], read_at=clock(), me="r3").asks == ()


def test_asks_are_repeated_for_a_few_exchanges_then_dropped() -> None:
    asks = PreemptAsks()
    asks.ask("r2", BACKEND, 0, now=10.0)
    assert asks.pending(BACKEND, now=10.05, keep_s=0.1) == {"r2": 1}
    assert len(asks.recent(now=10.05, keep_s=0.1)) == 1
    assert asks.recent(now=10.2, keep_s=0.1) == ()
    assert asks.pending(BACKEND, now=10.2, keep_s=0.1) == {}
