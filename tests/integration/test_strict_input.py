"""Invalid bodies through the real Envoy: a 400 in OpenAI's shape, no backend contact, and the
service goes on serving."""

from __future__ import annotations

import json

import aiohttp
import pytest

from extproc.ops.up import Stack
from tests.integration.conftest import MODEL, auth, backend_requests, chat
from tests.integration.test_gateway_e2e import error_of, metric, post

pytestmark = pytest.mark.integration

GOOD = json.dumps(chat("hello")).encode()
CONTENT = b'{"model": "%s", "messages": [{"role": "user", "content": %s}], "max_tokens": 4}'

# (raw body, the field its error names)
INVALID = [
    (json.dumps({**chat(), "model": {"a": 1}}).encode(), "model"),
    (json.dumps({**chat(), "priority": {"a": 1}}).encode(), "priority"),
    (CONTENT % (MODEL.encode(), b'"hi \\ud800"'), "messages[0].content"),
    (GOOD.replace(b'"max_tokens": 4', b'"max_tokens": 4, "temperature": NaN'), "temperature"),
    (GOOD.replace(b'"max_tokens": 4', b'"max_tokens": Infinity'), "max_tokens"),
    (GOOD.replace(b'"max_tokens": 4', b'"max_tokens": ' + b"9" * 400), "max_tokens"),
    (CONTENT % (MODEL.encode(), b"42"), "messages[0].content"),
    (json.dumps({"model": MODEL, "prompt": [{"text": "hi"}]}).encode(), "prompt[0]"),
    (GOOD[:-7], None),  # truncated
]


@pytest.mark.parametrize(("raw", "param"), INVALID, ids=[str(i) for i in range(len(INVALID))])
async def test_invalid_bodies_are_400_and_never_reach_the_backend(
    stack: Stack, raw: bytes, param: str | None
) -> None:
    before = len(backend_requests(stack))
    status, headers, body = await post(stack, raw, auth("sk-chat-demo"))
    assert status == 400, body
    assert headers["content-type"] == "application/json"
    error = error_of(body)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert len(backend_requests(stack)) == before
    backend = stack.backends[0]
    labels = {"backend": backend.address, "region": backend.region}
    assert await metric(stack, "fairlane_backend_in_flight", **labels) == 0


async def test_the_service_serves_a_valid_request_after_the_invalid_ones(stack: Stack) -> None:
    for raw, _ in INVALID:
        status, _, _ = await post(stack, raw, auth("sk-api-demo"))
        assert status == 400
    before = len(backend_requests(stack))
    status, headers, body = await post(stack, GOOD, auth("sk-chat-demo"))
    assert status == 200, body
    assert headers["x-fairlane-tier"] == "interactive"
    assert len(backend_requests(stack)) == before + 1
    async with aiohttp.ClientSession() as session:
        health = f"http://127.0.0.1:{stack.metrics_port}/metrics"
        async with session.get(health) as r:
            assert r.status == 200
