"""Token budgets through the real Envoy: 429 with OpenAI's headers once a tenant's budget is
spent, x-ratelimit-* on every admitted response, and the other tenants unaffected."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.ops.up import Stack
from tests.integration.conftest import TEST_POLICY, auth, backend_requests, chat, start_stack
from tests.integration.test_gateway_e2e import metric, post

pytestmark = pytest.mark.integration

POLICY = (
    TEST_POLICY.replace("max_in_flight_per_backend: 1", "max_in_flight_per_backend: 4")
    .replace(
        "    tiers: [interactive]\n",
        "    tiers: [interactive]\n"
        "    budget: {requests_per_minute: 3, tokens_per_minute: 100000}\n",
    )
    .replace("    tiers: [batch]\n", "    tiers: [batch]\n    budget: {tokens_per_minute: 60}\n")
)
RESET = re.compile(r"^(\d+ms|\d+s|\d+m\d+s)$")
LIMIT_HEADERS = {
    f"x-ratelimit-{what}-{kind}"
    for what in ("limit", "remaining", "reset")
    for kind in ("requests", "tokens")
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    assert "budget: {requests_per_minute: 3" in POLICY and "tokens_per_minute: 60}" in POLICY
    group, running = start_stack(Path(tmp_path_factory.mktemp("budgets")), POLICY)
    try:
        yield running
    finally:
        group.stop()


async def test_over_budget_is_a_429_with_openais_headers_and_others_are_served(
    stack: Stack,
) -> None:
    for left in (2, 1, 0):
        status, headers, _ = await post(stack, chat(), auth("sk-chat-demo"))
        assert status == 200
        assert set(headers) >= LIMIT_HEADERS, headers
        assert headers["x-ratelimit-limit-requests"] == "3"
        assert headers["x-ratelimit-remaining-requests"] == str(left)
        assert headers["x-ratelimit-limit-tokens"] == "100000"
        assert 0 < int(headers["x-ratelimit-remaining-tokens"]) < 100000
        assert RESET.match(headers["x-ratelimit-reset-requests"]), headers
        assert RESET.match(headers["x-ratelimit-reset-tokens"]), headers
    sent = len(backend_requests(stack))
    status, headers, body = await post(stack, chat(), auth("sk-chat-demo"))
    assert status == 429
    error = json.loads(body)["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert "requests per minute: limit 3, used 3" in error["message"]
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert set(headers) >= LIMIT_HEADERS, headers
    # Another tenant, without a budget: served, and no rate-limit headers.
    status, headers, _ = await post(stack, chat(), auth("sk-api-demo"))
    assert status == 200 and not LIMIT_HEADERS & set(headers), headers
    assert len(backend_requests(stack)) == sent + 1  # the refused request never reached it
    rejections = await metric(
        stack, "fairlane_budget_rejections_total", limit="requests_per_minute", tenant="chat-app"
    )
    assert rejections == 1
    used = await metric(
        stack, "fairlane_budget_used_ratio", limit="requests_per_minute", tenant="chat-app"
    )
    assert 0.9 < used <= 1  # three requests of three, draining at three a minute since


async def test_a_request_larger_than_the_token_budget_never_fits(stack: Stack) -> None:
    status, headers, body = await post(stack, chat(max_tokens=500), auth("sk-batch-demo"))
    assert status == 429
    assert "can never fit" in json.loads(body)["error"]["message"]
    assert headers["x-ratelimit-limit-tokens"] == "60"
    status, headers, _ = await post(stack, chat(max_tokens=4), auth("sk-batch-demo"))
    assert status == 200
    assert headers["x-ratelimit-limit-tokens"] == "60"
    assert "x-ratelimit-limit-requests" not in headers  # it has no requests limit
