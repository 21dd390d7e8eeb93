"""Admission without sockets: the fair scheduler, gates, reservations and releases together."""

import dataclasses
import random
from dataclasses import dataclass

import pytest

from extproc.core.admission import Admission, Grant
from extproc.core.errors import Rejection
from extproc.core.prefix import PromptBlocks
from extproc.core.reservations import seats_for
from extproc.fleet.backend import Backend, BackendPool, BackendSpec
from extproc.fleet.vllm_metrics import EngineMetrics
from extproc.policy import Tier
from extproc.policy.model import Gate
from tests.extproc.factories import (
    API,
    BATCH,
    INTERACTIVE,
    TENANT,
    FakeClock,
    Request,
    make_admission,
    policy,
    scraped,
    with_gate,
)
from tests.extproc.factories import (
    OPEN as OPEN_GATE,
)


@dataclass(frozen=True)
class Ticket:
    """A submitted request as a test follows it: granted while admission has it in flight."""

    admission: Admission
    request_id: str

    @property
    def granted(self) -> bool:
        return self.admission.grant_of(self.request_id) is not None

    def granted_now(self) -> Grant:
        grant = self.admission.grant_of(self.request_id)
        assert grant is not None, f"{self.request_id} is not in flight"
        return grant


def submit(admission: Admission, request_id: str, request: Request) -> Ticket:
    admission.submit(request_id, request)  # type: ignore[arg-type]
    return Ticket(admission, request_id)


def test_granted_at_once_when_a_backend_has_room() -> None:
    admission, pool, _ = make_admission(limit=2)
    ticket = submit(admission, "r1", Request(API))
    assert ticket.granted
    grant = ticket.granted_now()
    assert grant.endpoints == ("127.0.0.1:9000",)
    assert grant.priority == API.priority
    assert pool.backends[0].in_flight == 1


def test_held_requests_are_released_most_urgent_tier_first() -> None:
    admission, _, _ = make_admission(limit=1)
    submit(admission, "running", Request(BATCH))
    batch = submit(admission, "batch", Request(BATCH))
    interactive = submit(admission, "chat", Request(INTERACTIVE))
    assert not batch.granted and not interactive.granted
    admission.release("running")
    assert interactive.granted and not batch.granted
    admission.release("chat")
    assert batch.granted


def test_aging_lets_a_long_waiting_batch_request_overtake() -> None:
    aging_batch = Tier(
        "batch",
        rank=2,
        priority=20,
        queue_limit=4,
        queue_deadline_s=600,
        aging_rate=0.1,
        aging_cap=2,
        gate=BATCH.gate,
    )
    admission, pool, clock = make_admission(limit=1, tiers=(INTERACTIVE, API, aging_batch))
    submit(admission, "running", Request(API))
    old_batch = submit(admission, "old-batch", Request(aging_batch))
    clock.now += 30  # 3 ranks of aging, capped at 2: batch now ranks with interactive
    scraped(pool.backends[0], clock)
    fresh_api = submit(admission, "fresh-api", Request(API))
    admission.release("running")
    assert old_batch.granted and not fresh_api.granted


def test_vtc_alternates_backlogged_tenants_by_tokens_not_arrival() -> None:
    admission, _, _ = make_admission(limit=1)
    other = type(TENANT)("other", api_keys=("sk-o",), tiers=("api",), default_tier="api")
    submit(admission, "running", Request(API))
    hog = [submit(admission, f"hog{i}", Request(API)) for i in range(3)]
    small = submit(admission, "small", Request(API, tenant=other))
    admission.release("running")
    assert hog[0].granted  # first come
    admission.release("hog0")
    assert small.granted and not hog[1].granted  # the other tenant is served next


def test_continuous_priority_counts_the_users_pending_requests() -> None:
    admission, _, _ = make_admission(limit=10)
    priorities = [
        submit(admission, f"a{i}", Request(API, user="power")).granted_now().priority
        for i in range(4)
    ]
    other = submit(admission, "b", Request(API, user="casual")).granted_now().priority
    assert priorities == [10, 11, 12, 13]
    assert other == 10
    admission.release("a0")
    assert submit(admission, "a4", Request(API, user="power")).granted_now().priority == 13


def test_a_users_next_request_does_not_overtake_its_own_earlier_ones() -> None:
    # vLLM runs lower numbers first and never ages a waiting request: ranked by the count in
    # flight alone, a4 would go at 11 ahead of a3 (13), which may still wait in the engine.
    admission, _, _ = make_admission(limit=10)
    for i in range(4):
        submit(admission, f"a{i}", Request(API, user="power"))
    for i in range(3):
        admission.release(f"a{i}")
    assert submit(admission, "a4", Request(API, user="power")).granted_now().priority == 13
    assert submit(admission, "b", Request(API, user="casual")).granted_now().priority == 10


def test_full_queue_is_a_429_with_retry_after() -> None:
    admission, _, _ = make_admission(limit=1)
    submit(admission, "running", Request(API))
    for i in range(API.queue_limit):
        submit(admission, f"q{i}", Request(API))
    with pytest.raises(Rejection) as info:
        submit(admission, "one-too-many", Request(API))
    assert info.value.status == 429 and info.value.code == "queue_full"
    assert int(info.value.headers["retry-after"]) >= 1


def test_early_shedding_rises_with_queue_fill() -> None:
    shedding = Tier(
        "batch",
        rank=2,
        priority=20,
        queue_limit=10,
        queue_deadline_s=600,
        early_shed_from=0.5,
        gate=BATCH.gate,
    )
    admission, _, _ = make_admission(limit=1, tiers=(INTERACTIVE, API, shedding))
    admission._rng = random.Random(7)
    submit(admission, "running", Request(shedding))
    for i in range(5):  # up to half full: never shed
        submit(admission, f"q{i}", Request(shedding))
    shed_at_depth = []
    queued = 0
    for i in range(5, 40):
        depth = admission.scheduler.depth("batch")
        try:
            submit(admission, f"q{i}", Request(shedding))
            queued += 1
        except Rejection as rejection:
            assert rejection.status == 429
            if rejection.code == "early_shed":
                shed_at_depth.append(depth)
    assert queued >= 1  # past half full some still get in...
    assert shed_at_depth and min(shed_at_depth) >= 5  # ...and shedding starts at half full
    assert any(depth < 10 for depth in shed_at_depth)  # before the queue is full


def test_abandoning_a_granted_waiter_gives_its_slot_back() -> None:
    admission, pool, _ = make_admission(limit=1)
    submit(admission, "running", Request(API))
    ticket = submit(admission, "racy", Request(API))
    admission.release("running")  # grants "racy"...
    assert ticket.granted
    admission.abandon("racy")  # ...but its client left before it was forwarded
    assert admission.in_flight == 0 and pool.backends[0].in_flight == 0


def test_gate_holds_requests_while_the_engine_queue_is_long() -> None:
    short_queue = with_gate(INTERACTIVE, Gate(max_waiting=3))
    admission, pool, clock = make_admission(limit=100, tiers=(short_queue, API, BATCH))
    backend = pool.backends[0]
    scraped(backend, clock, waiting=3)
    ticket = submit(admission, "chat", Request(short_queue))
    assert not ticket.granted
    scraped(backend, clock, waiting=1)
    admission.dispatch()
    assert ticket.granted


def test_a_light_user_passes_a_power_users_queue_in_the_engine() -> None:
    """A power user has four api requests on a 2-seat engine, two of them waiting there
    (the api gate's bound). A light user's first request goes at once: vLLM seats it
    before the power user's queued ones (a lower continuous priority), so holding it
    here would only add a completion's wait. The power user's fifth waits here."""
    api = with_gate(API, Gate(max_waiting=2))
    admission, pool, clock = make_admission(limit=100, seats=2, tiers=(INTERACTIVE, api, BATCH))
    backend = pool.backends[0]
    heavy = []
    for i in range(4):
        heavy.append(submit(admission, f"p{i}", Request(api, user="power")))
        scraped(backend, clock, waiting=max(0, i - 1))  # two seated, then two waiting
    assert [t.granted_now().priority for t in heavy] == [10, 11, 12, 13]
    other = dataclasses.replace(TENANT, name="light")  # its own flow in the fair queue
    light = submit(admission, "light", Request(api, user="light", tenant=other))
    assert light.granted and light.granted_now().priority == 10
    fifth = submit(admission, "p4", Request(api, user="power"))
    assert not fifth.granted


def test_batch_waits_for_an_empty_engine_queue_while_interactive_goes() -> None:
    interactive = with_gate(INTERACTIVE, Gate(max_waiting=3))
    batch = with_gate(BATCH, Gate(max_waiting=0))
    admission, pool, clock = make_admission(limit=100, tiers=(interactive, API, batch))
    scraped(pool.backends[0], clock, waiting=1)
    batch_ticket = submit(admission, "batch", Request(batch))
    chat_ticket = submit(admission, "chat", Request(interactive))
    assert chat_ticket.granted and not batch_ticket.granted


def test_stale_metrics_count_as_saturated() -> None:
    admission, pool, clock = make_admission(limit=4)
    clock.now += admission.policy.backpressure.stale_after_s + 0.1
    ticket = submit(admission, "r", Request(API))
    assert not ticket.granted
    scraped(pool.backends[0], clock)
    admission.dispatch()
    assert ticket.granted


def test_reserved_share_keeps_slots_from_lower_tiers_only_while_active() -> None:
    reserving = Tier("interactive", 0, 0, 10, 5.0, reserved_share=0.5, gate=INTERACTIVE.gate)
    admission, _, _ = make_admission(limit=2, backends=2, tiers=(reserving, API, BATCH))
    # interactive idle: batch may fill all 4 slots (work-conserving)
    granted = [submit(admission, f"b{i}", Request(BATCH)).granted for i in range(4)]
    assert granted == [True, True, True, True]
    for i in range(4):
        admission.release(f"b{i}")
    # interactive active with one request in flight: sized to that (Poisson(1): 3 seats),
    # capped at half the fleet, it holds 2 seats, one of them its request's
    submit(admission, "chat", Request(reserving))
    batch = [submit(admission, f"c{i}", Request(BATCH)) for i in range(4)]
    assert [t.granted for t in batch] == [True, True, False, False]
    admission.release("chat")  # chat is still active (it arrived lately): one seat stays
    assert [t.granted for t in batch] == [True, True, True, False]
    assert submit(admission, "chat2", Request(reserving)).granted


def test_the_reserve_grows_with_the_tiers_demand_up_to_its_share() -> None:
    reserving = Tier("interactive", 0, 0, 10, 5.0, reserved_share=0.5, gate=INTERACTIVE.gate)
    admission, pool, clock = make_admission(limit=4, backends=2, tiers=(reserving, API, BATCH))
    assert admission.reserved() == {0: 1}
    for i in range(2):
        submit(admission, f"chat{i}", Request(reserving))
    clock.now += 60  # two chats held for many averaging windows (reserved_idle_s 10 s)
    for backend in pool.backends:
        scraped(backend, clock)
    assert admission.reserved() == {0: min(4, seats_for(2.0))}  # 5 wanted, 50% of 8 = 4
    batch = [submit(admission, f"b{i}", Request(BATCH)) for i in range(6)]
    assert sum(t.granted for t in batch) == 8 - 4  # two more seats kept free for chat


def test_completion_refunds_an_overestimated_output_charge() -> None:
    """acme asks max_tokens 1000 but gets 10: the refund lets its next request go before
    the other tenant's second one (without it, acme would owe 2000 tokens)."""
    admission, _, _ = make_admission(limit=1)
    other = type(TENANT)("other", api_keys=("sk-o",), tiers=("api",), default_tier="api")
    submit(admission, "x", Request(API, tenant=other))
    submit(admission, "a0", Request(API, max_tokens=1000))
    submit(admission, "b0", Request(API, tenant=other))
    a1 = submit(admission, "a1", Request(API))
    b1 = submit(admission, "b1", Request(API, tenant=other))
    admission.release("x", output_tokens=50)  # a0 goes (earliest head on a tie)
    admission.release("a0", output_tokens=10)  # b0 goes; acme is refunded 2 x 990
    admission.release("b0", output_tokens=50)
    assert a1.granted and not b1.granted


def test_unhealthy_backend_holds_requests_until_it_recovers() -> None:
    admission, pool, _ = make_admission(limit=4)
    pool.backends[0].healthy = False
    ticket = submit(admission, "r", Request(API))
    assert not ticket.granted
    pool.backends[0].healthy = True
    admission.dispatch()
    assert ticket.granted


def test_lost_completion_is_reclaimed_after_the_timeout() -> None:
    admission, _, clock = make_admission(limit=1)
    submit(admission, "lost", Request(API))
    waiting = submit(admission, "next", Request(API))
    clock.now += 100
    assert admission.expire(max_age_s=300) == [] and admission.knows("lost")
    clock.now += 300
    scraped(admission.pool.backends[0], clock)
    assert [g.request_id for g in admission.expire(max_age_s=300)] == ["next"]
    assert waiting.granted and not admission.knows("lost")
    assert not admission.release("lost")


def test_reload_keeps_queued_requests_and_applies_new_limits() -> None:
    admission, _, _ = make_admission(limit=1, seats=2)
    submit(admission, "running", Request(API))
    queued = submit(admission, "queued", Request(API))
    assert not queued.granted  # the engine has a second seat, the policy's cap says 1
    from tests.extproc.factories import policy

    admission.configure(policy(limit=2))
    assert queued.granted  # the new per-backend limit let it go


def test_knows_queued_and_in_flight_ids() -> None:
    admission, _, _ = make_admission(limit=1)
    submit(admission, "a", Request(API))
    submit(admission, "b", Request(API))
    assert admission.knows("a") and admission.knows("b") and not admission.knows("c")


def test_a_completion_frees_an_empty_queue_seat_before_the_next_scrape() -> None:
    batch = with_gate(BATCH, Gate(max_waiting=0))
    admission, pool, _ = make_admission(limit=100, seats=8, tiers=(INTERACTIVE, API, batch))
    first = submit(admission, "b0", Request(batch))
    second = submit(admission, "b1", Request(batch))
    assert first.granted and not second.granted  # b0 may be waiting in the engine
    admission.release("b0", output_tokens=10)  # it finished: a seat is free, no scrape needed
    assert second.granted
    assert pool.backends[0].effective_waiting() == 1


def test_a_big_engine_fills_free_seats_several_grants_a_scrape() -> None:
    """One grant a scrape would take a 256-seat engine 26 s to fill after a lull; one per
    16 seats fills it in 16 scrapes, and a small engine still gets one a scrape."""
    batch = dataclasses.replace(
        with_gate(BATCH, Gate(max_waiting=0, max_kv_cache_usage=None)), queue_limit=100
    )
    for seats, per_scrape in ((8, 1), (16, 1), (32, 2), (256, 16)):
        admission, pool, clock = make_admission(
            limit=4096, seats=seats, tiers=(INTERACTIVE, API, batch)
        )
        tickets = [submit(admission, f"b{i}", Request(batch)) for i in range(40)]
        assert sum(t.granted for t in tickets) == per_scrape, seats
        scraped(pool.backends[0], clock, waiting=1)  # the engine queues: nothing more goes
        admission.dispatch()
        assert sum(t.granted for t in tickets) == per_scrape, seats


def test_an_aged_band_is_gated_and_prioritised_as_the_tier_it_reached() -> None:
    batch = Tier(
        "batch",
        rank=2,
        priority=20,
        queue_limit=4,
        queue_deadline_s=600,
        aging_rate=0.1,
        aging_cap=1,
        gate=Gate(max_waiting=0),
    )
    api = with_gate(API, Gate(max_waiting=3))
    admission, pool, clock = make_admission(limit=100, tiers=(INTERACTIVE, api, batch))
    scraped(pool.backends[0], clock, waiting=1)  # never empty: batch's own gate stays shut
    ticket = submit(admission, "old", Request(batch))
    assert not ticket.granted
    clock.now += 5  # half a rank: not yet api
    scraped(pool.backends[0], clock, waiting=1)
    admission.dispatch()
    assert not ticket.granted
    clock.now += 6  # a whole rank: it now ranks, and is gated, as api
    scraped(pool.backends[0], clock, waiting=1)
    admission.dispatch()
    assert ticket.granted
    assert ticket.granted_now().priority == api.priority


def test_a_reservation_lingers_after_the_tiers_last_request() -> None:
    reserving = Tier(
        "interactive", 0, 0, 10, 5.0, reserved_share=0.5, reserved_idle_s=10, gate=INTERACTIVE.gate
    )
    admission, pool, clock = make_admission(limit=2, backends=2, tiers=(reserving, API, BATCH))
    submit(admission, "chat", Request(reserving))
    admission.release("chat", output_tokens=5)  # chat is idle again, but only just
    batch = [submit(admission, f"b{i}", Request(BATCH)) for i in range(4)]
    assert [t.granted for t in batch] == [True, True, True, False]  # one seat kept for chat
    clock.now += 11  # no chat for longer than reserved_idle_s: batch may have it all
    for backend in pool.backends:
        scraped(backend, clock)
    admission.dispatch()
    assert [t.granted for t in batch] == [True, True, True, True]


SYSTEM = "You are a meticulous travel planner; list options with prices and times. " * 30


def test_each_granted_request_picks_its_backend_by_its_own_prompt() -> None:
    admission, pool, _ = make_admission(limit=1, backends=2)
    first, second = pool.backends
    submit(admission, "other", Request(API, prompt_text="unrelated " * 100))
    submit(admission, "trip", Request(API, prompt_text=SYSTEM + "Lisbon in May?"))
    assert admission.backend_of("trip") is second  # the free one
    # The grant recorded the prompt's blocks as held there.
    assert second.prefix_cache.match(PromptBlocks(SYSTEM, "").blocks(16)) > 0
    assert first.prefix_cache.match(PromptBlocks(SYSTEM, "").blocks(16)) == 0
    # Both full: requests queue. Band-level eligibility still decides *whether* one goes;
    # the backend is chosen for the popped request among the candidates there are then.
    follow_up = submit(admission, "trip-2", Request(API, prompt_text=SYSTEM + "And Porto?"))
    fresh = submit(admission, "fresh", Request(API, prompt_text="a new topic " * 100))
    assert not follow_up.granted and not fresh.granted
    admission.release("other")
    assert admission.backend_of("trip-2") is first  # the only candidate: no waiting for 2nd
    admission.release("trip")
    assert admission.backend_of("fresh") is second
    assert admission.picks[(first.address, "load")] == 1  # "other": both free, by load
    assert admission.picks[(second.address, "only")] == 2  # "trip" and "fresh"
    assert admission.picks[(first.address, "only")] == 1  # "trip-2"
    admission.release("trip-2")
    admission.release("fresh")
    again = submit(admission, "trip-3", Request(API, prompt_text=SYSTEM + "Faro?"))
    assert again.granted and admission.backend_of("trip-3") is first  # both hold it; tie
    assert admission.picks[(first.address, "prefix")] == 1


def test_unhealthy_backends_are_not_candidates_even_for_a_removed_tier() -> None:
    admission, pool, _ = make_admission(limit=2, backends=2)
    pool.backends[0].healthy = False
    assert admission._place(API.name) is not None
    assert admission._place(API.name).backends == [pool.backends[1]]  # type: ignore[union-attr]
    pool.backends[1].healthy = False
    assert admission._place("gone") is None  # no tier: no gate, but health still counts


def test_beyond_the_seats_only_a_tier_nobody_reserves_against_queues_in_the_engine() -> None:
    """Batch never queues inside vLLM; a tier no active urgent tier reserves seats against
    may, as deep as its gate says (the engine's seats stay busy across a grant's round
    trip); under an active reserve, a less urgent tier waits here."""
    batch = with_gate(BATCH, Gate(max_waiting=0, max_kv_cache_usage=None))
    chat = with_gate(INTERACTIVE, Gate(max_waiting=2, max_kv_cache_usage=None))
    api = with_gate(API, Gate(max_waiting=2, max_kv_cache_usage=None))
    admission, pool, clock = make_admission(limit=100, seats=2, tiers=(chat, api, batch))
    tickets = [submit(admission, f"b{i}", Request(batch)) for i in range(3)]
    assert [t.granted for t in tickets] == [True, False, False]  # one batch grant a scrape
    engine = EngineMetrics(0, 1, 0.1, 0.0, 0.0, clock())
    pool.backends[0].record_scrape(engine, granted_before=1)  # b0 seen running
    admission.dispatch()
    assert [t.granted for t in tickets] == [True, True, False]  # two seats, no queueing
    chats = [submit(admission, f"c{i}", Request(chat)) for i in range(4)]
    # bound by its gate alone: two waiting ahead of it (the batch grant since the scrape
    # does not count: chat passes batch in vLLM's priority queue)
    assert [t.granted for t in chats] == [True, True, True, False]
    reserving = dataclasses.replace(chat, reserved_share=0.5)
    admission, pool, _ = make_admission(limit=100, seats=2, tiers=(reserving, api, batch))
    submit(admission, "chat", Request(reserving))
    assert submit(admission, "a0", Request(api)).granted  # the seat chat does not need
    assert not submit(admission, "a1", Request(api)).granted  # no queueing under a reserve


def test_a_free_seat_beats_a_better_score_on_a_full_engine() -> None:
    chat = with_gate(INTERACTIVE, Gate(max_waiting=3, max_kv_cache_usage=None))
    chat = dataclasses.replace(chat, reserved_share=0.5)  # a tier that keeps seats
    admission, pool, _ = make_admission(limit=100, seats=1, backends=2, tiers=(chat, API, BATCH))
    full, free = pool.backends
    submit(admission, "running", Request(chat, prompt_text="hello " * 50))
    assert admission.backend_of("running") is full  # the local tie-break
    # The follow-up's prefix is on the full engine, which alone would keep it there; but
    # it would wait for the running request to finish, so it goes where a seat is free.
    submit(admission, "follow-up", Request(chat, prompt_text="hello " * 50 + "and then?"))
    assert admission.backend_of("follow-up") is free


def test_a_reserve_cannot_stop_the_probing_of_an_engine_whose_seats_are_unknown() -> None:
    """An engine never caught running plans with one seat (the fallback); chat's reserve
    is at least one seat: counted against that guess it left batch nothing, and the
    engine, idle, never showed its real size (a deadlock, seen on the real vLLM)."""
    clock = FakeClock()
    pool = BackendPool([BackendSpec("127.0.0.1", 9000, "r")], clock=clock)  # nothing declared
    backend = pool.backends[0]
    scraped(backend, clock)
    chat = dataclasses.replace(INTERACTIVE, reserved_share=0.25)
    admission = Admission(pool, policy(100, (chat, API, BATCH)))
    assert (backend.seats.source, backend.seats.count) == ("fallback", 1)
    admission.submit("chat", Request(chat))  # type: ignore[arg-type]
    admission.release("chat")  # chat is active: it keeps its reserve
    assert [g.request_id for g in admission.submit("b", Request(BATCH))] == ["b"]  # type: ignore[arg-type]


def _sized(backend: Backend, clock: FakeClock, kv: float) -> None:
    """A fresh scrape of an engine whose KV cache holds 1,600 tokens, ``kv`` of it used."""
    metrics = EngineMetrics(0, 0, kv, 0.0, 0.0, clock(), block_size=16, num_gpu_blocks=100)
    backend.record_scrape(
        metrics,
        granted_before=backend.granted_since_scrape,
        kv_tokens_before=backend.kv_tokens_since_scrape,
    )


def test_batch_leaves_kv_for_chat_by_what_it_will_hold_at_its_end() -> None:
    """A batch request's cache grows as it generates; checked against the cache now, batch
    would fill the headroom its KV bound leaves for chat. While chat is active, batch is
    admitted by what the requests in flight will hold at their end; when chat has gone
    quiet, by the cache now (work-conserving)."""
    chat = Tier(
        "interactive", 0, 0, 10, 5.0, reserved_share=0.5, reserved_idle_s=10.0, gate=OPEN_GATE
    )
    batch = with_gate(BATCH, Gate(max_waiting=None, max_kv_cache_usage=0.5))
    admission, pool, clock = make_admission(limit=8, tiers=(chat, API, batch))
    backend = pool.backends[0]
    _sized(backend, clock, kv=0.0)
    assert submit(admission, "chat", Request(chat, prompt_tokens=100, max_tokens=10)).granted
    flood = [
        submit(admission, f"b{i}", Request(batch, prompt_tokens=100, max_tokens=300))
        for i in range(3)
    ]
    assert [t.granted for t in flood] == [True, True, False]  # 910 of 1,600 tokens at the end
    _sized(backend, clock, kv=0.15)  # the prompts are in: 15 % used now, 57 % at the end
    admission.dispatch()
    assert not flood[2].granted
    admission.release("chat", output_tokens=10)
    clock.now += 11  # chat quiet for longer than it keeps its reserve
    _sized(backend, clock, kv=0.15)
    admission.dispatch()
    assert flood[2].granted


def test_a_bands_output_estimate_follows_what_its_requests_generate() -> None:
    """Clients ask for more ``max_tokens`` than they use: the KV a request commits follows
    the share of its estimate that its band's requests really generated."""
    admission, pool, _ = make_admission(limit=1)
    backend = pool.backends[0]
    asked = Request(BATCH, prompt_tokens=100, max_tokens=300)
    submit(admission, "first", asked)
    assert backend.kv_committed_tokens == 400  # nothing learned: all 300
    admission.release("first", output_tokens=30)
    for i in range(40):
        submit(admission, f"r{i}", asked)
        admission.release(f"r{i}", output_tokens=30)
    assert backend.kv_committed_tokens == 0
    submit(admission, "last", asked)
    assert 100 + 30 < backend.kv_committed_tokens < 100 + 60


def test_a_freed_engine_takes_the_queued_request_whose_prefix_it_holds() -> None:
    """On a full fleet room appears one engine at a time: of the flow's oldest queued
    requests, the one whose conversation that engine holds goes there (same tenant, so
    fairness between flows is untouched); with the lookahead off, arrival order decides."""
    for lookahead, expected in ((8, ("first", "second")), (0, ("second", "first"))):
        routing = dataclasses.replace(policy().routing, prefix_lookahead=lookahead)
        admission, pool, _ = make_admission(limit=1, backends=2, routing=routing)
        first, second = pool.backends
        submit(admission, "x", Request(API, prompt_text=SYSTEM + "Lisbon in May?"))
        submit(admission, "y", Request(API, prompt_text="another system prompt " * 40))
        assert (admission.backend_of("x"), admission.backend_of("y")) == (first, second)
        y_turn = submit(
            admission, "y-2", Request(API, prompt_text="another system prompt " * 40 + "?")
        )
        x_turn = submit(admission, "x-2", Request(API, prompt_text=SYSTEM + "And Porto?"))
        admission.release("x")  # the first engine frees
        assert x_turn.granted is (lookahead > 1) and y_turn.granted is not (lookahead > 1)
        admission.release("y")
        backends = {"first": first, "second": second}
        assert admission.backend_of("x-2") is backends[expected[0]]
        assert admission.backend_of("y-2") is backends[expected[1]]
