"""The gateway's metrics, read back after traffic through the real Envoy (issue: observability).

One stack per module: a chat tier with an SLO, an api tier that sheds everything (queue
limit 0), per-user fairness flows, and a simulated vLLM. Requests go through Envoy; the
numbers come back from the service's ``/metrics`` as Prometheus would read them, including
the ones that only the completion feedback (Envoy's gRPC access log) can fill in.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest

from extproc.fleet.seats import FALLBACK_SEATS
from extproc.ops.up import Stack
from tests.exported_metrics import Samples, parse_samples
from tests.integration.conftest import auth, chat, start_stack

pytestmark = pytest.mark.integration

POLICY = """\
max_in_flight_per_backend: 8
user_header: x-user-id
fairness: {flow: user}
tiers:
  - name: interactive
    priority: 0
    queue_limit: 64
    queue_deadline_s: 30
    slo_ttft_ms: 500
    slo_latency_s: 5
  - name: api
    priority: 10
    queue_limit: 0
    queue_deadline_s: 5
tenants:
  - name: chat-app
    api_keys: [sk-chat-demo]
    tiers: [interactive]
  - name: code-review
    api_keys: [sk-api-demo]
    tiers: [api]
"""
CHATS = 12


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    group, running = start_stack(tmp_path_factory.mktemp("metrics"), POLICY)
    try:
        yield running
    finally:
        group.stop()


async def scrape(session: aiohttp.ClientSession, stack: Stack) -> Samples:
    async with session.get(f"http://127.0.0.1:{stack.metrics_port}/metrics") as r:
        assert r.status == 200
        return parse_samples(await r.text())


def get(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def send(
    session: aiohttp.ClientSession, stack: Stack, key: str, user: str, stream: bool = False
) -> int:
    body = chat(max_tokens=4, stream=stream)
    headers = {**auth(key), "x-user-id": user}
    async with session.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers) as r:
        await r.read()
        return r.status


async def test_traffic_through_envoy_shows_up_in_every_family(stack: Stack) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        # A scraper hammering /metrics all along: scrapes run on the service's loop and must
        # neither fail nor hold up the requests.
        stop = asyncio.Event()

        async def scrape_all_along() -> int:
            count = 0
            while not stop.is_set():
                await scrape(session, stack)
                count += 1
            return count

        scraper = asyncio.create_task(scrape_all_along())
        chats = [
            send(session, stack, "sk-chat-demo", f"user-{i % 3}", stream=bool(i % 2))
            for i in range(CHATS)
        ]
        statuses = await asyncio.gather(*chats, send(session, stack, "sk-api-demo", "u"))
        assert await send(session, stack, "sk-nobody", "u") == 401
        stop.set()
        assert await scraper > 0
        assert statuses == [200] * CHATS + [429]

        # Completions arrive through the access log (flushed every 0.1 s).
        deadline = time.monotonic() + 10
        while True:
            samples = await scrape(session, stack)
            done = get(samples, "fairlane_request_duration_seconds_count", tier="interactive")
            if done >= CHATS or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)

    backend = stack.backends[0]
    where = {"backend": backend.address, "region": backend.region}
    assert (
        get(samples, "fairlane_requests_admitted_total", tier="interactive", model="sim-model")
        == CHATS
    )
    assert get(samples, "fairlane_queue_wait_seconds_count", tier="interactive") == CHATS
    assert get(samples, "fairlane_request_duration_seconds_count", tier="interactive") == CHATS
    assert get(samples, "fairlane_time_to_first_byte_seconds_count", tier="interactive") == CHATS
    # The access log's timings are the client's: at least the engine's few steps.
    mean = get(samples, "fairlane_request_duration_seconds_sum", tier="interactive") / CHATS
    assert 0.05 < mean < 10
    assert get(samples, "fairlane_requests_shed_total", tier="api", reason="queue_full") == 1
    assert (
        get(samples, "fairlane_requests_rejected_total", status="401", reason="invalid_api_key")
        == 1
    )
    assert get(samples, "fairlane_tier_slo_ttft_seconds", tier="interactive") == 0.5
    for user in ("user-0", "user-1", "user-2"):
        flow = f"chat-app/{user}"
        assert get(samples, "fairlane_flow_requests_total", tier="interactive", flow=flow) == 4
        assert (
            get(samples, "fairlane_flow_tokens_total", tier="interactive", flow=flow, kind="output")
            > 0
        )
    assert get(samples, "fairlane_picks_total", backend=backend.address, reason="only") == CHATS
    assert get(samples, "fairlane_backend_healthy", **where) == 1
    assert get(samples, "fairlane_backend_metrics_stale", **where) == 0
    assert get(samples, "fairlane_backend_metrics_age_seconds", **where) < 1.0
    assert ("fairlane_backend_kv_cache_usage_ratio", frozenset(where.items())) in samples
    assert get(samples, "fairlane_backend_in_flight", **where) == 0
    # one seats series for the backend: the simulator (256 seats) never queued, so the
    # fallback, grown a step past what it ran; the fleet caps it at the policy's 8
    seats = {
        labels: count
        for (name, labels), count in samples.items()
        if name == "fairlane_backend_seats"
    }
    assert len(seats) == 1, seats
    ((labels, count),) = seats.items()
    assert dict(labels) == {**where, "source": "fallback"}
    assert count >= FALLBACK_SEATS
    # a count not learned yet is being probed: the fleet reserves are shares of one more
    assert get(samples, "fairlane_fleet_seats") == min(count + 1, 8)
    for tier in ("interactive", "api"):  # no reserved_share: nothing reserved, still a series
        assert ("fairlane_tier_reserved_seats", frozenset({("tier", tier)})) in samples
        assert get(samples, "fairlane_tier_reserved_seats", tier=tier) == 0
    processed = get(samples, "fairlane_service_processing_seconds_count")
    assert processed == CHATS + 2  # every request the servicer answered, shed and refused too
    assert 0 < get(samples, "fairlane_service_processing_seconds_sum") / processed < 0.05


async def test_a_policy_edit_is_counted_as_a_reload(stack: Stack) -> None:
    policy = stack.config.policy_path
    assert policy is not None
    async with aiohttp.ClientSession() as session:
        before = await scrape(session, stack)
        policy.write_text(policy.read_text().replace("slo_ttft_ms: 500", "slo_ttft_ms: 400"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            after = await scrape(session, stack)
            if get(after, "fairlane_policy_reloads_total", result="ok") > get(
                before, "fairlane_policy_reloads_total", result="ok"
            ):
                break
            await asyncio.sleep(0.2)
        assert get(after, "fairlane_tier_slo_ttft_seconds", tier="interactive") == 0.4
        policy.write_text("tiers: [\n")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            after = await scrape(session, stack)
            if get(after, "fairlane_policy_reloads_total", result="error") >= 1:
                break
            await asyncio.sleep(0.2)
        assert get(after, "fairlane_policy_reloads_total", result="error") == 1
        assert get(after, "fairlane_tier_slo_ttft_seconds", tier="interactive") == 0.4  # kept
