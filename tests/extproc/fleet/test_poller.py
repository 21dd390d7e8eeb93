"""The poller against real HTTP servers on loopback: health, scrapes, timeouts."""

import asyncio
import logging
from collections.abc import Callable, Iterator

import aiohttp
import pytest
from aiohttp import web

from extproc.core.gates import passes
from extproc.fleet.backend import Backend, BackendPool, BackendSpec
from extproc.fleet.poller import Poller
from extproc.ops.processes import free_port
from extproc.policy.model import Gate
from loadtests.sim.server import SimConfig
from loadtests.sim.server import start as start_sim
from tests.polling import until


async def test_health_polling_marks_a_dead_backend_down_and_a_live_one_up() -> None:
    app = web.Application()

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    live_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", live_port).start()
    dead_port = free_port()  # nothing listens here
    pool = BackendPool([BackendSpec("127.0.0.1", live_port), BackendSpec("127.0.0.1", dead_port)])
    live, dead = pool.backends
    live.healthy = False
    recovered: list[bool] = []
    poller = Poller(pool, on_change=lambda: recovered.append(True))
    task = asyncio.create_task(poller.watch_health(interval_s=0.05, timeout_s=0.5))
    try:
        for _ in range(100):
            if live.healthy and not dead.healthy:
                break
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await runner.cleanup()
    assert live.healthy and not dead.healthy
    assert recovered


METRICS_PAGE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.5
vllm:inter_token_latency_seconds_count{{engine="0",model_name="m"}} {count}
vllm:inter_token_latency_seconds_sum{{engine="0",model_name="m"}} {itl_sum}
"""


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def _until(condition: Callable[[], object], timeout_s: float = 5.0) -> None:
    await until(condition, "the backend's state", timeout_s)


class Walked(list[Backend]):
    """A pool's backends that count how often they were walked: the poller walks them
    once a round."""

    walks = 0

    def __iter__(self) -> Iterator[Backend]:
        self.walks += 1
        return super().__iter__()


async def test_scraping_a_simulated_vllm_tracks_waiting_running_kv_and_itl() -> None:
    port = free_port()
    sim = await start_sim(SimConfig(model="tiny", max_num_seqs=2), "127.0.0.1", port)
    pool = BackendPool([BackendSpec("127.0.0.1", port)])
    (backend,) = pool.backends
    rounds: list[None] = []
    poller = Poller(pool, on_change=lambda: rounds.append(None))
    backend.note_grant()
    watch = asyncio.create_task(poller.watch_metrics(interval_s=0.02, timeout_s=1.0))
    body = {"model": "tiny", "prompt": "hello " * 200, "max_tokens": 4000, "ignore_eos": True}
    try:
        await _until(lambda: backend.metrics is not None)
        assert backend.metrics is not None
        assert (backend.metrics.waiting, backend.metrics.running) == (0, 0)
        assert backend.granted_since_scrape == 0 and backend.in_flight == 1
        async with aiohttp.ClientSession() as session:
            requests = [
                asyncio.create_task(
                    session.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
                )
                for _ in range(5)
            ]
            await _until(
                lambda: (
                    backend.metrics is not None
                    and (backend.metrics.running, backend.metrics.waiting) == (2, 3)
                    and backend.itl_s is not None
                )
            )
            assert backend.metrics.kv_cache_usage > 0
            assert backend.itl_s is not None and 0 < backend.itl_s < 1
            assert not passes(Gate(max_waiting=3), backend, pool.clock(), 1.0)
            assert passes(Gate(max_waiting=4), backend, pool.clock(), 1.0)
            for request in requests:
                request.cancel()
            await asyncio.gather(*requests, return_exceptions=True)
        await _until(lambda: backend.metrics is not None and backend.metrics.running == 0)
        assert len(rounds) >= 3  # admission hears about every round
        assert not watch.done()
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await sim.cleanup()


async def test_garbage_down_and_hung_backends_are_saturated_while_a_good_one_keeps_updating(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class State:
        good_scrapes = 0
        flaky_garbage = True

    state = State()

    async def good(_: web.Request) -> web.Response:
        state.good_scrapes += 1
        return web.Response(
            text=METRICS_PAGE.format(waiting=state.good_scrapes, running=1, count=0, itl_sum=0)
        )

    async def flaky(_: web.Request) -> web.Response:
        if state.flaky_garbage:
            return web.Response(text="<html>upstream connect error</html>")
        return web.Response(text=METRICS_PAGE.format(waiting=0, running=0, count=0, itl_sum=0))

    unhang = asyncio.Event()

    async def hung(_: web.Request) -> web.Response:
        await unhang.wait()  # far longer than the scrape timeout, until the test ends
        return web.Response(text="")

    apps = []
    for handler in (good, flaky, hung):
        app = web.Application()
        app.router.add_get("/metrics", handler)
        apps.append(await _serve(app))
    good_port, flaky_port, hung_port = (port for _, port in apps)
    down_port = free_port()  # nothing listens here
    pool = BackendPool(
        [BackendSpec("127.0.0.1", p) for p in (good_port, flaky_port, hung_port, down_port)]
    )
    good_b, flaky_b, hung_b, down_b = pool.backends
    gate = Gate(max_waiting=None, max_kv_cache_usage=None)
    caplog.set_level(logging.WARNING, logger="fairlane.backends")
    watch = asyncio.create_task(Poller(pool).watch_metrics(interval_s=0.02, timeout_s=0.3))
    try:
        # Within one hung scrape's timeout (0.3 s) the good backend is scraped many times
        # over: a slow backend must not hold up everyone's round.
        await _until(lambda: not hung_b.scrape_ok)
        assert state.good_scrapes >= 4
        assert good_b.healthy and passes(gate, good_b, pool.clock(), 1.0)
        for bad in (flaky_b, hung_b, down_b):
            assert bad.health_ok and not bad.healthy  # /health fine, metrics not: not picked
            assert bad.metrics is None and not passes(gate, bad, pool.clock(), 1.0)
        flaky_logs = [r for r in caplog.records if str(flaky_port) in r.getMessage()]
        assert len(flaky_logs) == 1, "one line per state change, not per scrape"

        state.flaky_garbage = False
        await _until(lambda: flaky_b.scrape_ok and flaky_b.metrics is not None)
        assert passes(gate, flaky_b, pool.clock(), 1.0)
        last = flaky_b.metrics
        state.flaky_garbage = True
        await _until(lambda: not flaky_b.scrape_ok)
        assert flaky_b.metrics is last  # kept, ageing into staleness
        assert last is not None and not passes(gate, flaky_b, last.scraped_at + 0.5, 1.0)
        flaky_b.scrape_ok = True  # even if it were readable, old numbers count as saturated
        assert not passes(gate, flaky_b, last.scraped_at + 1.5, 1.0)

        seen = state.good_scrapes
        await _until(lambda: state.good_scrapes > seen + 3)
        assert good_b.metrics is not None and good_b.metrics.waiting > seen
        assert not watch.done()
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        unhang.set()
        for runner, _ in apps:
            await runner.cleanup()


async def test_one_late_scrape_is_missed_two_in_a_row_mark_the_backend_unscrapable() -> None:
    """A busy engine's API server answers /metrics late now and then: one timeout keeps the
    backend usable (its metrics age meanwhile); a second one in a row does not.

    The state between two scrapes lasts one interval, too short to poll for reliably, so
    the server records the backend's state as each scrape arrives: what the previous scrape
    left behind."""
    slow_next = [0]
    seen: list[tuple[int, bool, bool]] = []  # (timeouts, scrape_ok, healthy) per scrape
    release = asyncio.Event()
    pool = BackendPool([BackendSpec("127.0.0.1", 1)])  # replaced below, once the port is known

    async def metrics(_: web.Request) -> web.Response:
        (backend,) = pool.backends
        seen.append((backend.timeouts, backend.scrape_ok, backend.healthy))
        if slow_next[0]:
            slow_next[0] -= 1
            await release.wait()  # past the scrape timeout
        return web.Response(text=METRICS_PAGE.format(waiting=0, running=1, count=0, itl_sum=0))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner, port = await _serve(app)
    pool = BackendPool([BackendSpec("127.0.0.1", port)])
    (backend,) = pool.backends
    # A timeout far above a loopback answer's time, so that only the held answers time out
    # even on a busy machine.
    watch = asyncio.create_task(Poller(pool).watch_metrics(interval_s=0.02, timeout_s=1.0))
    try:
        await _until(lambda: len(seen) >= 2 and backend.scrape_ok)
        slow_next[0] = 1
        await _until(lambda: any(t == 1 for t, _, _ in seen))
        assert all(ok and healthy for t, ok, healthy in seen if t == 1)  # one late: missed
        await _until(lambda: seen[-1][0] == 0 and len(seen) > 3)  # the next one answered
        mark = len(seen)
        slow_next[0] = 2
        await _until(lambda: any(t >= 2 for t, _, _ in seen[mark:]), timeout_s=10.0)
        assert all(not ok and not healthy for t, ok, healthy in seen[mark:] if t >= 2)
        await _until(lambda: backend.scrape_ok and backend.timeouts == 0)  # usable again
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        release.set()
        await runner.cleanup()


async def test_an_engine_another_replica_scrapes_is_not_scraped_here() -> None:
    hits = {"a": 0, "b": 0}

    def page(name: str) -> object:
        async def metrics(_: web.Request) -> web.Response:
            hits[name] += 1
            return web.Response(text=METRICS_PAGE.format(running=1, waiting=0, count=1, itl_sum=0))

        return metrics

    servers = []
    for name in hits:
        app = web.Application()
        app.router.add_get("/metrics", page(name))  # type: ignore[arg-type]
        servers.append(await _serve(app))
    pool = BackendPool([BackendSpec("127.0.0.1", port) for _, port in servers])
    pool.backends[1].scrape_here = False  # the shared state says another replica scrapes it
    watch = asyncio.create_task(Poller(pool).watch_metrics(interval_s=0.01, timeout_s=1.0))
    try:
        await _until(lambda: hits["a"] >= 10)
        assert hits["b"] == 0 and pool.backends[1].metrics is None
        pool.backends[1].scrape_here = True  # its scraper's scrapes stopped coming
        await _until(lambda: hits["b"] >= 1)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        for runner, _ in servers:
            await runner.cleanup()


async def test_a_replica_that_scrapes_no_engine_keeps_polling_and_takes_one_over() -> None:
    """Every engine scraped by another replica leaves nothing to wait on in a round; the
    loop must sleep, not die (it raised ``ValueError`` from ``asyncio.wait`` of nothing, and
    a takeover then never scraped: held requests waited out their deadline)."""
    hits = 0

    async def metrics(_: web.Request) -> web.Response:
        nonlocal hits
        hits += 1
        return web.Response(text=METRICS_PAGE.format(running=1, waiting=0, count=1, itl_sum=0))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner, port = await _serve(app)
    pool = BackendPool([BackendSpec("127.0.0.1", port)])
    pool.backends[0].scrape_here = False
    pool.backends = walked = Walked(pool.backends)
    watch = asyncio.create_task(Poller(pool).watch_metrics(interval_s=0.01, timeout_s=1.0))
    try:
        await _until(lambda: walked.walks >= 10 or watch.done())  # rounds with nothing to scrape
        assert not watch.done() and hits == 0
        pool.backends[0].scrape_here = True  # its scraper died: take it over
        await _until(lambda: pool.backends[0].metrics is not None)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await runner.cleanup()


async def test_models_are_read_with_the_engines_key_and_kept_when_a_read_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answer: dict[str, object] = {
        "object": "list",
        "data": [{"id": "tiny", "parent": None}, {"id": "ad1", "parent": "tiny"}],
    }
    status = [200]
    seen_keys: list[str | None] = []

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        seen_keys.append(request.headers.get("authorization"))
        if status[0] != 200:
            return web.Response(status=status[0], text="down for maintenance")
        return web.json_response(answer)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner, port = await _serve(app)
    pool = BackendPool([BackendSpec("127.0.0.1", port)])
    (backend,) = pool.backends
    changes: list[bool] = []
    poller = Poller(
        pool, on_change=lambda: changes.append(True), authorization=lambda b: "Bearer sk-engine"
    )
    try:
        async with aiohttp.ClientSession() as session:
            assert await poller.read_models(session, backend)
            assert backend.models is not None and backend.models.adapters == {"ad1": "tiny"}
            assert pool.serving("ad1") == [backend] and pool.serving("other") == []
            assert seen_keys == ["Bearer sk-engine"]
            assert not await poller.read_models(session, backend)  # unchanged: no news
            status[0] = 503
            with caplog.at_level(logging.WARNING, logger="fairlane.backends"):
                assert not await poller.read_models(session, backend)
                assert not await poller.read_models(session, backend)
            warnings = [r for r in caplog.records if "/v1/models unreadable" in r.message]
            assert (
                len(warnings) == 1
                and "keeping what was known: tiny, ad1 (adapter of tiny)" in warnings[0].message
            )
            assert backend.models.serves("tiny")  # the last known set
            status[0] = 200
            answer["data"] = [{"id": "tiny", "parent": None}]  # the adapter was unloaded
            assert await poller.read_models(session, backend)
            assert pool.serving("ad1") == []
    finally:
        await runner.cleanup()


async def test_health_polling_reads_each_engines_models() -> None:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "parent": None}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner, port = await _serve(app)
    pool = BackendPool([BackendSpec("127.0.0.1", port)])
    poller = Poller(pool)
    task = asyncio.create_task(poller.watch_health(interval_s=0.05, timeout_s=0.5))
    try:
        await _until(lambda: pool.backends[0].models is not None)
    finally:
        task.cancel()
        await runner.cleanup()
    assert pool.serving("m") == pool.backends and pool.models_version == 1
