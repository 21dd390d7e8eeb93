"""HTTP through the real Envoy, the ext_proc service and a simulated vLLM (issue: gateway core)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.ops.up import Stack
from tests.integration.conftest import TEST_POLICY, auth, backend_requests, chat, start_stack
from tests.polling import until_awaited

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


async def post(
    stack: Stack, body: Any, headers: dict[str, str], path: str = CHAT, timeout: float = 30
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **headers}
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with (
        aiohttp.ClientSession(timeout=client_timeout) as session,
        session.post(stack.url + path, data=data, headers=headers) as r,
    ):
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


async def metric(stack: Stack, name: str, **labels: str) -> float:
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as r:
        text = await r.text()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}}") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def metric_reaches(
    stack: Stack, value: float, name: str, timeout_s: float = 10.0, **labels: str
) -> None:
    """Until the gateway's ``name`` metric reads ``value``: the state a test needs before it
    goes on, polled rather than slept for."""

    async def reached() -> bool:
        return await metric(stack, name, **labels) == value

    await until_awaited(reached, f"{name}{labels} == {value:g}", timeout_s)


async def in_flight_reaches(stack: Stack, value: float, timeout_s: float = 10.0) -> None:
    """Until the (only) backend has ``value`` requests released to it and not finished."""
    backend = stack.backends[0]
    await metric_reaches(
        stack,
        value,
        "fairlane_backend_in_flight",
        timeout_s,
        backend=backend.address,
        region=backend.region,
    )


async def wait_idle(stack: Stack, timeout: float = 20) -> None:
    """Until the gateway has nothing in flight (earlier tests' long requests finished)."""
    await in_flight_reaches(stack, 0, timeout)


async def fill_the_fleet(stack: Stack) -> asyncio.Task[tuple[int, dict[str, str], bytes]]:
    """Occupy the only backend slot with a ~3 s batch request; return its task."""
    await wait_idle(stack)
    task = asyncio.create_task(post(stack, chat(max_tokens=60), auth("sk-batch-demo")))
    await in_flight_reaches(stack, 1)  # the filler admitted
    return task


def error_of(body: bytes) -> dict[str, Any]:
    payload = json.loads(body)
    assert set(payload["error"]) >= {"message", "type", "param", "code"}, payload
    return payload["error"]


async def test_non_streamed_chat_completion(stack: Stack) -> None:
    status, headers, body = await post(stack, chat(), auth("sk-chat-demo"))
    assert status == 200, body
    payload = json.loads(body)
    assert payload["object"] == "chat.completion"
    assert payload["usage"]["completion_tokens"] == 4
    assert headers["x-fairlane-tier"] == "interactive"
    assert int(headers["x-fairlane-queue-ms"]) >= 0


async def test_streamed_chat_completion(stack: Stack) -> None:
    status, headers, body = await post(stack, chat(stream=True), auth("sk-chat-demo"))
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    events = [
        line[len("data: ") :] for line in body.decode().splitlines() if line.startswith("data: ")
    ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert headers["x-fairlane-tier"] == "interactive"


async def test_backend_sees_injected_priority_and_no_spoofed_headers(stack: Stack) -> None:
    before = len(backend_requests(stack))
    spoofed = {
        **auth("sk-api-demo"),
        "x-vllm-priority": "-1000",
        "x-gateway-destination-endpoint": "203.0.113.7:80",
        "x-fairlane-tier": "interactive",
        "x-priority": "normal",
        "x-user-id": "dana",
    }
    status, headers, body = await post(stack, chat(priority=-1000), spoofed)
    assert status == 200, body
    assert headers["x-fairlane-tier"] == "api"
    (seen,) = backend_requests(stack)[before:]
    assert seen["priority"] == 10
    assert seen["body_priority"] == 10
    assert seen["headers"]["x-vllm-priority"] == "10"
    assert seen["headers"]["x-fairlane-tier"] == "api"
    for name in ("authorization", "x-priority"):
        assert name not in seen["headers"]
    assert seen["prompt_tokens"] > 0


async def test_batch_path_is_rewritten_for_the_backend(stack: Stack) -> None:
    before = len(backend_requests(stack))
    status, headers, _ = await post(
        stack, chat(), auth("sk-batch-demo"), path="/v1/batch/chat/completions"
    )
    assert status == 200
    assert headers["x-fairlane-tier"] == "batch"
    (seen,) = backend_requests(stack)[before:]
    assert seen["path"] == "/v1/chat/completions"
    assert seen["priority"] == 20


async def test_asking_above_the_key_is_served_at_the_allowed_tier(stack: Stack) -> None:
    status, headers, _ = await post(stack, chat(), {**auth("sk-batch-demo"), "x-priority": "high"})
    assert status == 200
    assert headers["x-fairlane-tier"] == "batch"


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (chat(), {}, 401, "invalid_api_key"),
        (chat(), auth("sk-nobody"), 401, "invalid_api_key"),
        (b'{"model": "sim-model", "messages": [', auth("sk-chat-demo"), 400, None),
        (chat(), {**auth("sk-chat-demo"), "x-priority": "platinum"}, 400, None),
        (chat(content="x" * 70_000), auth("sk-chat-demo"), 413, None),
    ],
    ids=["no-key", "unknown-key", "malformed-json", "unknown-tier", "too-large"],
)
async def test_bad_input_is_refused_without_reaching_a_backend(
    stack: Stack, body: Any, headers: dict[str, str], status: int, code: str | None
) -> None:
    before = len(backend_requests(stack))
    got, response_headers, payload = await post(stack, body, headers)
    assert got == status, payload
    assert response_headers["content-type"] == "application/json"
    error = error_of(payload)
    if code:
        assert error["code"] == code
    assert len(backend_requests(stack)) == before
    # ...and the very next request is served
    ok, _, _ = await post(stack, chat(), auth("sk-chat-demo"))
    assert ok == 200


async def raw_request(stack: Stack, head: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.config.port)
    try:
        writer.write(head)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()


async def test_non_utf8_header_is_a_clear_400(stack: Stack) -> None:
    body = json.dumps(chat()).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        b"authorization: Bearer sk-chat-demo\r\ncontent-type: application/json\r\n"
        b"x-note: caf\xe9\xff\r\n"
        + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
        + body
    )
    response = await raw_request(stack, head)
    assert response.startswith(b"HTTP/1.1 400"), response[:200]
    assert b"x-note" in response


async def test_huge_headers_are_refused_with_431(stack: Stack) -> None:
    head = (
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-chat-demo\r\n"
        + b"x-big: "
        + b"a" * 200_000
        + b"\r\nconnection: close\r\n\r\n"
    )
    response = await raw_request(stack, head)
    assert response.startswith(b"HTTP/1.1 431"), response[:200]


async def test_models_listing_needs_a_key(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(stack.url + "/v1/models", headers=auth("sk-chat-demo")) as r:
            assert r.status == 200
            assert (await r.json())["data"][0]["id"] == "sim-model"
        async with session.get(stack.url + "/v1/models") as r:
            assert r.status == 401


async def test_held_request_is_released_when_capacity_frees(stack: Stack) -> None:
    filler = await fill_the_fleet(stack)
    status, headers, body = await post(stack, chat(), auth("sk-chat-demo"))
    assert status == 200, body
    assert int(headers["x-fairlane-queue-ms"]) > 300  # it waited for the filler
    assert filler.done() and (await filler)[0] == 200


async def test_full_queue_is_429_with_retry_after(stack: Stack) -> None:
    filler = await fill_the_fleet(stack)
    held = asyncio.create_task(post(stack, chat(), auth("sk-api-demo")))  # fills api's queue of 1
    await metric_reaches(stack, 1, "fairlane_queue_depth", tier="api")
    status, headers, body = await post(stack, chat(), auth("sk-api-demo"))
    assert status == 429, body
    assert int(headers["retry-after"]) >= 1
    assert error_of(body)["code"] == "queue_full"
    await asyncio.gather(filler, held)


async def test_queue_deadline_is_503(stack: Stack) -> None:
    filler = await fill_the_fleet(stack)
    started = time.monotonic()
    status, _, body = await post(stack, chat(), auth("sk-api-demo"))  # api deadline: 1.5 s
    waited = time.monotonic() - started
    assert status == 503, body
    assert error_of(body)["code"] == "queue_deadline_exceeded"
    assert 1.4 < waited < 5
    await filler


async def test_client_disconnect_while_held_leaves_the_queue(stack: Stack) -> None:
    filler = await fill_the_fleet(stack)
    before = len(backend_requests(stack))
    with pytest.raises(asyncio.TimeoutError):
        await post(stack, chat(), {**auth("sk-chat-demo"), "x-user-id": "leaver"}, timeout=0.5)
    await metric_reaches(stack, 0, "fairlane_queue_depth", tier="interactive")
    await filler
    # The next request of the tier takes the only slot after the leaver would have.
    status, _, _ = await post(stack, chat(), {**auth("sk-chat-demo"), "x-user-id": "next"})
    assert status == 200
    seen_users = [r["headers"].get("x-user-id") for r in backend_requests(stack)[before:]]
    assert "next" in seen_users and "leaver" not in seen_users


async def test_policy_hot_reload_applies_good_files_and_keeps_serving_on_bad_ones(
    tmp_path: Path,
) -> None:
    group, reloading = start_stack(tmp_path)
    try:
        policy = reloading.config.policy_path
        status, _, _ = await post(reloading, chat(), auth("sk-new-team"))
        assert status == 401
        policy.write_text(
            TEST_POLICY.replace("api_keys: [sk-api-demo]", "api_keys: [sk-api-demo, sk-new-team]")
        )
        assert await eventually_status(reloading, "sk-new-team", 200)

        broken = TEST_POLICY.replace("tiers: [batch]", "tiers: [platinum]")
        policy.write_text(broken)
        service_log = group.log_dir / "service.log"
        deadline = time.monotonic() + 10
        while "platinum" not in service_log.read_text() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        log_text = service_log.read_text()
        assert f"{policy}:" in log_text and "platinum" in log_text  # file:line: ... in the log
        # the previous (good) policy stays in force
        status, _, _ = await post(reloading, chat(), auth("sk-new-team"))
        assert status == 200
        status, headers, _ = await post(reloading, chat(), auth("sk-batch-demo"))
        assert status == 200 and headers["x-fairlane-tier"] == "batch"
    finally:
        group.stop()


async def eventually_status(stack: Stack, key: str, want: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, _, _ = await post(stack, chat(), auth(key))
        if status == want:
            return True
        await asyncio.sleep(0.2)
    return False


async def test_interactive_overtakes_a_queued_batch_backlog(stack: Stack) -> None:
    filler = await fill_the_fleet(stack)
    before = len(backend_requests(stack))
    backlog = [
        asyncio.create_task(
            post(stack, chat(), {**auth("sk-batch-demo"), "x-user-id": f"batch-job-{i}"})
        )
        for i in range(3)
    ]
    await metric_reaches(stack, 3, "fairlane_queue_depth", tier="batch")
    status, headers, _ = await post(stack, chat(), {**auth("sk-chat-demo"), "x-user-id": "human"})
    assert status == 200 and headers["x-fairlane-tier"] == "interactive"
    await asyncio.gather(filler, *backlog)
    order = [r["headers"].get("x-user-id", "") for r in backend_requests(stack)[before:]]
    first = order.index("human")
    batch_positions = [i for i, user in enumerate(order) if user.startswith("batch-job-")]
    assert len(batch_positions) == 3
    assert first < min(batch_positions)  # it arrived last but reached the backend first


async def test_hundreds_of_clients_leaving_while_queued_leave_nothing_behind(
    tmp_path: Path,
) -> None:
    policy = TEST_POLICY.replace("queue_limit: 8", "queue_limit: 1000")
    group, crowded = start_stack(tmp_path, policy)
    try:
        filler = await fill_the_fleet(crowded)
        leavers = 400

        async def leave(i: int) -> bool:
            """Queue a batch request, then go away; False if the gateway refused it."""
            # Paced over a second: 400 at once would be an overload of the service itself,
            # answered by turning requests away (tests/integration/test_overload.py).
            await asyncio.sleep(i / leavers)
            headers = {**auth("sk-batch-demo"), "x-user-id": f"leaver-{i}"}
            try:
                status, _, _ = await post(crowded, chat(), headers, timeout=1.0)
            except TimeoutError:
                return True
            assert status in (429, 503), status  # refused, never served
            return False

        left = sum(await asyncio.gather(*(leave(i) for i in range(leavers))))
        assert left >= leavers // 2, f"only {left} of {leavers} were queued when they left"
        deadline = time.monotonic() + 10
        while await metric(crowded, "fairlane_queue_depth", tier="batch") and (
            time.monotonic() < deadline
        ):
            await asyncio.sleep(0.1)
        assert await metric(crowded, "fairlane_queue_depth", tier="batch") == 0
        assert (await filler)[0] == 200
        await wait_idle(crowded)  # the filler's slot came back; no leaver holds one
        status, _, _ = await post(crowded, chat(), auth("sk-chat-demo"))
        assert status == 200  # and took the slot after any leaver would have
        seen = [r["headers"].get("x-user-id", "") for r in backend_requests(crowded)]
        assert not [user for user in seen if user.startswith("leaver-")]
    finally:
        group.stop()
