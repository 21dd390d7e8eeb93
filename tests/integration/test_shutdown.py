"""Stopping the service under traffic, through the real Envoy.

SIGTERM starts a drain: new ext_proc streams are refused (Envoy fails them closed, 503), a
request already released upstream is untouched, and a request still held when the drain
time (10 s by default) runs out gets a JSON 503 with ``retry-after`` instead of a cut
stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from tests.integration.conftest import auth, chat, start_stack
from tests.integration.test_gateway_e2e import in_flight_reaches, metric_reaches
from tests.polling import until

pytestmark = pytest.mark.integration

# llama-8b-l4 steps take ~55 ms: 250 tokens hold the only slot for ~14 s, past the drain.
LONG_TOKENS = 250


async def post(
    session: aiohttp.ClientSession, url: str, key: str, max_tokens: int
) -> tuple[int, dict[str, str], bytes]:
    async with session.post(url, json=chat(max_tokens=max_tokens), headers=auth(key)) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


async def test_sigterm_drains_then_answers_held_requests_503(tmp_path: Path) -> None:
    group, stack = start_stack(tmp_path)
    try:
        (service,) = [c for c in group.children if c.name == "service"]
        url = f"{stack.url}/v1/chat/completions"
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            long_one = asyncio.create_task(post(session, url, "sk-batch-demo", LONG_TOKENS))
            await in_flight_reaches(stack, 1)  # admitted: the only slot is taken
            held = asyncio.create_task(post(session, url, "sk-chat-demo", 4))
            await metric_reaches(stack, 1, "fairlane_queue_depth", tier="interactive")
            assert not held.done()
            os.kill(service.popen.pid, signal.SIGTERM)
            stopped_at = time.monotonic()
            await until(
                lambda: "stopping: draining" in service.log_path.read_text(),
                "the service to start its drain",
            )
            refused, _, refused_body = await post(session, url, "sk-chat-demo", 4)

            status, headers, body = await held
            waited = time.monotonic() - stopped_at
            assert status == 503, body
            assert json.loads(body)["error"]["code"] == "gateway_restarting"
            assert headers["retry-after"] == "1"
            assert 9 < waited < 13  # the drain ran its 10 s, then the answer came at once
            # No new stream: Envoy fails the route closed with the filter's status_on_error.
            assert refused == 503 and b"gateway_restarting" not in refused_body

            status, _, body = await long_one  # already upstream: unaffected
            assert status == 200, body
            assert json.loads(body)["usage"]["completion_tokens"] == LONG_TOKENS
        assert service.popen.wait(10) == 0
    finally:
        group.stop()
