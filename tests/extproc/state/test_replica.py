"""Replicas exchanging state through a real Redis (``redis-server``, from scripts/setup-tools).

Each test drives ``SharedState.exchange_once`` by hand, so what one replica sees of another
is decided by the exchanges, never by timing luck.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from extproc.core.admission import Admission
from extproc.fleet.vllm_metrics import EngineMetrics
from extproc.state.exchange import RedisExchange
from extproc.state.replica import SharedState
from tests.conftest import RedisServer
from tests.extproc.core.test_admission import submit
from tests.extproc.factories import API, BATCH, INTERACTIVE, TENANT, Request, make_admission

BACKEND = "127.0.0.1:9000"


class Replica:
    """One replica's admission and shared state, applying views as the service does."""

    def __init__(
        self, name: str, url: str, ttl_s: float = 2.0, period_s: float = 0.02, backends: int = 1
    ) -> None:
        self.admission: Admission
        self.admission, self.pool, self.clock = make_admission(limit=4, backends=backends)
        self.admission.scheduler.take_ledger()
        self.granted: list[str] = []

        def apply(view: object, charges: list[tuple[str, str, float]]) -> None:
            self.admission.charge_elsewhere(charges)
            self.granted += [g.request_id for g in self.admission.apply_peers(view)]  # type: ignore[arg-type]

        self.state = SharedState(
            self.admission,
            RedisExchange(url, name, ttl_s=ttl_s, timeout_s=0.2),
            apply,
            period_s=period_s,
            ttl_s=ttl_s,
        )

    async def exchange(self) -> bool:
        return await self.state.exchange_once()


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[tuple[Replica, Replica]]:
    pair = (Replica("r1", redis_server.url, ttl_s=0.5), Replica("r2", redis_server.url, ttl_s=0.5))
    yield pair
    for replica in pair:
        await replica.state.store.close()


@pytest.fixture
async def fleet_of_six(redis_server: RedisServer) -> AsyncIterator[tuple[Replica, Replica]]:
    """Two replicas over six engines: enough for each to scrape some of them."""
    pair = (
        Replica("s1", redis_server.url, backends=6),
        Replica("s2", redis_server.url, backends=6),
    )
    yield pair
    for replica in pair:
        await replica.state.store.close()


async def round_trip(*replicas: Replica) -> None:
    """Every replica exchanges twice: each has then read what the others wrote."""
    for _ in range(2):
        for replica in replicas:
            assert await replica.exchange()


async def test_each_replica_sees_the_others_leases(replicas: tuple[Replica, Replica]) -> None:
    r1, r2 = replicas
    for i in range(3):
        submit(r1.admission, f"a{i}", Request(API))
    await round_trip(r1, r2)
    assert r2.state.shared and r2.state.replicas_seen == 2
    backend = r2.admission.pool.backends[0]
    assert (backend.in_flight, backend.peer_in_flight) == (0, 3)
    assert [submit(r2.admission, f"b{i}", Request(API)).granted for i in range(2)] == [
        True,
        False,  # 3 leased by r1 + 1 here = the cap of 4
    ]


async def test_a_dead_replicas_leases_expire_within_their_ttl(
    replicas: tuple[Replica, Replica],
) -> None:
    r1, r2 = replicas
    for i in range(4):
        submit(r1.admission, f"a{i}", Request(API))
    await round_trip(r1, r2)
    assert not submit(r2.admission, "b0", Request(API)).granted
    started = time.monotonic()
    while r2.admission.pool.backends[0].peer_in_flight:  # r1 is "dead": it exchanges no more
        assert time.monotonic() - started < 0.5 + 0.5, "r1's leases outlived their TTL"
        await asyncio.sleep(0.02)
        assert await r2.exchange()
    assert r2.granted == ["b0"]
    assert r2.state.replicas_seen == 1


async def test_a_more_urgent_band_on_one_replica_holds_the_other(
    replicas: tuple[Replica, Replica],
) -> None:
    r1, r2 = replicas
    for i in range(4):
        submit(r1.admission, f"fill{i}", Request(API))  # every seat of the backend
    submit(r1.admission, "chat", Request(INTERACTIVE))  # waits on r1
    await round_trip(r1, r2)
    batch = submit(r2.admission, "batch", Request(BATCH))
    r1.admission.release("fill0")  # r1 grants its chat into the freed seat
    assert r1.admission.grant_of("chat") is not None
    await round_trip(r1, r2)
    assert not batch.granted  # every seat is taken again: chat went first
    r1.admission.release("fill1")
    await round_trip(r1, r2)
    assert r2.granted == ["batch"]


async def test_fairness_counts_service_on_every_replica(
    replicas: tuple[Replica, Replica],
) -> None:
    r1, r2 = replicas
    await round_trip(r1, r2)  # both have joined: charges from now on reach the other
    light = dataclasses.replace(TENANT, name="light")
    other = dataclasses.replace(TENANT, name="other")
    for i in range(4):
        submit(r2.admission, f"busy{i}", Request(API, tenant=other))  # r2's seats
    submit(r2.admission, "acme-x", Request(API))
    submit(r2.admission, "light-x", Request(API, tenant=light))  # both wait on r2
    for i in range(4):
        submit(r1.admission, f"acme{i}", Request(API, prompt_tokens=2000))  # served on r1
    for i in range(4):
        r1.admission.release(f"acme{i}")
    await round_trip(r1, r2)  # r2 learns what acme was served on r1
    assert r2.state.stats.charges_applied >= 1
    assert [g.request_id for g in r2.admission.release("busy0")] == ["light-x"]


async def test_redis_lost_cuts_off_then_the_replica_rejoins_by_itself(
    redis_server: RedisServer, replicas: tuple[Replica, Replica]
) -> None:
    r1, r2 = replicas
    await round_trip(r1, r2)
    assert r1.admission.backend_limit == 4
    redis_server.stop()
    started = time.monotonic()
    while not r1.state.cut_off:
        assert time.monotonic() - started < 2.0, "never cut off"
        assert not await r1.exchange()
        await asyncio.sleep(0.02)
    assert not r1.state.shared and r1.state.stats.cut_offs == 1
    assert all(b.scrape_here for b in r1.pool.backends)  # alone: scrapes every engine
    assert r1.admission.backend_limit == 2  # alone on 1/2 of each backend: 2 replicas seen
    submit(r1.admission, "during", Request(API))  # requests keep flowing meanwhile
    assert r1.admission.grant_of("during") is not None
    redis_server.start()  # empty: nothing survived
    await round_trip(r1, r2)
    assert r1.state.shared and not r1.state.cut_off
    assert r1.admission.backend_limit == 4
    assert r2.admission.pool.backends[0].peer_in_flight == 1  # rebuilt from r1's report


async def test_each_engine_is_scraped_by_one_replica_and_adopted_by_the_others(
    fleet_of_six: tuple[Replica, Replica],
) -> None:
    r1, r2 = fleet_of_six
    await round_trip(r1, r2)
    for b1, b2 in zip(r1.pool.backends, r2.pool.backends, strict=True):
        assert [b1.scrape_here, b2.scrape_here].count(True) == 1, b1.address
    assert r1.state._scraping and r2.state._scraping  # six engines: both scrape some
    # r1 scrapes one of its engines (as its poller would); r2 adopts what r1 read.
    scraper, reader = r1.pool.backends[0], r2.pool.backends[0]
    if not scraper.scrape_here:
        scraper, reader = r2.pool.backends[0], r1.pool.backends[0]
    owner = r1 if scraper in r1.pool.backends else r2
    other = r2 if owner is r1 else r1
    # The scrape is 0.2 s old when r1 reports it; the reader granted after its last
    # mark, so the scrape (taken before that) cannot have seen the grant.
    owner.clock.now += 0.1
    scraper.record_scrape(EngineMetrics(2, 3, 0.4, 0.5, 50, owner.clock.now), 0)
    owner.clock.now += 0.2
    other.clock.now += 0.3
    await other.exchange()
    reader.note_grant()
    await round_trip(owner, other)
    metrics = reader.metrics
    assert metrics is not None and (metrics.waiting, metrics.running) == (2, 3)
    assert metrics.scraped_at == pytest.approx(other.clock.now - 0.2, abs=0.01)
    assert reader.granted_since_scrape == 1 and not reader.scrape_here
    # The scraper's scrapes stop coming (hung): past the takeover age the reader scrapes.
    other.clock.now += 1.0
    await other.exchange()
    assert reader.scrape_here


async def test_while_redis_is_unreachable_late_scrapes_are_taken_over_before_any_cut_off(
    redis_server: RedisServer, fleet_of_six: tuple[Replica, Replica]
) -> None:
    r1, r2 = fleet_of_six
    await round_trip(r1, r2)
    assert not all(b.scrape_here for b in r1.pool.backends)
    redis_server.stop()
    assert not await r1.exchange()
    assert not r1.state.cut_off and not all(b.scrape_here for b in r1.pool.backends)
    r1.clock.now += 1.0  # the scraper's scrapes stopped coming with the exchanges
    assert not await r1.exchange()
    assert not r1.state.cut_off  # still within the grace: the last view holds
    assert all(b.scrape_here for b in r1.pool.backends)


async def test_a_second_process_with_the_same_replica_id_is_refused_until_the_first_is_gone(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    first = Replica("twin", redis_server.url, ttl_s=0.5)
    second = Replica("twin", redis_server.url, ttl_s=0.5)
    try:
        assert await first.exchange()
        assert not await second.exchange()  # would overwrite the first's leases
        assert not await second.exchange()
        assert [r.message for r in caplog.records].count(
            "replica twin: replica id 'twin' is in use by another live process (instance "
            f"{first.state.store.instance}); give every replica its own --replica-id; not "
            "sharing state until it does"
        ) == 1
        assert await first.exchange()  # the first is untouched
        await first.state.store.close()  # the first dies: its report expires with its TTL
        await wait_for_async(second.exchange, timeout_s=2.0)
        assert second.state.shared
    finally:
        await second.state.store.close()


async def wait_for_async(attempt: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    started = time.monotonic()
    while not await attempt():
        assert time.monotonic() - started < timeout_s, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_an_unexpected_error_does_not_end_the_exchange_loop(
    redis_server: RedisServer,
) -> None:
    replica = Replica("r1", redis_server.url)
    calls = 0

    def apply_failing_once(view: object, charges: list[tuple[str, str, float]]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in applying a view")

    replica.state.apply = apply_failing_once
    loop = asyncio.create_task(replica.state.run())
    try:
        await wait_for(lambda: calls >= 3, timeout_s=2.0)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    assert replica.state.stats.failures >= 1 and replica.state.shared


async def wait_for(condition: Callable[[], bool], timeout_s: float) -> None:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "condition not met in time"
        await asyncio.sleep(0.01)
