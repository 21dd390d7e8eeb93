"""Faults through the real Envoy (issue: endpoint picking; hedging and regional failover).

Each test starts its own small stack (Envoy, the service, two or three simulators) and
breaks one thing: a backend killed mid-run, a whole region killed and brought back, a
backend slow to answer, backends whose ``/metrics`` is garbage or never answers. Requests
carry an ``x-test-id`` header, and the simulators' request logs say which backend each one
reached (a hedged request reaches two).

The assertions hold for any sane picker: a dead, unhealthy or unscrapable backend is never
chosen, and on a tie the local (first-named) region wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.ops.up import Stack
from tests.integration.conftest import DEMO_TENANTS, auth, requests_by_backend, start_stack
from tests.polling import until

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
MODEL = "sim-model"
# The default profile (8B on an H100, ~6 ms a step): a short answer takes a few tens of
# ms, well inside the 300 ms per-try timeout of the hedged tier.
FAULT_SIM_ARGS = ("--scheduling-policy", "priority", "--model", MODEL)
HEDGE_AFTER_MS = 300
SLOW_S = 3.0

# Loose gates and room for every test's traffic: only the faults decide where requests go.
FAULT_POLICY = f"""\
max_body_bytes: 65536
max_in_flight_per_backend: 32
on_escalation: downgrade
user_header: x-user-id
tiers:
  - name: interactive
    aliases: [high]
    priority: 0
    queue_limit: 64
    queue_deadline_s: 10
    hedge_after_ms: {HEDGE_AFTER_MS}
    gate: {{max_waiting: 16}}
  - name: api
    aliases: [normal]
    priority: 10
    queue_limit: 64
    queue_deadline_s: 10
    gate: {{max_waiting: 16}}
  - name: batch
    aliases: [low]
    priority: 20
    queue_limit: 64
    queue_deadline_s: 10
    gate: {{max_waiting: 16, max_itl_ms: null}}
{DEMO_TENANTS}"""

CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


@dataclass
class Outcome:
    test_id: str
    sent_at: float  # time.time(), as in the simulators' logs
    elapsed_s: float
    status: int  # 0: the client got no response (connection error or timeout)
    error: str = ""


@contextlib.asynccontextmanager
async def fault_stack(
    tmp: Path,
    regions: tuple[str, ...],
    extra: Mapping[int, tuple[str, ...]] | None = None,
) -> AsyncIterator[Stack]:
    group, stack = await asyncio.to_thread(
        start_stack,
        tmp,
        FAULT_POLICY,
        sim_regions=regions,
        sim_args=FAULT_SIM_ARGS,
        sim_extra_args=extra,
    )
    try:
        yield stack
    finally:
        await asyncio.to_thread(group.stop)


def chat(max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def send(
    session: aiohttp.ClientSession,
    stack: Stack,
    test_id: str,
    key: str = "sk-api-demo",
    max_tokens: int = 4,
    timeout: float = 15,
) -> Outcome:
    """One non-streamed chat completion; never raises."""
    headers = {**auth(key), "x-test-id": test_id}
    sent_at, started = time.time(), time.monotonic()
    try:
        async with session.post(
            stack.url + CHAT,
            json=chat(max_tokens),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as r:
            body = await r.read()
            error = "" if r.status == 200 else body[:300].decode(errors="replace")
            return Outcome(test_id, sent_at, time.monotonic() - started, r.status, error)
    except CLIENT_ERRORS as exc:
        return Outcome(test_id, sent_at, time.monotonic() - started, 0, repr(exc))


def where(stack: Stack, test_id: str) -> list[str]:
    """The backends (addresses) that received the request ``test_id``."""
    return [
        address
        for address, records in requests_by_backend(stack).items()
        if any(r["headers"].get("x-test-id") == test_id for r in records)
    ]


def record_of(stack: Stack, address: str, test_id: str) -> dict[str, Any]:
    (record,) = [
        r for r in requests_by_backend(stack)[address] if r["headers"].get("x-test-id") == test_id
    ]
    return record


async def gateway_metrics_answer(stack: Stack) -> bool:
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    timeout = aiohttp.ClientTimeout(total=3)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as r:
            return r.status == 200 and "fairlane_" in await r.text()
    except CLIENT_ERRORS:
        return False


async def wait_gateway_idle(stack: Stack, timeout: float = 5) -> float:
    """Until no backend has a request in flight by the gateway's count; what is left."""
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    deadline = time.monotonic() + timeout
    busy = -1.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
        while time.monotonic() < deadline:
            async with session.get(url) as r:
                text = await r.text()
            busy = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("fairlane_backend_in_flight{")
            )
            if busy == 0:
                break
            await asyncio.sleep(0.1)
    return busy


# ----------------------------------------------------------------------------- the tests


async def test_killed_backend_costs_no_non_streamed_request(tmp_path: Path) -> None:
    """Kill one of two same-region backends under a trickle of non-streamed requests: none
    fails (a connect failure or reset is retried on the alternate), a stream already
    running there ends (cut, not hung), and afterwards everything reaches the survivor."""
    async with (
        fault_stack(tmp_path, ("region-a", "region-a")) as stack,
        aiohttp.ClientSession() as session,
    ):
        # A long stream (3000 tokens, ~20 s) that has started: the victim is its backend.
        stream_headers = {**auth("sk-api-demo"), "x-test-id": "stream"}
        stream = await session.post(
            stack.url + CHAT, json=chat(3000, stream=True), headers=stream_headers
        )
        assert stream.status == 200
        for _ in range(3):
            line = await asyncio.wait_for(stream.content.readuntil(b"\n\n"), 5)
            assert line.startswith(b"data: {")
        (victim,) = where(stack, "stream")
        (survivor,) = [b.address for b in stack.backends if b.address != victim]

        outcomes: list[Outcome] = []
        stop = asyncio.Event()

        async def worker(w: int) -> None:
            n = 0
            while not stop.is_set():
                # ~0.8 s each: the picker spreads ~10 running requests over both backends,
                # so several are mid-generation on the victim when it dies
                outcomes.append(await send(session, stack, f"w{w}-{n}", max_tokens=120))
                n += 1
                await asyncio.sleep(0.1)

        def running_on_victim() -> int:
            """Trickle requests the victim received that have no answer yet."""
            answered = {o.test_id for o in outcomes}
            received = {r["headers"].get("x-test-id") for r in requests_by_backend(stack)[victim]}
            return sum(1 for t in received if t and t.startswith("w") and t not in answered)

        def survivor_serving() -> bool:
            received = requests_by_backend(stack)[survivor]
            return any((r["headers"].get("x-test-id") or "").startswith("w") for r in received)

        workers = [asyncio.create_task(worker(w)) for w in range(10)]
        # Kill it while requests are mid-generation there (two, so that one finishing in
        # the instant between this check and the kill still leaves one to be cut).
        try:
            await until(survivor_serving, "the trickle on the survivor too", timeout_s=10.0)
            await until(
                lambda: running_on_victim() >= 2,
                "two trickle requests running on the victim at once",
                timeout_s=10.0,
                every_s=0.05,
            )
        except AssertionError:
            stop.set()  # the workers end with the test
            raise
        killed_at = time.time()
        await asyncio.to_thread(stack.kill_simulator, victim)
        asyncio.get_running_loop().call_later(4.0, stop.set)

        # The stream that was running on the victim ends, with an error or cut short.
        cut_started = time.monotonic()
        stream_error: BaseException | None = None
        rest = b""
        try:
            rest = await asyncio.wait_for(stream.content.read(), 10)
        except (aiohttp.ClientError, ConnectionError) as exc:
            stream_error = exc
        finally:
            stream.close()
        stream_ended_s = time.monotonic() - cut_started
        assert stream_ended_s < 5, f"the cut stream took {stream_ended_s:.1f}s to end"
        assert stream_error is not None or b"[DONE]" not in rest

        await asyncio.gather(*workers)
        failed = [o for o in outcomes if o.status != 200]
        assert not failed, failed[:5]
        assert len(outcomes) > 30  # a real trickle ran across the kill

        after = [o for o in outcomes if o.sent_at > killed_at]
        assert len(after) > 15
        logs = requests_by_backend(stack)
        on_survivor = {r["headers"].get("x-test-id"): r for r in logs[survivor]}
        on_victim = {r["headers"].get("x-test-id") for r in logs[victim]}
        for o in after:
            assert o.test_id in on_survivor, o
            assert o.test_id not in on_victim, o
        # Requests the victim had received and was generating when it died were retried
        # (Envoy: reset before response headers) and answered by the survivor.
        cut_and_retried = [
            o for o in outcomes if o.test_id in on_victim and o.test_id in on_survivor
        ]
        assert cut_and_retried, "no request was in flight on the victim when it died"
        # Within ~2 s of the kill the service no longer lists the dead backend at all
        # (failed scrapes at once, failed /health within a second).
        late = [o for o in after if o.sent_at > killed_at + 2.0]
        assert late
        for o in late:
            endpoints = on_survivor[o.test_id]["headers"]["x-gateway-destination-endpoint"]
            assert victim not in endpoints.split(","), (o, endpoints)
        # Every slot came back: retried requests and the cut stream were all released.
        assert await wait_gateway_idle(stack) == 0


async def test_region_fails_over_and_traffic_returns(tmp_path: Path) -> None:
    """Kill both region-a backends: region-b serves everything; bring them back (same
    ports): within a few seconds requests go to the local region again."""
    async with (
        fault_stack(tmp_path, ("region-a", "region-a", "region-b")) as stack,
        aiohttp.ClientSession() as session,
    ):
        region_a = {b.address for b in stack.backends if b.region == "region-a"}
        (region_b,) = [b.address for b in stack.backends if b.region == "region-b"]

        for n in range(4):
            outcome = await send(session, stack, f"before-{n}")
            assert outcome.status == 200, outcome
            assert set(where(stack, outcome.test_id)) <= region_a, outcome

        for address in sorted(region_a):
            await asyncio.to_thread(stack.kill_simulator, address)
        during: list[Outcome] = []
        down_until = time.monotonic() + 2.0
        n = 0
        while time.monotonic() < down_until:
            batch = await asyncio.gather(*(send(session, stack, f"down-{n}-{i}") for i in range(3)))
            during.extend(batch)
            n += 1
        assert len(during) >= 9
        assert all(o.status == 200 for o in during), [o for o in during if o.status != 200]
        for o in during:
            assert where(stack, o.test_id) == [region_b], o

        for address in sorted(region_a):
            await asyncio.to_thread(stack.restart_simulator, address)
        restarted = time.monotonic()
        back_after: float | None = None
        n = 0
        while time.monotonic() - restarted < 8:
            outcome = await send(session, stack, f"back-{n}")
            assert outcome.status == 200, outcome
            if set(where(stack, outcome.test_id)) <= region_a:
                back_after = time.monotonic() - restarted
                break
            n += 1
            await asyncio.sleep(0.1)
        assert back_after is not None, "traffic never returned to region-a"
        assert back_after < 5, f"traffic returned to region-a only after {back_after:.1f}s"
        for n in range(4):
            # Envoy reports completions in batches up to 10 ms apart: until the last one
            # arrives its seat still counts as taken, and with one seat an engine would look
            # full to a request sent right after its answer.
            assert await wait_gateway_idle(stack) == 0
            outcome = await send(session, stack, f"home-{n}")
            assert outcome.status == 200, outcome
            assert set(where(stack, outcome.test_id)) <= region_a, outcome
        assert await wait_gateway_idle(stack) == 0


async def test_slow_backend_is_hedged_for_interactive_only(tmp_path: Path) -> None:
    """The local backend holds its response headers 3 s (past interactive's 300 ms per-try
    timeout); the remote one is fast. Interactive requests (plain and streamed) are hedged
    and answered by the remote one well before 3 s; a batch request is not hedged."""
    extra = {0: ("--fault-delay-headers-s", str(SLOW_S))}
    async with (
        fault_stack(tmp_path, ("region-a", "region-b"), extra) as stack,
        aiohttp.ClientSession() as session,
    ):
        slow, fast = (b.address for b in stack.backends)

        outcome = await send(session, stack, "hedged", key="sk-chat-demo")
        assert outcome.status == 200, outcome
        assert outcome.elapsed_s < 1.5, outcome
        # The slow (local, first-listed) backend got it first, the hedge went to the other.
        assert sorted(where(stack, "hedged")) == sorted([slow, fast])
        first, second = record_of(stack, slow, "hedged"), record_of(stack, fast, "hedged")
        assert second["time"] - first["time"] >= HEDGE_AFTER_MS / 1000 - 0.05

        # Both attempts must be seen finished (completions come in batches up to 10 ms
        # apart), or the one-seat slow backend still looks taken and is not tried first.
        assert await wait_gateway_idle(stack) == 0
        headers = {**auth("sk-chat-demo"), "x-test-id": "hedged-stream"}
        started = time.monotonic()
        async with session.post(stack.url + CHAT, json=chat(4, stream=True), headers=headers) as r:
            assert r.status == 200
            headers_after = time.monotonic() - started
            body = await r.read()
        assert headers_after < 1.5
        assert body.rstrip().endswith(b"data: [DONE]")
        assert sorted(where(stack, "hedged-stream")) == sorted([slow, fast])

        # The hedged-away attempts were reset; the gateway sees both requests finish.
        assert await wait_gateway_idle(stack) == 0
        outcome = await send(session, stack, "batch", key="sk-batch-demo")
        assert outcome.status == 200, outcome
        assert where(stack, "batch") == [slow]
        assert outcome.elapsed_s >= SLOW_S - 0.1, outcome
        assert await wait_gateway_idle(stack) == 0  # hedged-away attempts hold no slot


async def test_garbage_or_hanging_metrics_backends_are_never_picked(tmp_path: Path) -> None:
    """Two local backends answer /metrics with junk or not at all (their /health is fine);
    every request goes to the healthy remote one, and the service keeps serving."""
    extra = {0: ("--fault-metrics", "garbage"), 1: ("--fault-metrics", "hang")}
    async with (
        fault_stack(tmp_path, ("region-a", "region-a", "region-b"), extra) as stack,
        aiohttp.ClientSession() as session,
    ):
        garbage, hang, healthy = (b.address for b in stack.backends)
        service = next(c for c in stack.group.children if c.name == "service")
        keys = ("sk-chat-demo", "sk-api-demo", "sk-batch-demo")
        outcomes: list[Outcome] = []

        async def round_(name: str) -> None:
            sends = [send(session, stack, f"{name}-{k}-{i}", k) for k in keys for i in (0, 1)]
            outcomes.extend(await asyncio.gather(*sends))

        await round_("early")  # the hanging scrape may not have timed out yet
        # Both faults are noticed and logged: a parse error at once, the hang after the
        # scrape timeout (0.5 s).
        deadline = time.monotonic() + 5
        wanted = [f"backend {address} metrics unreadable" for address in (garbage, hang)]
        while time.monotonic() < deadline:
            if all(w in service.log_path.read_text() for w in wanted):
                break
            await asyncio.sleep(0.1)
        service_log = service.log_path.read_text()
        assert all(w in service_log for w in wanted), service_log[-2000:]
        for n in range(2):
            await round_(f"late{n}")

        assert all(o.status == 200 for o in outcomes), [o for o in outcomes if o.status != 200]
        logs = requests_by_backend(stack)
        assert not logs[garbage] and not logs[hang]
        assert len(logs[healthy]) == len(outcomes) == 18
        assert await gateway_metrics_answer(stack)
        assert service.alive()


async def test_backends_without_the_itl_histogram_serve_with_their_itl_bounds_off(
    tmp_path: Path,
) -> None:
    """Both backends' /metrics lack the ITL histogram (another vLLM version, a metrics
    filter in between): they are still picked for every tier (interactive and api have an
    ITL bound), the service says so once per backend, and its metrics show what is
    absent."""
    extra = {0: ("--fault-metrics", "no-itl"), 1: ("--fault-metrics", "no-itl")}
    async with (
        fault_stack(tmp_path, ("region-a", "region-b"), extra) as stack,
        aiohttp.ClientSession() as session,
    ):
        addresses = [b.address for b in stack.backends]
        keys = ("sk-chat-demo", "sk-api-demo", "sk-batch-demo")
        for n in range(2):  # many scrapes apart: still one log line per backend
            sends = [send(session, stack, f"no-itl-{n}-{k}-{i}", k) for k in keys for i in (0, 1)]
            outcomes = await asyncio.gather(*sends)
            assert all(o.status == 200 for o in outcomes), outcomes
            await asyncio.sleep(0.5)
        assert sum(len(r) for r in requests_by_backend(stack).values()) == 12
        service = next(c for c in stack.group.children if c.name == "service")
        service_log = service.log_path.read_text()
        for address in addresses:
            line = f"backend {address}: /metrics has no vllm:inter_token_latency_seconds"
            assert service_log.count(line) == 1, service_log[-2000:]
        url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
        async with session.get(url) as r:
            exposition = await r.text()
        absent = [
            line
            for line in exposition.splitlines()
            if line.startswith("fairlane_backend_metrics_absent{")
            and 'series="vllm:inter_token_latency_seconds"' in line
        ]
        assert len(absent) == 2 and all(line.endswith(" 1.0") for line in absent), absent


async def test_with_no_readable_metrics_anywhere_the_503_says_so(tmp_path: Path) -> None:
    """Every backend's /metrics is garbage (their /health is fine): no request can ever go.
    The client is told that, with each backend and its scrape error, not that it "waited
    10 s": a request held from start-up at its deadline, a later one at once."""
    extra = {0: ("--fault-metrics", "garbage"), 1: ("--fault-metrics", "garbage")}
    async with (
        fault_stack(tmp_path, ("region-a", "region-b"), extra) as stack,
        aiohttp.ClientSession() as session,
    ):
        addresses = [b.address for b in stack.backends]

        async def refused() -> tuple[float, dict[str, Any]]:
            started = time.monotonic()
            headers = auth("sk-api-demo")
            async with session.post(stack.url + CHAT, json=chat(), headers=headers) as r:
                assert r.status == 503, await r.text()
                assert r.headers["retry-after"] == "5"
                body = await r.json()
            return time.monotonic() - started, body["error"]

        for _ in range(2):  # the first may be held until its deadline (10 s) or refused
            elapsed_s, error = await refused()
            assert error["code"] == "no_usable_metrics" and error["type"] == "service_unavailable"
            message = error["message"]
            assert message.startswith("no backend has usable metrics: "), message
            assert all(f"{a} (scrape failed: " in message for a in addresses), message
            assert "waited" not in message
        assert elapsed_s < 2  # past the grace: refused at once, not held
        assert not any(requests_by_backend(stack).values())


async def test_hedge_never_reaches_a_backend_the_service_excluded(tmp_path: Path) -> None:
    """The only pickable backend is slow (1 s); the other one's /metrics is garbage (its
    /health is fine). The interactive request waits for the slow one: the excluded backend
    gets nothing, not even a hedge."""
    extra = {0: ("--fault-metrics", "garbage"), 1: ("--fault-delay-headers-s", "1")}
    async with (
        fault_stack(tmp_path, ("region-a", "region-b"), extra) as stack,
        aiohttp.ClientSession() as session,
    ):
        excluded, slow = (b.address for b in stack.backends)
        outcome = await send(session, stack, "lonely", key="sk-chat-demo")
        assert outcome.status == 200, outcome
        assert excluded not in where(stack, "lonely")
        assert where(stack, "lonely") == [slow]
