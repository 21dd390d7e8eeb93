"""Three service replicas sharing a real Redis, behind the real Envoy: what their users see.

``fairlane up --replicas 3``'s stack (``Stack(StackConfig(replicas=3))``): a local
``redis-server`` (``scripts/setup-tools`` installs Debian's), three ``fairlane serve
--state redis://...`` processes, Envoy listing all three, and simulated vLLM. Faults are
injected into that stack while a bounded load runs: a replica SIGKILLed, Redis stopped and
started again empty. Every test waits for the condition it needs (requests held on the
replica it kills, leases in Redis), never for a lucky moment.
"""

from __future__ import annotations

import asyncio
import statistics
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import aiohttp
import pytest
import redis

from extproc.ops.processes import ProcessGroup, free_port
from extproc.ops.redis_server import start_redis
from extproc.ops.up import Stack, StackConfig
from extproc.state.exchange import PREFIX
from extproc.state.replica import TTL_S
from extproc.wire import EXTPROC_CLUSTER
from tests.exported_metrics import Samples, parse_samples
from tests.integration.conftest import SIM_ARGS, TEST_POLICY, auth, chat, start_stack
from tests.polling import until as poll_until

until = partial(poll_until, every_s=0.02)
"""Every 20 ms: the rejoin time below is measured at that grain."""

pytestmark = pytest.mark.integration

# One engine of 2 seats (the cap), batch queues deep enough for a small flood, and an
# interactive queue that three chat clients never fill: the fleet-wide depth adds the other
# replicas' last reports, which lag by an exchange period (around Redis coming back, 2 of
# 113 chats once got 429 queue_full with a limit of 4), and these tests are about replicas
# and Redis, not that limit.
REPLICA_POLICY = (
    TEST_POLICY.replace("max_in_flight_per_backend: 1", "max_in_flight_per_backend: 2")
    .replace(
        "queue_limit: 8\n    queue_deadline_s: 60", "queue_limit: 32\n    queue_deadline_s: 60"
    )
    .replace(
        "queue_limit: 4\n    queue_deadline_s: 30", "queue_limit: 16\n    queue_deadline_s: 30"
    )
)
assert "queue_limit: 16" in REPLICA_POLICY
# Two tenants of the api tier for the fairness test: one floods, one sends a request at a time.
FAIRNESS_POLICY = REPLICA_POLICY.replace(
    "queue_limit: 1\n    queue_deadline_s: 1.5", "queue_limit: 64\n    queue_deadline_s: 60"
).replace(
    "tenants:\n",
    "tenants:\n"
    "  - name: heavy\n    api_keys: [sk-heavy]\n    tiers: [api]\n"
    "  - name: light\n    api_keys: [sk-light]\n    tiers: [api]\n",
)
SEATS = ("--max-num-seqs", "2")


@pytest.fixture
def replicas_stack(tmp_path: Path) -> Iterator[Stack]:
    group, stack = start_stack(tmp_path, REPLICA_POLICY, sim_args=(*SIM_ARGS, *SEATS), replicas=3)
    try:
        yield stack
    finally:
        group.stop()


def metrics(stack: Stack, replica: str) -> Samples:
    url = stack.services.find(replica).metrics_url if stack.services else ""
    with urllib.request.urlopen(url, timeout=5) as response:
        return parse_samples(response.read().decode())


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


Outcome = tuple[float, float, int, bytes]
"""(started, finished, status, body) on the loop's clock."""


async def post(session: aiohttp.ClientSession, stack: Stack, key: str, body: dict) -> Outcome:
    loop = asyncio.get_running_loop()
    started = loop.time()
    url = f"{stack.url}/v1/chat/completions"
    async with session.post(url, json=body, headers=auth(key)) as response:
        text = await response.read()
    return started, loop.time(), response.status, text


async def test_a_killed_replicas_held_requests_get_a_503_within_a_second(
    replicas_stack: Stack,
) -> None:
    """Twelve long batch requests against two seats, so that every replica holds some; r2
    is SIGKILLed before any can finish (a request takes over 3 s, the kill comes as soon as
    the metrics show all twelve placed). What r2 held gets Envoy's 503
    ``gateway_unavailable`` within a second, never a hang; everything else, what r2 had
    admitted included (Envoy carries it), is served; r2's leases leave Redis within their
    TTL, and the others stop counting r2."""
    stack = replicas_stack
    loop = asyncio.get_running_loop()

    def placed() -> tuple[float, float]:
        """(all batch requests queued or in flight on every replica, r2's queued)."""
        total, held = 0.0, 0.0
        for replica in ("r1", "r2", "r3"):
            samples = metrics(stack, replica)
            queued = sample(samples, "fairlane_queue_depth", tier="batch")
            total += queued + sample(samples, "fairlane_tier_in_flight", tier="batch")
            held = queued if replica == "r2" else held
        return total, held

    async with aiohttp.ClientSession() as session:
        started = loop.time()
        flood = [
            asyncio.create_task(post(session, stack, "sk-batch-demo", chat(f"b{i}", 60)))
            for i in range(12)
        ]
        await until(
            lambda: placed()[0] == 12 and placed()[1] >= 1,
            timeout_s=2.0,
            what="all twelve placed, r2 holding some",
        )
        held = placed()[1]
        stack.kill_replica("r2")
        killed_at = loop.time()
        assert killed_at - started < 3.0, "a request may have finished: the test is void"
        assert stack.services is not None and stack.services.redis_url is not None
        client = redis.Redis.from_url(stack.services.redis_url)
        try:
            await until(
                lambda: not client.exists(f"{PREFIX}report:r2"),
                timeout_s=TTL_S + 0.2 - (loop.time() - killed_at),
                what="r2's leases expire in Redis within their TTL",
            )
        finally:
            client.close()
        await until(
            lambda: sample(metrics(stack, "r1"), "fairlane_state_replicas") == 2,
            timeout_s=0.5,
            what="r1 counts two replicas",
        )
        outcomes = await asyncio.wait_for(asyncio.gather(*flood), timeout=60)
    failed = [o for o in outcomes if o[2] != 200]
    assert 1 <= len(failed) <= held, f"{len(failed)} failed, r2 held {held}"
    for _, finished, status, body in failed:
        assert status == 503 and b"gateway_unavailable" in body, (status, body)
        assert finished - killed_at < 1.0, f"answered {finished - killed_at:.2f} s after the kill"


async def test_redis_stopped_then_started_empty_fails_no_request(
    tmp_path: Path, replicas_stack: Stack
) -> None:
    """A steady load of short chat requests; Redis is SIGKILLed for three seconds and then
    started again, empty, on the same port. No request fails; every replica is cut off
    (scheduling alone on 1/3 of each backend) while it is down, and shares state again, with
    all three replicas rebuilt, within a second of its return."""
    stack = replicas_stack
    services = stack.services
    assert services is not None and services.redis is not None and services.redis_url
    redis_port = services.redis_port
    assert redis_port is not None
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + 9.0
    outcomes: list[Outcome] = []
    async with aiohttp.ClientSession() as session:

        async def client(key: str) -> None:
            while loop.time() < stop_at:
                outcomes.append(await post(session, stack, key, chat("hi", 2)))

        load = asyncio.gather(*(client("sk-chat-demo") for _ in range(3)))
        await asyncio.sleep(2.0)
        services.redis.popen.kill()
        services.redis.popen.wait()
        await until(
            lambda: all(
                sample(metrics(stack, r), "fairlane_state_shared") == 0 for r in ("r1", "r2", "r3")
            ),
            timeout_s=2.0,
            what="every replica cut off",
        )
        await asyncio.sleep(3.0)
        with ProcessGroup(tmp_path / "redis-again") as group:
            start_redis(group, redis_port)
            rejoined_in = await until(
                lambda: all(
                    sample(metrics(stack, r), "fairlane_state_shared") == 1
                    and sample(metrics(stack, r), "fairlane_state_replicas") == 3
                    for r in ("r1", "r2", "r3")
                ),
                timeout_s=1.0,
                what="every replica shares state again, all three seen",
            )
            await load
    statuses = [o[2] for o in outcomes]
    failed = [o[3][:200] for o in outcomes if o[2] != 200]
    assert statuses and set(statuses) == {200}, (
        f"{statuses.count(200)} of {len(statuses)} ok",
        failed,
    )
    assert rejoined_in < 1.0
    for replica in ("r1", "r2", "r3"):
        assert sample(metrics(stack, replica), "fairlane_state_cut_offs_total") == 1


async def test_a_light_tenant_is_served_fairly_across_replicas(tmp_path: Path) -> None:
    """Tenant ``heavy`` keeps 12 requests outstanding against 2 seats, tenant ``light`` one
    at a time; Envoy spreads both over three replicas. FIFO would make a light request wait
    for about six heavy ones (6x its latency alone); VTC over the fleet keeps the wait near
    one. Measured: median 2.2x, worst 3.1-4.1x (one process: 1.8x and 2.2x). Before a
    replica left room to one whose next flow was owed clearly more, a light request waited
    6.4 s (11x): each freed seat went to the replica whose request had finished, and a
    replica with nothing in flight hardly ever saw one. The median's bound sits between
    what fair sharing across replicas gives (2.0-2.6x over seven runs on 2026-11-25, on a
    quiet machine: a bound of 2.5x failed two of them, before and after that day's
    changes) and FIFO's 6x."""
    group, stack = start_stack(tmp_path, FAIRNESS_POLICY, sim_args=(*SIM_ARGS, *SEATS), replicas=3)
    with group:
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as session:
            body = chat("fair", 10)

            async def light(count: int) -> list[float]:
                latencies = []
                for _ in range(count):
                    started, finished, status, _ = await post(session, stack, "sk-light", body)
                    assert status == 200
                    latencies.append(finished - started)
                return latencies

            alone = statistics.median(await light(4))
            stop = loop.time() + 8.0

            async def heavy() -> None:
                while loop.time() < stop:
                    _, _, status, _ = await post(session, stack, "sk-heavy", body)
                    assert status == 200

            heavies = asyncio.gather(*(heavy() for _ in range(12)))
            await asyncio.sleep(1.0)  # heavy's backlog is queued on every replica
            loaded = await light(8)
            await heavies
    assert statistics.median(loaded) <= 3.5 * alone, (alone, loaded)
    assert max(loaded) <= 6.0 * alone, (alone, loaded)


async def test_a_killed_replica_fails_no_request_it_did_not_hold(tmp_path: Path) -> None:
    """Three replicas behind the real Envoy (``fairlane up --replicas 3``'s stack), a steady
    load of short requests, one replica SIGKILLed: no request started after the kill fails
    (Envoy opens a stream the dead replica cannot take on another one, and health checks
    and outlier detection take it out), the only failures allowed are Envoy's 503s for
    requests already in flight at the kill, and within two seconds Envoy counts two
    healthy replicas."""
    config = StackConfig(
        port=free_port(),
        replicas=3,
        sim_args=("--scheduling-policy", "priority", "--speedup", "10"),
    )
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack(config, group).start()
        results: list[tuple[float, int, bytes]] = []
        body = {
            "model": "sim-llama-8b",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
        }
        headers = {"authorization": "Bearer sk-chat-demo"}
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + 5.0
        async with aiohttp.ClientSession() as session:

            async def client() -> None:
                while loop.time() < stop_at:
                    started = loop.time()
                    url = f"{stack.url}/v1/chat/completions"
                    async with session.post(url, json=body, headers=headers) as response:
                        results.append((started, response.status, await response.read()))

            async def kill_after(delay: float) -> float:
                await asyncio.sleep(delay)
                stack.kill_replica("r2")
                return loop.time()

            killer = asyncio.create_task(kill_after(2.0))
            await asyncio.gather(*(client() for _ in range(4)))
            killed_at = await killer
            await asyncio.sleep(max(0.0, killed_at + 2.0 - loop.time()))
            async with session.get(f"{stack.admin_url}/clusters") as response:
                clusters_text = await response.text()

    after = [status for started, status, _ in results if started >= killed_at]
    assert after and set(after) == {200}, f"{after.count(200)} of {len(after)} after the kill"
    failed = [(started, status, text) for started, status, text in results if status != 200]
    for started, status, text in failed:
        assert started < killed_at and status == 503 and b"gateway_unavailable" in text
    assert len(failed) <= 4  # at most the requests in flight at the kill
    assert len([r for r in results if r[0] < killed_at and r[1] == 200]) > 20
    healthy = [
        line
        for line in clusters_text.splitlines()
        if line.startswith(f"{EXTPROC_CLUSTER}::") and line.endswith("::health_flags::healthy")
    ]
    assert len(healthy) == 2, clusters_text
