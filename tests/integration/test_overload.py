"""Overload shedding through the real Envoy: the service's runtime layer reaches Envoy, and
a shed request is answered by Envoy itself (503, an OpenAI error, retry-after) without
reaching the service or the backend, on a connection that stays open.

Shedding is forced through Envoy's admin layer (``/runtime_modify``), which overrides the
service's RTDS layer: loading the service to real overload on a shared test machine would
make the test slow and its outcome depend on the machine.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from extproc.core.gateway import OVERLOAD_RETRY_AFTER_S
from extproc.ops.up import Stack
from extproc.wire import RUNTIME_LAYER, SHED_RUNTIME_KEY
from tests.integration.conftest import auth, backend_requests, chat

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
WAIT_S = 20.0


async def runtime(stack: Stack) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{stack.admin_url}/runtime") as r:
        assert r.status == 200
        payload: dict[str, Any] = await r.json(content_type=None)
        return payload


async def shed_entry(stack: Stack) -> dict[str, Any] | None:
    entry: dict[str, Any] | None = (await runtime(stack)).get("entries", {}).get(SHED_RUNTIME_KEY)
    return entry


async def set_admin_override(stack: Stack, value: str) -> None:
    """``value`` in Envoy's admin layer; an empty value removes the override."""
    url = f"{stack.admin_url}/runtime_modify?{SHED_RUNTIME_KEY}={value}"
    async with aiohttp.ClientSession() as session, session.post(url) as r:
        assert r.status == 200, await r.text()


async def until_final_value(stack: Stack, value: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    entry = None
    while time.monotonic() < deadline:
        entry = await shed_entry(stack)
        if entry is not None and entry.get("final_value") == value:
            return entry
        await asyncio.sleep(0.05)
    raise AssertionError(f"{SHED_RUNTIME_KEY} never became {value!r}: {entry}")


def request_bytes(test_id: str) -> bytes:
    body = json.dumps(chat()).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\n"
        "host: fairlane\r\n"
        f"authorization: {auth('sk-chat-demo')['authorization']}\r\n"
        "content-type: application/json\r\n"
        f"x-test-id: {test_id}\r\n"
        f"content-length: {len(body)}\r\n"
        "\r\n"
    )
    return head.encode() + body


async def read_response(
    reader: asyncio.StreamReader,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a content-length (what a direct_response is)."""
    status_line = await reader.readline()
    assert status_line, "the connection was closed before a response"
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers["content-length"]))
    return status, headers, body


async def post_chat(stack: Stack, test_id: str) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(
            stack.url + CHAT,
            json=chat(),
            headers={**auth("sk-chat-demo"), "x-test-id": test_id},
        ) as r,
    ):
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


async def test_envoy_receives_the_services_runtime_layer(stack: Stack) -> None:
    entry = await until_final_value(stack, "0")
    layers = (await runtime(stack))["layers"]
    assert layers == [RUNTIME_LAYER, "admin"]
    # the value comes from the service's layer, not from an override
    assert entry["layer_values"] == ["0", ""]


async def test_forced_shedding_is_answered_by_envoy_on_a_kept_alive_connection(
    stack: Stack,
) -> None:
    await until_final_value(stack, "0")
    before = len(backend_requests(stack))
    try:
        await set_admin_override(stack, "100")
        await until_final_value(stack, "100")
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.config.port)
        try:
            for i in range(3):
                started = time.monotonic()
                writer.write(request_bytes(f"shed-{i}"))
                await writer.drain()
                status, headers, body = await asyncio.wait_for(read_response(reader), 5)
                elapsed = time.monotonic() - started
                assert status == 503, body
                error = json.loads(body)["error"]
                assert set(error) >= {"message", "type", "param", "code"}
                assert error["code"] == "gateway_overloaded"
                assert headers["retry-after"] == str(OVERLOAD_RETRY_AFTER_S)
                assert headers["content-type"] == "application/json"
                assert headers.get("connection", "").lower() != "close"
                assert "x-fairlane-tier" not in headers  # the service never saw it
                assert elapsed < 1.0, elapsed
            # the same connection answered all three: Envoy kept it open
            assert not reader.at_eof()
        finally:
            writer.close()
            await writer.wait_closed()
    finally:
        await set_admin_override(stack, "")
    await until_final_value(stack, "0")
    # Served again: and the backend's log shows this one right after what came before,
    # so none of the shed requests reached it.
    deadline = time.monotonic() + WAIT_S
    while True:
        status, headers, body = await post_chat(stack, "served")
        # The service's own layer may shed a share while a busy machine lags it: only
        # that 503 is retried, within the bound.
        shed = status == 503 and json.loads(body)["error"]["code"] == "gateway_overloaded"
        if not shed or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert status == 200, body
    assert headers["x-fairlane-tier"] == "interactive"
    seen = backend_requests(stack)[before:]
    assert [r["headers"].get("x-test-id") for r in seen] == ["served"], seen
