"""Preemption through the real Envoy: a running non-streamed request of a ``preemptible``
tier is cancelled to seat a more urgent one (``extproc.core.preemption``).

One simulated engine with a single seat (``--max-num-seqs 1``), learned by the gateway. A
long batch request takes the seat; a chat request then arrives. vLLM never preempts a
running request for a waiting one, so without the gateway the chat request would wait for
the whole batch request. Non-streamed, the batch request is cancelled: its client gets a
503 ``preempted`` with ``retry-after`` (nothing of the answer was sent yet), the engine
aborts it, and chat runs at once. Streamed, it runs to its end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import aiohttp
import pytest

from extproc.ops.up import Stack
from tests.integration.conftest import SIM_ARGS, TEST_POLICY, auth, chat, start_stack
from tests.integration.test_gateway_e2e import error_of, post
from tests.polling import until_awaited

pytestmark = pytest.mark.integration

POLICY = TEST_POLICY.replace("max_in_flight_per_backend: 1", "max_in_flight_per_backend: 64")
POLICY = POLICY.replace(
    "    queue_limit: 8\n    queue_deadline_s: 60\n",
    "    queue_limit: 8\n    queue_deadline_s: 60\n    preemptible: true\n",
)
BATCH_TOKENS = 400  # ~22 s of the only seat at ~55 ms a step: far longer than any wait below


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    assert "preemptible: true" in POLICY
    sim_args = (*SIM_ARGS, "--max-num-seqs", "1")
    group, running = start_stack(tmp_path_factory.mktemp("preempt"), POLICY, sim_args=sim_args)
    try:
        yield running
    finally:
        group.stop()


async def _engine_gauge(stack: Stack, name: str, label: str = "") -> float:
    return await _sum_of(f"http://{stack.backends[0].address}/metrics", name, label)


async def _learned_one_seat(stack: Stack) -> bool:
    """Whether the gateway has learned the engine's single seat (until it does, it plans
    with a fallback that grows past what it saw running)."""
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    return await _sum_of(url, "fairlane_backend_seats{") == 1 and (
        await _sum_of(url, "fairlane_backend_seats{")
        == await _sum_of(url, "fairlane_backend_seats{", 'source="learned"')
    )


async def _sum_of(url: str, name: str, label: str = "") -> float:
    """The sum of the samples whose line starts with ``name`` (and has ``label``) on a
    Prometheus page."""
    async with aiohttp.ClientSession() as session, session.get(url) as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and label in line
    )


async def _until(
    what: str, condition: Callable[[], Awaitable[object]], timeout_s: float = 20
) -> None:
    await until_awaited(condition, what, timeout_s)


async def _seat_taken_by_batch(
    stack: Stack, stream: bool
) -> asyncio.Task[tuple[int, dict[str, str], bytes]]:
    """Start a long batch request and wait until the engine runs it, with the gateway
    knowing the engine's single seat.

    The seat is learned from the engine (``extproc.fleet.seats``): while it is not, a short
    request goes first, so the long one waits inside vLLM until the seat is learned."""
    if not await _learned_one_seat(stack):
        teacher = asyncio.create_task(post(stack, chat(max_tokens=40), auth("sk-batch-demo")))

        async def teacher_running() -> bool:
            return await _engine_gauge(stack, "vllm:num_requests_running") >= 1

        # on the seat before the long one is sent, or the long one would take it first
        await _until("the short request to run on the engine", teacher_running)
    else:
        teacher = None
    body = chat(max_tokens=BATCH_TOKENS, stream=stream)
    task: asyncio.Task[tuple[int, dict[str, str], bytes]] = asyncio.create_task(
        post(stack, body, auth("sk-batch-demo"), timeout=60)
    )

    await _until("the gateway to learn the engine's single seat", lambda: _learned_one_seat(stack))
    if teacher is not None:
        assert (await teacher)[0] == 200

    async def running_alone() -> bool:
        engine = (
            await _engine_gauge(stack, "vllm:num_requests_running"),
            await _engine_gauge(stack, "vllm:num_requests_waiting"),
        )
        return engine == (1, 0)

    await _until("the long batch request to run alone on the engine", running_alone)
    if not stream:  # the gateway can cancel it once its forward is sent, and says so
        url = f"http://127.0.0.1:{stack.metrics_port}/metrics"

        async def cancellable() -> bool:
            return await _sum_of(url, "fairlane_backend_cancellable{") == 1

        await _until("the gateway to count the batch request as cancellable", cancellable)
    return task


async def test_chat_preempts_a_running_non_streamed_batch_request(stack: Stack) -> None:
    batch = await _seat_taken_by_batch(stack, stream=False)
    started = time.monotonic()
    status, _, body = await post(stack, chat(max_tokens=4), auth("sk-chat-demo"))
    chat_s = time.monotonic() - started
    assert status == 200, body
    # The seat was given up at once: nowhere near the ~20 s the batch request had left.
    assert chat_s < 5, f"chat took {chat_s:.2f}s: it waited for the batch request"
    batch_status, batch_headers, batch_body = await batch
    assert batch_status == 503, batch_body
    assert error_of(batch_body)["code"] == "preempted"
    assert int(batch_headers["retry-after"]) >= 1

    # vLLM counts no finished request for a client that left: the cancelled request shows
    # as the engine's running set emptying (chat is done), seconds before it would finish.
    async def idle() -> bool:
        return await _engine_gauge(stack, "vllm:num_requests_running") == 0

    await _until("the engine to drop the cancelled request", idle, timeout_s=5)
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    assert await _sum_of(url, "fairlane_requests_shed_total{", 'reason="preempted"') >= 1


async def test_a_streamed_batch_request_is_never_preempted(stack: Stack) -> None:
    async def idle() -> bool:
        return await _engine_gauge(stack, "vllm:num_requests_running") == 0

    await _until("the engine to be idle", idle)
    batch = await _seat_taken_by_batch(stack, stream=True)
    finished: list[str] = []
    batch.add_done_callback(lambda _: finished.append("batch"))
    chat_task = asyncio.create_task(post(stack, chat(max_tokens=4), auth("sk-chat-demo")))
    chat_task.add_done_callback(lambda _: finished.append("chat"))
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"

    async def chat_waits() -> bool:  # held by the gateway, or queued in the engine
        held = await _sum_of(url, "fairlane_queue_depth{", 'tier="interactive"')
        return held + await _engine_gauge(stack, "vllm:num_requests_waiting{") >= 1

    await _until("the chat request to wait for the seat", chat_waits)
    batch_status, _, batch_body = await batch
    assert batch_status == 200
    assert b"[DONE]" in batch_body  # the whole stream, to its end
    status, _, body = await chat_task
    assert status == 200, body
    assert finished == ["batch", "chat"], "chat took the streamed request's seat"
