import asyncio

import pytest
from aiohttp import web

from extproc.backends import BackendPool, BackendSpec, parse_backend
from extproc.processes import free_port


def test_parse_backend_with_and_without_region() -> None:
    assert parse_backend("eu=http://10.0.0.5:8000") == BackendSpec("10.0.0.5", 8000, "eu")
    assert parse_backend("127.0.0.1:8101") == BackendSpec("127.0.0.1", 8101, "default")
    assert parse_backend("us=127.0.0.1:1").address == "127.0.0.1:1"


@pytest.mark.parametrize("bad", ["http://vllm.local:8000", "eu=http://10.0.0.5", "ftp://1.2.3.4:5"])
def test_parse_backend_rejects_what_envoy_cannot_route(bad: str) -> None:
    with pytest.raises(ValueError, match="backend"):
        parse_backend(bad)


def test_regions_keep_their_configured_order() -> None:
    pool = BackendPool([BackendSpec("127.0.0.1", p, r) for p, r in [(1, "b"), (2, "a"), (3, "b")]])
    assert pool.regions == ["b", "a"]


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
    pool.on_capacity(lambda: recovered.append(True))
    task = asyncio.create_task(pool.watch_health(interval_s=0.05, timeout_s=0.5))
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
