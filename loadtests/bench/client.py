"""The load generator: one asyncio process that plays a scenario's groups against a URL.

It is deliberately simple (aiohttp, one event loop): at the rates the scenarios use it
needs a fraction of a core, and ``cli`` measures its CPU so a run where the client was the
bottleneck is flagged rather than trusted. Every request is recorded with its times in
**simulated seconds** (wall seconds x speedup) relative to the start of the run.

Bounded by construction: no new request after ``duration_s`` or once ``max_requests`` have
been sent; requests still running ``drain_s`` later are cancelled and recorded as
unfinished (the time they had waited is kept: a starved request must not vanish from the
statistics just because it never finished).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from loadtests.bench.cachestats import PrefixCounters, parse_prefix_counters
from loadtests.bench.cpu import machine_busy_seconds
from loadtests.bench.request_style import request_style
from loadtests.bench.scenario import Group, Scenario
from loadtests.bench.workload import (
    RequestShape,
    chat_body,
    client_shapes,
    open_loop_schedule,
)

CHAT_PATH = "/v1/chat/completions"
QUEUE_HEADER = "x-fairlane-queue-ms"
TIER_HEADER = "x-fairlane-tier"


@dataclass
class RequestRecord:
    """One request as the client saw it; times are simulated seconds from the run's start."""

    arm: str
    group: str
    tenant: str
    tier: str
    index: int
    client: int
    start_s: float
    prompt_tokens_sent: int
    max_tokens: int
    stream: bool
    ttft_s: float | None = None
    """Start to the first SSE chunk with content; for non-streamed requests, = e2e."""
    e2e_s: float | None = None
    end_s: float | None = None
    status: int = 0
    """HTTP status; 0 = no response (connection error or cancelled before headers)."""
    ok: bool = False
    unfinished: bool = False
    """Still running when the drain ended, and cancelled."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float | None = None
    """``x-fairlane-queue-ms`` as sent by the gateway (wall milliseconds)."""
    served_tier: str | None = None
    rate_limited: bool = False
    """A 429 ``rate_limit_exceeded``: the tenant's budget was spent (``extproc.core.budgets``)."""
    rate_limit_headers: bool | None = None
    """For a rate-limited request: whether it carried ``retry-after`` (whole seconds) and
    OpenAI's six ``x-ratelimit-*`` headers."""
    error: str | None = None
    conversation: int | None = None
    """Shared-prefix groups: the client's conversation number, and the turn in it."""
    turn: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


RATE_LIMIT_HEADERS = tuple(
    f"x-ratelimit-{what}-{kind}"
    for what in ("limit", "remaining", "reset")
    for kind in ("requests", "tokens")
)
_RESET = re.compile(r"^(\d+h)?(\d+m)?\d+(ms|s)$")


def rate_limit_headers_ok(headers: Mapping[str, str]) -> bool:
    """A 429 ``rate_limit_exceeded`` as OpenAI sends it: ``retry-after`` in whole seconds,
    the limits and what remains as integers, the resets as durations (``20ms``, ``6m0s``)."""
    try:
        if int(headers["retry-after"]) < 1:
            return False
        present = [h for h in RATE_LIMIT_HEADERS if h in headers]
        if len(present) not in (3, 6):  # one kind (requests or tokens) or both
            return False
        for name in present:
            value = headers[name]
            if "-reset-" in name:
                if not _RESET.match(value):
                    return False
            elif int(value) < 0:
                return False
    except (KeyError, ValueError):
        return False
    return True


class LoadRun:
    """Plays ``groups`` against ``base_url`` for ``scenario.duration_s`` simulated seconds."""

    def __init__(
        self,
        scenario: Scenario,
        arm: str,
        groups: tuple[Group, ...],
        base_url: str,
        backend_urls: tuple[str, ...] = (),
        healthy: Callable[[], bool] | None = None,
    ) -> None:
        self.scenario = scenario
        self.arm = arm
        self.groups = groups
        kind = next((a.kind for a in scenario.arms if a.name == arm), None)
        self.style = request_style(kind, scenario.policy)
        """What the arm's clients add: their tier's priority where no gateway sets it, a
        peer gateway's key."""
        self.url = base_url.rstrip("/") + CHAT_PATH
        if not backend_urls and any(g.direct for g in groups):
            raise ValueError("a direct group needs the backends' URLs to send to")
        self.direct_urls = itertools.cycle([u.rstrip("/") + CHAT_PATH for u in backend_urls])
        """Where a ``direct`` group's requests go, in turn: the backends themselves."""
        self.speedup = scenario.speedup
        self.records: list[RequestRecord] = []
        self.capped = False
        self._sent = 0
        self._stopping = False
        self._t0 = 0.0
        self._requests: set[asyncio.Task[None]] = set()
        self.loop_lag_max_s = 0.0
        """Worst event-loop lateness seen (wall seconds): a stalled client (or machine)
        sends late and reads late, and every latency around it grows by that much."""
        self.machine_peak = 0.0
        """Busiest one-second interval of the whole machine, as a fraction of its cores."""
        self.metrics_urls = tuple(f"{u.rstrip('/')}/metrics" for u in backend_urls)
        """Each backend's ``/metrics``, for its prefix-cache counters."""
        self.healthy = healthy
        """Polled every monitor tick: False (a process of the arm died) ends the run early,
        without the drain, instead of playing the rest of the load into a dead gateway."""
        self.aborted = False
        self._abort = asyncio.Event()
        self.prefix_window: tuple[list[PrefixCounters | None], list[PrefixCounters | None]] = (
            [],
            [],
        )
        """Each backend's prefix-cache counters at the start and at the end of the measured
        window (None where a scrape failed)."""

    def now_s(self) -> float:
        """Simulated seconds since the run started."""
        return (time.monotonic() - self._t0) * self.speedup

    async def _sleep_until(self, at_s: float) -> None:
        """Sleep until simulated ``at_s``, or until the run is aborted."""
        delay = (at_s - self.now_s()) / self.speedup
        if delay > 0 and not self.aborted:
            await self._wait_or_abort(asyncio.sleep(delay))

    async def _wait_or_abort(self, awaitable: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(awaitable)
        abort = asyncio.create_task(self._abort.wait())
        await asyncio.wait((task, abort), return_when=asyncio.FIRST_COMPLETED)
        for t in (task, abort):
            t.cancel()

    def _may_send(self, scheduled: bool = False) -> bool:
        """Whether one more request may go (and count it). A ``scheduled`` (open-loop)
        arrival was due before the end, so it goes even if a stalled loop wakes it after the
        end: every arm must get the same arrivals."""
        if self._stopping and not scheduled:
            return False
        if self._sent >= self.scenario.max_requests:
            self.capped = True
            return False
        self._sent += 1
        return True

    async def run(self) -> list[RequestRecord]:
        scenario = self.scenario
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self._t0 = time.monotonic()
            drivers: list[asyncio.Task[None]] = []
            for group in self.groups:
                if group.closed_loop:
                    assert group.concurrency is not None
                    drivers += [
                        asyncio.create_task(self._closed_client(session, group, k))
                        for k in range(group.concurrency)
                    ]
                else:
                    drivers.append(asyncio.create_task(self._open_loop(session, group)))
            monitor = asyncio.create_task(self._monitor())
            await self._sleep_until(scenario.warmup_s)
            start_counters = await self._scrape_prefix(session)
            await self._sleep_until(scenario.duration_s)
            end_counters = await self._scrape_prefix(session)
            self.prefix_window = (start_counters, end_counters)
            self._stopping = True
            pending = [t for t in (*drivers, *self._requests) if not t.done()]
            if pending and not self.aborted:
                await self._wait_or_abort(
                    asyncio.wait(pending, timeout=scenario.drain_s / self.speedup)
                )
            leftovers = [t for t in (*drivers, *self._requests) if not t.done()]
            monitor.cancel()
            for task in leftovers:
                task.cancel()
            for task in leftovers:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for task in drivers:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        return self.records

    async def _scrape_prefix(self, session: aiohttp.ClientSession) -> list[PrefixCounters | None]:
        """Every backend's prefix-cache counters now, scraped side by side (one slow
        backend must not shift the window of the others)."""

        async def one(url: str) -> PrefixCounters | None:
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    return parse_prefix_counters(await resp.text())
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return None

        return list(await asyncio.gather(*(one(u) for u in self.metrics_urls)))

    async def _monitor(self, tick_s: float = 0.02) -> None:
        """Event-loop lag (how late a short sleep wakes up) and the machine's busiest second."""
        busy0, total0 = machine_busy_seconds()
        next_machine = time.monotonic() + 1.0
        while True:
            before = time.monotonic()
            await asyncio.sleep(tick_s)
            if self.healthy is not None and not self.healthy():
                self.aborted = True
                self._abort.set()
            now = time.monotonic()
            self.loop_lag_max_s = max(self.loop_lag_max_s, now - before - tick_s)
            if now >= next_machine:
                busy1, total1 = machine_busy_seconds()
                if total1 > total0:
                    # busy <= total in /proc/stat; the division can round a hair past 1
                    share = min(1.0, (busy1 - busy0) / (total1 - total0))
                    self.machine_peak = max(self.machine_peak, share)
                busy0, total0, next_machine = busy1, total1, now + 1.0

    async def _open_loop(self, session: aiohttp.ClientSession, group: Group) -> None:
        scenario = self.scenario
        schedule = open_loop_schedule(
            group, scenario.seed, scenario.duration_s, scenario.max_requests
        )
        for item in schedule:
            assert item.at_s is not None
            await self._sleep_until(item.at_s)
            if not self._may_send(scheduled=True):
                return
            task = asyncio.create_task(self._request(session, group, item))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)

    async def _closed_client(
        self, session: aiohttp.ClientSession, group: Group, client: int
    ) -> None:
        scenario = self.scenario
        await self._sleep_until(group.start_s)
        stop = min(group.stop_s or scenario.duration_s, scenario.duration_s)
        shapes = client_shapes(group, scenario.seed, client)
        while self.now_s() < stop and self._may_send():
            await self._request(session, group, next(shapes))
            if group.think_s:
                await self._sleep_until(self.now_s() + group.think_s)

    async def _request(
        self, session: aiohttp.ClientSession, group: Group, item: RequestShape
    ) -> None:
        model = self.scenario.model_of(group)
        body = chat_body(item, group, self.scenario.seed, model)
        body.update(self.style.extras(group.tier))
        key = group.api_key if group.direct else self.style.key(group.api_key)
        headers = {"authorization": f"Bearer {key}"}
        if group.user:
            headers[group.user_header] = group.user
        record = RequestRecord(
            arm=self.arm,
            group=group.name,
            tenant=group.tenant,
            tier=group.tier,
            index=item.index,
            client=item.client,
            start_s=self.now_s(),
            prompt_tokens_sent=item.prompt_tokens,
            max_tokens=item.max_tokens,
            stream=group.stream,
            conversation=item.conversation,
            turn=item.turn,
        )
        self.records.append(record)
        try:
            url = next(self.direct_urls) if group.direct else self.url
            async with session.post(url, json=body, headers=headers) as resp:
                record.status = resp.status
                queue_ms = resp.headers.get(QUEUE_HEADER)
                if queue_ms:
                    with contextlib.suppress(ValueError):
                        record.queue_ms = float(queue_ms)
                record.served_tier = resp.headers.get(TIER_HEADER)
                if resp.status != 200:
                    text = await resp.text()
                    record.error = text[:200]
                    if resp.status == 429 and '"rate_limit_exceeded"' in text:
                        record.rate_limited = True
                        record.rate_limit_headers = rate_limit_headers_ok(resp.headers)
                elif group.stream:
                    await self._read_stream(resp, record)
                else:
                    await self._read_whole(resp, record)
        except asyncio.CancelledError:
            record.unfinished = True
            record.end_s = self.now_s()
            raise
        except Exception as exc:  # any failure is one failed request, never a dead client
            record.error = f"{type(exc).__name__}: {exc}"[:200]
        record.end_s = self.now_s()
        record.e2e_s = record.end_s - record.start_s
        if record.ok and record.ttft_s is None:
            record.ttft_s = record.e2e_s

    async def _read_whole(self, resp: aiohttp.ClientResponse, record: RequestRecord) -> None:
        data = await resp.json()
        usage = data.get("usage") or {}
        record.prompt_tokens = int(usage.get("prompt_tokens", 0))
        record.completion_tokens = int(usage.get("completion_tokens", 0))
        record.ok = True

    async def _read_stream(self, resp: aiohttp.ClientResponse, record: RequestRecord) -> None:
        """SSE: TTFT at the first chunk with content; usage from the include_usage chunk.

        Only the lines that matter are parsed as JSON (until the first token, and the usage
        chunk): one parse per token would cost the client more CPU than the gateway."""
        content_chunks = 0
        done = False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            if record.ttft_s is None:
                chunk = json.loads(payload)
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    record.ttft_s = self.now_s() - record.start_s
                    content_chunks += 1
                self._usage(chunk, record)
                continue
            if b'"usage"' in payload and b'"usage":null' not in payload.replace(b" ", b""):
                self._usage(json.loads(payload), record)
            else:
                content_chunks += 1
        if not record.completion_tokens:
            record.completion_tokens = content_chunks
        record.ok = done
        if not done:
            record.error = "stream ended without [DONE]"

    @staticmethod
    def _usage(chunk: dict[str, Any], record: RequestRecord) -> None:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            record.prompt_tokens = int(usage.get("prompt_tokens", 0))
            record.completion_tokens = int(usage.get("completion_tokens", 0))


def run_load(
    scenario: Scenario,
    arm: str,
    groups: tuple[Group, ...],
    base_url: str,
    backend_urls: tuple[str, ...] = (),
    healthy: Callable[[], bool] | None = None,
) -> LoadRun:
    """Run the workload to completion (bounded). The run holds the records, whether the cap
    was hit, the client's health figures (event-loop stalls, the machine's peak) and the
    backends' prefix-cache counters over the measured window (read from each of
    ``backend_urls``, where ``direct`` groups also send, bypassing the gateway)."""
    load = LoadRun(scenario, arm, groups, base_url, backend_urls, healthy)
    asyncio.run(load.run())
    return load
