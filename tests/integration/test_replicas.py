"""Three service replicas sharing a real Redis, behind the real Envoy: what their users see.

``fairlane up --replicas 3``'s stack (``Stack(StackConfig(replicas=3))``): a local
``redis-server`` (``scripts/setup-tools`` installs Debian's), three ``fairlane serve
--state redis://...`` processes, Envoy listing all three (each client key's streams
hashed to one of them), and simulated vLLM. Faults are injected into that stack while a
bounded load runs: a replica SIGKILLed, Redis stopped and started again empty. Every test
waits for the condition it needs (requests held on the replica it kills, leases in Redis),
never for a lucky moment, and kills the replica that holds the key it loads, found from the
replicas' metrics (which replica a key hashes to depends on the ports).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import urllib.request
from collections.abc import Iterator, Sequence
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
HEAVY_KEYS = tuple(f"sk-heavy-{i}" for i in range(12))
# Two tenants of the api tier for the fairness test: one floods, one sends a request at a
# time. Each heavy client has a key of its own, so that heavy's requests spread over the
# replicas (a key's streams all go to one) and light's compete with them across replicas.
FAIRNESS_POLICY = REPLICA_POLICY.replace(
    "queue_limit: 1\n    queue_deadline_s: 1.5", "queue_limit: 64\n    queue_deadline_s: 60"
).replace(
    "tenants:\n",
    "tenants:\n"
    f"  - name: heavy\n    api_keys: [{', '.join(HEAVY_KEYS)}]\n    tiers: [api]\n"
    "  - name: light\n    api_keys: [sk-light]\n    tiers: [api]\n",
)
REPLICAS = ("r1", "r2", "r3")
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


def admitted(
    stack: Stack, tier: str, flow: str, replicas: Sequence[str] = REPLICAS
) -> dict[str, float]:
    """Each replica's (of ``replicas``) count of ``flow``'s admitted requests in ``tier``."""
    return {
        r: sample(metrics(stack, r), "fairlane_flow_requests_total", tier=tier, flow=flow)
        for r in replicas
    }


def holder(counts: dict[str, float]) -> str | None:
    """The one replica with a count, or None while there is none (or several)."""
    holding = [replica for replica, count in counts.items() if count]
    return holding[0] if len(holding) == 1 else None


Outcome = tuple[float, float, int, bytes]
"""(started, finished, status, body) on the loop's clock."""


async def post(session: aiohttp.ClientSession, stack: Stack, key: str, body: dict) -> Outcome:
    loop = asyncio.get_running_loop()
    started = loop.time()
    url = f"{stack.url}/v1/chat/completions"
    async with session.post(url, json=body, headers=auth(key)) as response:
        text = await response.read()
    return started, loop.time(), response.status, text


async def test_each_keys_requests_are_decided_by_one_replica(replicas_stack: Stack) -> None:
    """Envoy hashes each ext_proc stream on the client's key (Maglev): all of one tenant's
    requests meet in one replica's queue, the key sent as ``authorization`` or as
    ``x-api-key`` (the hash is of the header's value: a client that sends both ways lands on
    up to two replicas)."""
    stack = replicas_stack
    tenants = {
        "sk-chat-demo": ("interactive", "chat-app"),
        "sk-api-demo": ("api", "code-review"),
        "sk-batch-demo": ("batch", "nightly-batch"),
    }
    as_api_key = "sk-batch-demo"
    async with aiohttp.ClientSession() as session:
        url = f"{stack.url}/v1/chat/completions"
        for key in tenants:
            for _ in range(6):
                headers = {"x-api-key": key} if key == as_api_key else auth(key)
                async with session.post(url, json=chat("pin", 2), headers=headers) as response:
                    assert response.status == 200, await response.text()
    for key, (tier, flow) in tenants.items():
        counts = admitted(stack, tier, flow)
        assert sorted(counts.values()) == [0, 0, 6], (key, counts)


async def test_a_killed_replicas_held_requests_get_a_503_within_a_second(
    replicas_stack: Stack,
) -> None:
    """Twelve long batch requests of one key against two seats: the key's replica admits two
    and holds ten. It is SIGKILLed before any can finish (a request takes over 3 s, the kill
    comes as soon as its metrics show all twelve placed). What it held gets Envoy's 503
    ``gateway_unavailable`` within a second, never a hang; what it had admitted is served
    (Envoy carries it); its leases leave Redis within their TTL, and the others stop counting
    it."""
    stack = replicas_stack
    loop = asyncio.get_running_loop()

    def placed() -> tuple[str | None, float]:
        """(the replica holding all twelve batch requests, how many it holds queued)."""
        for replica in REPLICAS:
            samples = metrics(stack, replica)
            queued = sample(samples, "fairlane_queue_depth", tier="batch")
            if queued + sample(samples, "fairlane_tier_in_flight", tier="batch") == 12:
                return replica, queued
        return None, 0.0

    async with aiohttp.ClientSession() as session:
        started = loop.time()
        flood = [
            asyncio.create_task(post(session, stack, "sk-batch-demo", chat(f"b{i}", 60)))
            for i in range(12)
        ]
        await until(
            lambda: placed()[0] is not None and placed()[1] >= 1,
            timeout_s=2.0,
            what="all twelve placed on one replica, some held",
        )
        victim, held = placed()
        assert victim is not None
        survivor = next(r for r in REPLICAS if r != victim)
        stack.kill_replica(victim)
        killed_at = loop.time()
        assert killed_at - started < 3.0, "a request may have finished: the test is void"
        assert stack.services is not None and stack.services.redis_url is not None
        client = redis.Redis.from_url(stack.services.redis_url)
        try:
            await until(
                lambda: not client.exists(f"{PREFIX}report:{victim}"),
                timeout_s=TTL_S + 0.2 - (loop.time() - killed_at),
                what=f"{victim}'s leases expire in Redis within their TTL",
            )
        finally:
            client.close()
        await until(
            lambda: sample(metrics(stack, survivor), "fairlane_state_replicas") == 2,
            timeout_s=0.5,
            what=f"{survivor} counts two replicas",
        )
        outcomes = await asyncio.wait_for(asyncio.gather(*flood), timeout=60)
    failed = [o for o in outcomes if o[2] != 200]
    assert 1 <= len(failed) <= held, f"{len(failed)} failed, {victim} held {held}"
    assert len(outcomes) - len(failed) >= 12 - held  # what it had admitted was served
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
    stop = asyncio.Event()
    outcomes: list[Outcome] = []

    async def served(what: str, count: int = 10) -> None:
        """Until ``count`` more requests of the load have been answered."""
        target = len(outcomes) + count
        await until(lambda: len(outcomes) >= target, timeout_s=30.0, what=what)

    async with aiohttp.ClientSession() as session:

        async def client(key: str) -> None:
            while not stop.is_set():
                outcomes.append(await post(session, stack, key, chat("hi", 2)))

        load = asyncio.gather(*(client("sk-chat-demo") for _ in range(3)))
        await served("requests answered with the state shared")
        services.redis.popen.kill()
        services.redis.popen.wait()
        await until(
            lambda: all(sample(metrics(stack, r), "fairlane_state_shared") == 0 for r in REPLICAS),
            timeout_s=5.0,  # the replicas' grace (1 s) and the scrapes, on a busy machine
            what="every replica cut off",
        )
        await asyncio.sleep(3.0)  # the outage lasts three seconds
        await served("requests answered while Redis is down")

        def rejoined(replica: str) -> bool:
            page = metrics(stack, replica)  # one scrape: each is a blocking round trip
            return (
                sample(page, "fairlane_state_shared") == 1
                and sample(page, "fairlane_state_replicas") == 3
            )

        with ProcessGroup(tmp_path / "redis-again") as group:
            start_redis(group, redis_port)
            # Polled past the second it must take, so a slow rejoin fails with its time.
            rejoined_in = await until(
                lambda: all(rejoined(r) for r in REPLICAS),
                timeout_s=5.0,
                what="every replica shares state again, all three seen",
            )
            await served("requests answered once it is back")
            stop.set()
            await load
    statuses = [o[2] for o in outcomes]
    failed = [o[3][:200] for o in outcomes if o[2] != 200]
    assert statuses and set(statuses) == {200}, (
        f"{statuses.count(200)} of {len(statuses)} ok",
        failed,
    )
    assert rejoined_in < 1.0, f"every replica shared state again {rejoined_in:.2f} s after"
    for replica in REPLICAS:
        assert sample(metrics(stack, replica), "fairlane_state_cut_offs_total") == 1


async def test_a_light_tenant_is_served_fairly_across_replicas(tmp_path: Path) -> None:
    """Tenant ``heavy`` keeps 12 requests outstanding against 2 seats, each of its 12 clients
    with a key of its own, tenant ``light`` one at a time; Envoy spreads heavy's keys over
    the three replicas, and light's requests go to one of them. FIFO would make a light request wait
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

            async def heavy(key: str) -> None:
                while loop.time() < stop:
                    _, _, status, _ = await post(session, stack, key, body)
                    assert status == 200

            heavies = asyncio.gather(*(heavy(key) for key in HEAVY_KEYS))

            def queued() -> float:
                pages = [metrics(stack, r) for r in REPLICAS]
                return sum(sample(page, "fairlane_queue_depth", tier="api") for page in pages)

            # 12 outstanding on 2 seats: about 10 queued, over the replicas
            await until(lambda: queued() >= len(HEAVY_KEYS) - 4, what="heavy's backlog queued")
            loaded = await light(8)
            await heavies
    assert statistics.median(loaded) <= 3.5 * alone, (alone, loaded)
    assert max(loaded) <= 6.0 * alone, (alone, loaded)


async def test_a_killed_replica_fails_no_request_it_did_not_hold(tmp_path: Path) -> None:
    """Three replicas behind the real Envoy (``fairlane up --replicas 3``'s stack), a steady
    load of short requests of one key, and the replica that key hashes to SIGKILLed: no
    request started after the kill fails (Envoy opens a stream the dead replica cannot take
    on another one, and health checks and outlier detection take it out of the hash
    table), the only failures allowed are Envoy's 503s for requests already in flight at the
    kill, the key's requests move to one survivor (from a second after the kill: a stream
    opened before Envoy ejects the victim is retried on either survivor), and within two
    seconds Envoy counts two healthy replicas."""
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
        stop_at = math.inf  # set when the replica is killed
        async with aiohttp.ClientSession() as session:

            async def client() -> None:
                while loop.time() < stop_at:
                    started = loop.time()
                    url = f"{stack.url}/v1/chat/completions"
                    async with session.post(url, json=body, headers=headers) as response:
                        results.append((started, response.status, await response.read()))

            def loaded() -> bool:
                served = sum(1 for _, status, _ in results if status == 200)
                return (
                    served > 20 and holder(admitted(stack, "interactive", "chat-app")) is not None
                )

            async def kill_when_loaded() -> tuple[float, float, dict[str, float]]:
                nonlocal stop_at
                try:
                    await until(loaded, timeout_s=30.0, what="20 requests served by one replica")
                finally:
                    stop_at = loop.time() + 3.0  # the load runs on for three seconds
                victim = holder(admitted(stack, "interactive", "chat-app"))
                assert victim is not None, admitted(stack, "interactive", "chat-app")
                stack.kill_replica(victim)
                killed = loop.time()
                # A stream opened before Envoy ejects the victim is retried on either
                # survivor; from a second after the kill the key hashes to one of them.
                await asyncio.sleep(1.0)
                survivors = [r for r in REPLICAS if r != victim]
                # No request starts while the (blocking) scrape runs: every one started
                # from here on is admitted after it and counted in the growth below.
                counted_from = loop.time()
                return killed, counted_from, admitted(stack, "interactive", "chat-app", survivors)

            killer = asyncio.create_task(kill_when_loaded())
            await asyncio.gather(*(client() for _ in range(4)))
            killed_at, counted_from, settled = await killer  # the survivors', a second after
            moved = admitted(stack, "interactive", "chat-app", list(settled))
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
    grew = {r: moved[r] - settled[r] for r in moved}
    late = [status for started, status, _ in results if started >= counted_from]
    assert sorted(grew.values())[0] == 0 and sorted(grew.values())[1] >= len(late), (settled, moved)
    assert sum(moved.values()) >= len(after), moved
