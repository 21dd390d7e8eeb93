"""Admission over the other replicas' state (``extproc.core.peers``), without Redis."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from extproc.core.errors import Rejection
from extproc.core.peers import PeerBand, PeerView, ReplicaReport, turn
from extproc.core.scheduler import Head
from extproc.policy.model import Gate
from tests.extproc.core.test_admission import submit
from tests.extproc.factories import (
    API,
    BATCH,
    INTERACTIVE,
    TENANT,
    FakeClock,
    Request,
    make_admission,
    scraped,
    with_gate,
)

BACKEND = "127.0.0.1:9000"


def view(*reports: ReplicaReport) -> PeerView:
    return PeerView.merge(reports, read_at=1000.0)


def view_at(clock: FakeClock, *reports: ReplicaReport) -> PeerView:
    return PeerView.merge(reports, read_at=clock())


def test_merge_sums_leases_and_waiting_and_ages_by_the_reports_age() -> None:
    merged = view(
        ReplicaReport("r2", {BACKEND: {0: 1, 2: 3}}, {"batch": PeerBand(2, 1.0)}, {"api": 5.0}),
        ReplicaReport(
            "r3", {BACKEND: {2: 1}}, {"batch": PeerBand(1, 4.0)}, {"api": 1.0}, age_s=0.5
        ),
    )
    assert merged.in_flight_by_backend[BACKEND] == Counter({0: 1, 2: 4})
    assert merged.in_flight_by_rank == Counter({0: 1, 2: 4})
    assert merged.waiting["batch"] == PeerBand(3, 4.5)
    assert merged.idle_for_s("api", now=1000.0) == 1.5
    assert merged.idle_for_s("batch", now=1000.0) == float("inf")
    assert merged.oldest_wait_s("batch", now=1002.0) == 6.5
    assert merged.replicas == 3


def test_merge_sums_the_kv_tokens_each_replica_sent_to_each_backend() -> None:
    merged = view(
        ReplicaReport("r2", kv_tokens={BACKEND: 100, "10.0.0.9:8000": 5}),
        ReplicaReport("r3", kv_tokens={BACKEND: 50}),
    )
    assert merged.kv_tokens == {BACKEND: 150, "10.0.0.9:8000": 5}


def test_a_report_carries_the_kv_tokens_sent_and_apply_peers_hands_them_to_the_backend() -> None:
    admission, pool, clock = make_admission(limit=4)
    submit(admission, "a1", Request(API, prompt_tokens=100, max_tokens=50))
    sent = pool.backends[0].kv_tokens_total
    assert sent > 0 and admission.report("r1").kv_tokens == {BACKEND: sent}
    admission.apply_peers(view_at(clock, ReplicaReport("r2", kv_tokens={BACKEND: 700})))
    assert pool.backends[0].peer_kv_tokens_total == 700


def test_other_replicas_leases_count_against_the_per_backend_cap() -> None:
    admission, pool, _ = make_admission(limit=2)
    admission.apply_peers(view(ReplicaReport("r2", {BACKEND: {1: 2}})))
    assert pool.backends[0].fleet_in_flight == 2
    ticket = submit(admission, "r1", Request(API))
    assert not ticket.granted  # both seats are leased by r2
    grants = admission.apply_peers(view())  # r2's lease expired (or its requests finished)
    assert [g.request_id for g in grants] == ["r1"]
    assert pool.backends[0].peer_in_flight == 0


def test_a_band_waits_while_another_replica_holds_a_more_urgent_one() -> None:
    admission, _, _ = make_admission(limit=1, backends=2)
    submit(admission, "busy", Request(API))  # one of the two seats
    admission.apply_peers(view(ReplicaReport("r2", waiting={"interactive": PeerBand(1, 0.0)})))
    batch = submit(admission, "b1", Request(BATCH))
    assert not batch.granted  # the last seat is free, but interactive elsewhere goes first
    same = submit(admission, "i1", Request(INTERACTIVE))
    assert same.granted  # an equally urgent band is not held back: ties do not block
    admission.release("i1")
    grants = admission.apply_peers(view())
    assert [g.request_id for g in grants] == ["b1"]


def test_aging_counts_for_the_bands_waiting_elsewhere() -> None:
    aging = dataclasses.replace(BATCH, aging_rate=1.0, aging_cap=2.0)
    admission, _, _ = make_admission(limit=1, tiers=(INTERACTIVE, API, aging))
    # batch has waited 5 s on r2: aged to rank 0 (capped at 2 ranks), ties with interactive
    # on effective rank but not on base rank, so api here leaves the one seat to it.
    admission.apply_peers(view(ReplicaReport("r2", waiting={"batch": PeerBand(1, 5.0)})))
    assert not submit(admission, "a1", Request(API)).granted
    assert submit(admission, "i1", Request(INTERACTIVE)).granted


def test_a_tier_active_only_on_another_replica_keeps_its_reserve_here() -> None:
    chat = dataclasses.replace(INTERACTIVE, reserved_share=0.5, reserved_idle_s=60.0)
    admission, _, _ = make_admission(limit=4, tiers=(chat, API, BATCH))
    for i in range(4):
        submit(admission, f"b{i}", Request(BATCH))
    assert admission.in_flight == 4  # chat idle everywhere: batch may use every seat
    for i in range(4):
        admission.release(f"b{i}")
    admission.apply_peers(view(ReplicaReport("r2", idle_s={"interactive": 1.0})))
    granted = [submit(admission, f"c{i}", Request(BATCH)).granted for i in range(4)]
    assert granted.count(True) < 4  # chat arrived on r2 a second ago: its reserve holds here


def test_cut_off_schedules_on_a_share_of_each_backend() -> None:
    admission, _, clock = make_admission(limit=4, backends=2)
    assert (admission.backend_limit, admission.capacity) == (4, 8)
    admission.apply_peers(PeerView.cut_off(replicas=2, read_at=clock()))
    assert (admission.backend_limit, admission.capacity) == (2, 4)
    granted = [submit(admission, f"r{i}", Request(API)).granted for i in range(6)]
    assert granted.count(True) == 4


def test_service_a_flow_got_elsewhere_counts_in_fairness_here() -> None:
    admission, _, _ = make_admission(limit=1)
    submit(admission, "busy", Request(API))  # takes the only seat
    light = dataclasses.replace(TENANT, name="light")
    submit(admission, "heavy-1", Request(API))
    submit(admission, "light-1", Request(API, tenant=light))
    # Without news from elsewhere the two flows tie and the earliest head (heavy) goes.
    # acme has been served a lot on other replicas: light goes first.
    admission.charge_elsewhere([("api", "acme", 10_000.0)])
    grants = admission.release("busy")
    assert [g.request_id for g in grants] == ["light-1"]


def test_report_carries_leases_waiting_bands_and_last_arrivals() -> None:
    admission, _, clock = make_admission(limit=1)
    submit(admission, "r1", Request(INTERACTIVE))
    clock.now += 2.0
    submit(admission, "r2", Request(BATCH))
    clock.now += 1.0
    report = admission.report("r1")
    assert report.in_flight == {BACKEND: {INTERACTIVE.rank: 1}}
    # acme has not been served in the band since it arrived: fresh
    assert report.waiting == {"batch": PeerBand(1, 1.0, 0.0, "acme", head_fresh=True)}
    assert report.idle_s == {"interactive": 3.0, "batch": 1.0}


def test_alone_the_view_changes_nothing() -> None:
    admission, _, _ = make_admission(limit=1)
    assert admission.peers == PeerView()
    assert admission.fleet_in_flight_by_rank() is admission._in_flight_by_rank


def test_a_tiers_queue_limit_holds_over_all_replicas() -> None:
    admission, _, _ = make_admission(limit=1)  # API's queue_limit is 4
    submit(admission, "busy", Request(API))
    admission.apply_peers(view(ReplicaReport("r2", waiting={"api": PeerBand(3, 0.0)})))
    assert not submit(admission, "a1", Request(API)).granted  # 1 here + 3 on r2 = 4
    with pytest.raises(Rejection) as refused:
        submit(admission, "a2", Request(API))
    assert refused.value.status == 429 and refused.value.code == "queue_full"


def test_room_goes_to_a_replica_whose_queue_has_waited_far_longer() -> None:
    admission, _, _ = make_admission(limit=1)
    submit(admission, "busy", Request(API))
    submit(admission, "a1", Request(API))  # has just arrived here
    # r2's api queue has waited 10 s (it rarely sees a free seat): the seat is left to it.
    admission.apply_peers(
        view(ReplicaReport("r2", waiting={"api": PeerBand(1, 10.0, 0.0, "acme")}))
    )
    assert admission.release("busy") == []
    # r2 took it (its next report: nothing waiting): the next seat is ours again.
    assert [g.request_id for g in admission.apply_peers(view())] == ["a1"]


def test_room_goes_to_a_replica_whose_next_flow_is_owed_clearly_more() -> None:
    admission, _, _ = make_admission(limit=1)
    submit(admission, "busy", Request(API))
    submit(admission, "a1", Request(API))
    admission.charge_elsewhere([("api", "acme", 1000.0)])  # acme was served elsewhere
    head = admission.scheduler.head("api")
    assert head is not None and head.next_cost == 200.0  # 100 in + 2 x 50 out
    # light, on r2, is owed 500 more: more than one charge (200): deferred.
    owed = ReplicaReport("r2", waiting={"api": PeerBand(1, 0.0, head.counter - 500, "light")})
    admission.apply_peers(view(owed))
    assert admission.release("busy") == []
    # The same gap for acme itself on r2 is charges in transit, not a debt: no deferral.
    same = ReplicaReport("r2", waiting={"api": PeerBand(1, 0.0, head.counter - 500, "acme")})
    assert [g.request_id for g in admission.apply_peers(view(same))] == ["a1"]


def test_queues_that_waited_alike_each_serve_their_own() -> None:
    admission, _, clock = make_admission(limit=1)
    submit(admission, "busy", Request(API))
    submit(admission, "a1", Request(API))
    clock.now += 1.0  # a1 has waited 1 s; r2's oldest 2 s: within 2x plus the slack
    alike = ReplicaReport("r2", waiting={"api": PeerBand(3, 2.0, 0.0, "acme")})
    admission.apply_peers(PeerView.merge([alike], read_at=clock()))
    assert [g.request_id for g in admission.release("busy")] == ["a1"]


def test_a_band_drained_here_restarts_at_the_other_replicas_counters() -> None:
    admission, _, _ = make_admission(limit=1)
    submit(admission, "busy", Request(API))
    admission.apply_peers(
        view(ReplicaReport("r2", waiting={"api": PeerBand(2, 0.0, 750.0, "other")}))
    )
    submit(admission, "a1", Request(API))
    head = admission.scheduler.head("api")
    assert head is not None and head.counter == 750.0  # not 0: not ahead of r2's flows


def test_room_left_to_another_replica_is_taken_back_when_it_does_not_use_it() -> None:
    admission, _, clock = make_admission(limit=1)
    urgent = view(ReplicaReport("r2", waiting={"interactive": PeerBand(1, 0.0)}))
    admission.apply_peers(urgent)
    batch = submit(admission, "b1", Request(BATCH))
    assert not batch.granted  # r2's chat may take the seat first ...
    clock.now += urgent.defer_s + 0.001
    assert [g.request_id for g in admission.dispatch()] == ["b1"]  # ... but did not


SEATED = with_gate(BATCH, Gate(max_waiting=0, max_kv_cache_usage=None))  # needs a free seat


def test_turn_counts_the_requests_of_the_replicas_whose_oldest_request_waited_longer() -> None:
    """The room goes first to those replicas, as many seats as they wait for: room several
    replicas see at once (a scrape) is not taken by each."""
    reports = (
        ReplicaReport("r2", waiting={"batch": PeerBand(4, 3.0)}),
        ReplicaReport("r3", waiting={"batch": PeerBand(1, 0.5)}, age_s=1.0),  # 1.5 s by now
        ReplicaReport("r4", waiting={"api": PeerBand(9, 60.0)}),  # another band
    )
    merged = PeerView.merge(reports, read_at=1000.0)
    assert turn(merged, "batch", oldest_wait_s=5.0, now=1000.0) == 0
    assert turn(merged, "batch", oldest_wait_s=2.0, now=1000.0) == 4  # r2's four
    assert turn(merged, "batch", oldest_wait_s=1.0, now=1000.0) == 5
    assert turn(merged, "batch", oldest_wait_s=2.0, now=1001.0) == 5  # both aged a second
    assert turn(merged, "interactive", oldest_wait_s=0.0, now=1000.0) == 0


def test_two_fresh_flows_at_one_counter_take_turns_by_age() -> None:
    """Every replica starts with every flow fresh at counter 0: if each took the other to be
    owed less, both would fill the room a scrape shows (the tie goes to neither)."""
    heavy_a = PeerBand(5, 1.0, 0.0, "heavy-a", head_fresh=True)
    merged = PeerView.merge([ReplicaReport("r2", waiting={"batch": heavy_a})], read_at=1000.0)
    heavy_d = Head("heavy-d", counter=0.0, next_cost=50.0, fresh=True)
    assert turn(merged, "batch", oldest_wait_s=0.5, now=1000.0, head=heavy_d) == 5  # older
    assert turn(merged, "batch", oldest_wait_s=2.0, now=1000.0, head=heavy_d) == 0
    served = PeerBand(5, 1.0, 0.0, "heavy-a")  # not fresh: a fresh flow at its counter wins
    merged = PeerView.merge([ReplicaReport("r2", waiting={"batch": served})], read_at=1000.0)
    assert turn(merged, "batch", oldest_wait_s=0.5, now=1000.0, head=heavy_d) == 0


def test_a_seat_every_replica_sees_goes_to_the_replica_whose_request_waited_longest() -> None:
    admission, pool, clock = make_admission(limit=3, tiers=(INTERACTIVE, API, SEATED))
    submit(admission, "busy", Request(SEATED))  # one seat of three
    leased = ReplicaReport("r2", {BACKEND: {2: 2}}, waiting={"batch": PeerBand(1, 0.3)})
    admission.apply_peers(PeerView.merge([leased], read_at=clock()))
    scraped(pool.backends[0], clock)
    submit(admission, "b1", Request(SEATED))
    submit(admission, "b2", Request(SEATED))  # both wait here, just arrived
    # r2's two requests finished: two seats every replica sees. r2's oldest request waited
    # 0.3 s, ours 0: one seat is r2's turn, the other ours.
    finished = ReplicaReport("r2", waiting={"batch": PeerBand(1, 0.3)})
    grants = admission.apply_peers(PeerView.merge([finished], read_at=clock()))
    assert [g.request_id for g in grants] == ["b1"]
    scraped(pool.backends[0], clock)  # (a seat-bound tier fills one free seat a scrape)
    assert admission.dispatch() == []  # the last free seat is r2's
    # A seat our own request frees is ours to refill at once: only we know of it yet.
    assert [g.request_id for g in admission.release("busy")] == ["b2"]


QUEUED = with_gate(API, Gate(max_waiting=2, max_kv_cache_usage=None))  # may queue 2 in vLLM


def test_room_a_queue_gate_leaves_after_a_scrape_goes_first_to_the_replicas_ahead() -> None:
    """A tier bound by its gate's engine queue and the cap, not by seats (api): every
    replica reads the same scrape, and each used to fill the engine's queue to the gate's
    bound, the fleet N times as fast as one process."""
    admission, pool, clock = make_admission(limit=16, tiers=(INTERACTIVE, QUEUED, BATCH))
    older = ReplicaReport("r2", waiting={"api": PeerBand(1, 0.5)})
    view = PeerView.merge([older], read_at=clock())
    admission.apply_peers(view)
    scraped(pool.backends[0], clock)  # an idle engine: its gate lets two through
    tickets = [submit(admission, f"a{i}", Request(QUEUED)) for i in range(3)]
    # one of the two is r2's (its request waited longer), the other ours
    assert [t.granted for t in tickets] == [True, False, False]
    clock.now += view.defer_s + 0.001  # r2 did not take it (its lease never came)
    assert [g.request_id for g in admission.dispatch()] == ["a1"]
    # alone, the gate's whole room is ours
    admission, pool, clock = make_admission(limit=16, tiers=(INTERACTIVE, QUEUED, BATCH))
    admission.apply_peers(PeerView.merge([ReplicaReport("r2")], read_at=clock()))
    scraped(pool.backends[0], clock)
    tickets = [submit(admission, f"a{i}", Request(QUEUED)) for i in range(3)]
    assert [t.granted for t in tickets] == [True, True, False]


def test_unseen_counts_the_replicas_whose_report_predates_our_request() -> None:
    merged = PeerView.merge(
        [ReplicaReport("r2", age_s=0.03), ReplicaReport("r3", age_s=0.005)], read_at=1000.0
    )
    # our request arrived 10 ms ago: r2 wrote 30 ms ago, before it; r3 5 ms ago, after
    assert merged.unseen(waited_s=0.01, now=1000.0) == 1
    assert merged.unseen(waited_s=0.01, now=1000.01) == 2  # 10 ms later, neither is newer
    assert merged.unseen(waited_s=1.0, now=1000.0) == 0
    assert PeerView().unseen(waited_s=0.0, now=1000.0) == 0  # alone


def test_replicas_that_see_demand_at_once_share_the_gates_room() -> None:
    """Demand that reaches every replica at once finds each with a view that shows nobody
    waiting: each took the whole room of the engines' queue gates (measured on
    ``power-user-x5`` with three replicas: 10 grants in the first 0.15 simulated seconds
    where one process made 4). Until a report written after our request arrived says what
    the others do, each is counted as doing what we do."""
    admission, pool, clock = make_admission(limit=16, tiers=(INTERACTIVE, QUEUED, BATCH))
    before = [ReplicaReport("r2", age_s=0.02), ReplicaReport("r3", age_s=0.02)]
    admission.apply_peers(PeerView.merge(before, read_at=clock()))
    scraped(pool.backends[0], clock)  # an idle engine: its gate lets two through
    tickets = [submit(admission, f"a{i}", Request(QUEUED)) for i in range(3)]
    assert [t.granted for t in tickets] == [True, False, False]
    clock.now += 0.02  # the next exchange: both wrote after our requests came, none waits
    after = [ReplicaReport("r2", age_s=0.005), ReplicaReport("r3", age_s=0.005)]
    grants = admission.apply_peers(PeerView.merge(after, read_at=clock()))
    assert [g.request_id for g in grants] == ["a1"]  # the gate's second place, ours after all


def test_without_a_seat_for_us_we_leave_it_to_the_replica_ahead() -> None:
    admission, _, clock = make_admission(limit=1, tiers=(INTERACTIVE, API, SEATED))
    ahead = ReplicaReport("r2", {BACKEND: {2: 1}}, waiting={"batch": PeerBand(1, 0.3)})
    admission.apply_peers(PeerView.merge([ahead], read_at=clock()))
    assert not submit(admission, "b1", Request(SEATED)).granted
    gone = ReplicaReport("r2", waiting={"batch": PeerBand(1, 0.3)})
    assert admission.apply_peers(PeerView.merge([gone], read_at=clock())) == []
    clock.now += 0.05  # both waited 50 ms more: r2's still longer, within the deferral
    assert admission.dispatch() == []
    clock.now += 0.01
    fresh = ReplicaReport("r2", waiting={"batch": PeerBand(1, 0.01)})  # r2's next is younger
    grants = admission.apply_peers(PeerView.merge([fresh], read_at=clock()))
    assert [g.request_id for g in grants] == ["b1"]


def test_a_seat_left_to_the_replica_ahead_is_taken_back_if_it_does_not_take_it() -> None:
    admission, _, clock = make_admission(limit=1, tiers=(INTERACTIVE, API, SEATED))
    ahead = ReplicaReport("r2", {BACKEND: {2: 1}}, waiting={"batch": PeerBand(1, 0.3)})
    admission.apply_peers(PeerView.merge([ahead], read_at=clock()))
    submit(admission, "b1", Request(SEATED))
    gone = ReplicaReport("r2", waiting={"batch": PeerBand(1, 0.3)})
    view_at = PeerView.merge([gone], read_at=clock())
    assert admission.apply_peers(view_at) == []  # r2's turn
    clock.now += view_at.defer_s + 0.001
    assert [g.request_id for g in admission.dispatch()] == ["b1"]


def test_turn_skips_replicas_whose_next_flow_ours_is_owed_clearly_more_than() -> None:
    """VTC orders a band's flows: older requests of a flow far ahead of ours in service do
    not go first (``owed_elsewhere`` makes that replica leave the seat to us)."""
    reports = (
        ReplicaReport("r2", waiting={"batch": PeerBand(4, 3.0, 900.0, "heavy")}),
        ReplicaReport("r3", waiting={"batch": PeerBand(1, 2.0, 120.0, "other")}),
        ReplicaReport("r4", waiting={"batch": PeerBand(1, 2.0, 900.0, "light")}),  # ours
    )
    merged = PeerView.merge(reports, read_at=1000.0)
    light = Head("light", counter=100.0, next_cost=50.0)
    # r2 is owed 800 less than us (more than our next charge): not ahead; r3 is within a
    # charge of us: ahead by age; r4 holds our own flow (counters in transit): ahead by age
    assert turn(merged, "batch", oldest_wait_s=0.0, now=1000.0, head=light) == 2  # r3, r4
    assert turn(merged, "batch", oldest_wait_s=0.0, now=1000.0) == 6  # without a head: by age


def test_a_replica_owed_clearly_more_takes_a_seat_others_wait_for_longer() -> None:
    admission, pool, clock = make_admission(limit=2, tiers=(INTERACTIVE, API, SEATED))
    admission.apply_peers(view_at(clock, ReplicaReport("r2", {BACKEND: {2: 2}})))
    scraped(pool.backends[0], clock)  # the engine has seen r2's two (else they may queue)
    submit(admission, "b0", Request(SEATED))
    submit(admission, "b1", Request(SEATED))
    one_left = admission.apply_peers(view_at(clock, ReplicaReport("r2", {BACKEND: {2: 1}})))
    assert [g.request_id for g in one_left] == ["b0"]  # acme served, b1 still waiting
    scraped(pool.backends[0], clock)  # (a seat-bound tier fills one free seat a scrape)
    head = admission.scheduler.head("batch")
    assert head is not None and not head.fresh
    # r2's request finished; r2 waits with an older request of a flow within a charge of
    # ours: its turn
    close = PeerBand(1, 0.3, head.counter + head.next_cost / 2, "heavy")
    close_view = view_at(clock, ReplicaReport("r2", waiting={"batch": close}))
    assert admission.apply_peers(close_view) == []
    # the same seat, r2's next flow far ahead of ours in service: ours, at once
    far = PeerBand(1, 0.3, head.counter + 50 * head.next_cost, "heavy")
    grants = admission.apply_peers(view_at(clock, ReplicaReport("r2", waiting={"batch": far})))
    assert [g.request_id for g in grants] == ["b1"]


def test_a_flow_not_served_since_it_arrived_wins_ties_across_replicas() -> None:
    """A light tenant's flow, just arrived on its replica, is lifted to the floor the others'
    counters give it: not service. One process would serve it at the next seat or the one
    after; across replicas the one-charge margin made it wait for its own replica's
    completions. Fresh, it goes first at an equal counter, and waits within a charge when
    it is not fresh any more."""
    admission, _, clock = make_admission(limit=1, tiers=(INTERACTIVE, API, SEATED))
    admission.apply_peers(view_at(clock, ReplicaReport("r2", {BACKEND: {2: 1}})))
    assert not submit(admission, "b1", Request(SEATED)).granted
    head = admission.scheduler.head("batch")
    assert head is not None and head.fresh and head.counter == 0.0
    # r2's request finished, r2 waits with older requests of a flow at our counter: ours
    level = PeerBand(1, 0.3, head.counter, "heavy")
    grants = admission.apply_peers(view_at(clock, ReplicaReport("r2", waiting={"batch": level})))
    assert [g.request_id for g in grants] == ["b1"]
    # the other side: r2's fresh flow at our counter is owed the seat our completion frees
    admission, pool, clock = make_admission(limit=1, tiers=(INTERACTIVE, API, SEATED))
    admission.apply_peers(view_at(clock, ReplicaReport("r2", {BACKEND: {2: 1}})))
    submit(admission, "b0", Request(SEATED))
    submit(admission, "b1", Request(SEATED))
    freed = admission.apply_peers(view_at(clock, ReplicaReport("r2")))
    assert [g.request_id for g in freed] == ["b0"]  # acme served, b1 still waiting
    scraped(pool.backends[0], clock)
    head = admission.scheduler.head("batch")
    assert head is not None and not head.fresh
    fresh = PeerBand(1, 0.0, head.counter, "light", head_fresh=True)
    admission.apply_peers(view_at(clock, ReplicaReport("r2", waiting={"batch": fresh})))
    assert admission.release("b0") == []  # left to r2's light flow
    stale = PeerBand(1, 0.0, head.counter, "light")  # served since: within a charge, ours
    grants = admission.apply_peers(view_at(clock, ReplicaReport("r2", waiting={"batch": stale})))
    assert [g.request_id for g in grants] == ["b1"]


def test_a_long_wait_elsewhere_does_not_overrule_vtc() -> None:
    """r2's queue waited 10 s, but its next flow has had far more service than ours: VTC
    puts ours first, and the wait rule does not send the seat the other way (both replicas
    then left every seat to each other)."""
    admission, _, _ = make_admission(limit=1)
    submit(admission, "busy", Request(API))
    submit(admission, "a1", Request(API))
    head = admission.scheduler.head("api")
    assert head is not None
    ahead = PeerBand(5, 10.0, head.counter + 10 * head.next_cost, "heavy")
    admission.apply_peers(view(ReplicaReport("r2", waiting={"api": ahead})))
    assert [g.request_id for g in admission.release("busy")] == ["a1"]
