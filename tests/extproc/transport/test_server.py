"""The server's background work that has no socket: the policy file watch, the bounded stop,
the report of a background loop that died."""

import asyncio
import gc
import logging
import time
from pathlib import Path

import pytest

from extproc.fleet.backend import BackendSpec, KVEventPorts
from extproc.ops import cli
from extproc.policy import PolicyStore, parse_policy
from extproc.transport.server import (
    BUILTIN_TOKENIZER,
    Service,
    ServiceConfig,
    fleet_from_args,
    record_failure,
    stop_within,
    watch_policy,
)
from tests.extproc.policy.test_policy import MINIMAL, many_tenants, rewrite


async def test_watch_picks_up_a_change(tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(MINIMAL)
    store = PolicyStore(policy_file, poll_interval_s=0.01)
    swapped = asyncio.Event()
    store.on_change(lambda _: swapped.set())
    task = asyncio.create_task(watch_policy(store))
    try:
        rewrite(policy_file, MINIMAL.replace("queue_limit: 10", "queue_limit: 77"))
        await asyncio.wait_for(swapped.wait(), timeout=5)
        assert store.current.tier("fast").queue_limit == 77
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_slow_reload_does_not_stall_the_loop(tmp_path: Path) -> None:
    """A policy whose parse takes most of a second is parsed off the loop; a timer
    task that should wake every 5 ms keeps waking while it parses, and the new policy is
    then in force. Parsed on the loop, the timer would wait the whole parse. In a thread it
    waits for the GIL: its 5 ms switch interval, and the garbage collector's full passes,
    which the loader thread's allocations trigger and which stop every thread wherever the
    parse runs (measured: the loop's worst wait was the worst pass, to the millisecond,
    0.07 s at 4,000 tenants, 0.15-0.2 s at 8,000, 0.3-0.4 s at 12,000). So the bound is
    the collector's own worst pause, timed here, plus a few switch intervals."""
    big = many_tenants(8_000)
    started = time.perf_counter()
    parse_policy(big, "big.yaml")
    parse_s = time.perf_counter() - started
    assert parse_s >= 0.3, f"the policy parses in {parse_s:.2f} s: too fast to show a stall"

    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(MINIMAL)
    store = PolicyStore(policy_file, poll_interval_s=0.01)
    swapped = asyncio.Event()
    store.on_change(lambda _: swapped.set())
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    collections: list[float] = []
    began: list[float] = []

    def timed_collection(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            collections.append(time.perf_counter() - began.pop())

    async def tick() -> None:
        while True:
            before = loop.time()
            await asyncio.sleep(0.005)
            lags.append(loop.time() - before - 0.005)

    ticker = asyncio.create_task(tick())
    watch = asyncio.create_task(watch_policy(store))
    gc.callbacks.append(timed_collection)
    try:
        rewrite(policy_file, big)
        reload_started = loop.time()
        await asyncio.wait_for(swapped.wait(), timeout=30 * parse_s + 5)
        reload_s = loop.time() - reload_started
    finally:
        gc.callbacks.remove(timed_collection)
        for task in (watch, ticker):
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    assert len(store.current.tenants) == 8_001
    assert reload_s >= parse_s / 2  # the timer ran all through a reload as slow as the parse
    assert len(lags) >= 20, f"the timer woke {len(lags)} times in a {reload_s:.2f} s reload"
    worst, pause = max(lags), max(collections, default=0.0)
    assert worst < pause + 0.05, (
        f"the loop stalled {worst:.3f} s during a {parse_s:.3f} s parse, "
        f"the collector's longest pause {pause:.3f} s"
    )
    assert worst < parse_s / 2, f"the loop stalled {worst:.3f} s during a {parse_s:.3f} s parse"


async def test_a_stop_that_hangs_ends_the_process_after_its_time() -> None:
    exits: list[str] = []
    hang = asyncio.Event()  # never set: a stop that awaits something that never comes
    await stop_within(hang.wait(), 0.05, exit=exits.append)  # type: ignore[arg-type]
    assert exits == ["the stop did not finish within 0.05s"]


async def test_a_stop_that_finishes_in_time_exits_nothing() -> None:
    exits: list[str] = []
    await stop_within(asyncio.sleep(0.01), 1.0, exit=exits.append)
    assert exits == []


async def test_a_background_loop_that_dies_is_logged_at_once_and_fails_the_service(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failed: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def scrape_forever() -> None:
        await asyncio.sleep(0)
        raise ValueError("Set of Tasks/Futures is empty.")

    task = asyncio.create_task(scrape_forever(), name="scrape")
    task.add_done_callback(lambda t: record_failure(t, failed))
    with caplog.at_level(logging.ERROR, logger="fairlane.server"):
        why = await asyncio.wait_for(failed, 1.0)
    assert why == "background task 'scrape' failed: ValueError('Set of Tasks/Futures is empty.')"
    assert caplog.records[0].exc_info is not None  # the traceback, where it happened


async def test_a_cancelled_background_loop_is_a_stop_not_a_failure() -> None:
    failed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(asyncio.sleep(10), name="health")
    task.add_done_callback(lambda t: record_failure(t, failed))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert not failed.done()


def test_a_malformed_dns_backend_or_server_stops_the_command_saying_why() -> None:
    with pytest.raises(SystemExit, match=r"fairlane: backend 'eu=dns://vllm': expected .*port"):
        fleet_from_args(["eu=dns://vllm"])
    with pytest.raises(SystemExit, match="an IP address, not a name"):
        cli.main(["up", "--backend", "dns://10.0.0.5:8000"])
    with pytest.raises(SystemExit, match=r"dns server 'vllm:53': expected IP\[:PORT\]"):
        cli.main(["serve", "--backend", "dns://vllm:8000", "--dns-server", "vllm:53"])
    with pytest.raises(SystemExit, match="--dns-interval must be > 0"):
        cli.main(["serve", "--backend", "dns://vllm:8000", "--dns-interval", "0"])


def test_a_connection_limit_below_one_stops_the_command_saying_why() -> None:
    with pytest.raises(SystemExit, match="--max-connections must be >= 1, not 0"):
        cli.main(["serve", "--backend", "http://127.0.0.1:8000", "--max-connections", "0"])


def test_engines_events_are_followed_only_with_a_tokenizer_to_match_them() -> None:
    """Without the engines' tokenizer no prompt can be hashed their way: following their
    events would only cost CPU (a replay of each engine's buffer at start)."""
    engine = BackendSpec("127.0.0.1", 8701, kv_events=KVEventPorts(5517, 5518))
    assert Service(ServiceConfig(backends=(engine,))).kv_feeds is None
    config = ServiceConfig(backends=(engine,), tokenizer=BUILTIN_TOKENIZER)
    assert Service(config).kv_feeds is not None
