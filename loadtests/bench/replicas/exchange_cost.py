"""``python -m loadtests.bench.replicas.exchange_cost``: what one Redis exchange costs.

Replicas share state by one round trip per period (``extproc.state``), whatever the
request rate, so the service CPU that shared state adds per request is
``exchanges per second x CPU per exchange / requests per second``. This measures the CPU
per exchange in the replica (building and encoding its report, the redis-py round trip,
decoding the others' reports, applying the merged view to admission) and in Redis, for N
replicas exchanging back to back against a real ``redis-server`` on loopback, each with
requests in flight on every backend and some waiting in every tier. It prints one JSON
object; nothing else runs, so the machine is not the bottleneck (both figures are CPU
seconds, not wall time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from extproc.core.admission import Admission
from extproc.core.peers import PeerView
from extproc.fleet.backend import BackendPool, BackendSpec
from extproc.fleet.vllm_metrics import EngineMetrics
from extproc.ops.processes import ProcessGroup, free_port
from extproc.ops.redis_server import redis_url, start_redis
from extproc.policy import DEFAULT_POLICY_PATH, PolicyStore
from extproc.state.codec import Charge
from extproc.state.exchange import RedisExchange
from extproc.state.replica import SharedState
from loadtests.bench.cpu import process_cpu_seconds, self_cpu_seconds


def _applier(admission: Admission) -> Callable[[PeerView, list[Charge]], None]:
    """What the service's ``HeldRequests.apply_peers`` does, minus waking streams."""

    def apply(view: PeerView, charges: list[Charge]) -> None:
        admission.charge_elsewhere(charges)
        admission.apply_peers(view)

    return apply


def _admission(backends: int) -> Admission:
    """The default policy over ``backends`` idle engines with requests in flight on every
    backend and every tier recently active: a report with something in most fields."""
    clock = time.monotonic
    pool = BackendPool(
        [BackendSpec("127.0.0.1", 9000 + i, "r", seats=64) for i in range(backends)], clock=clock
    )
    for b in pool.backends:
        b.record_scrape(EngineMetrics(0, 0, 0.1, 0.0, 0.0, scraped_at=clock()), granted_before=0)
    policy = PolicyStore(DEFAULT_POLICY_PATH).current
    admission = Admission(pool, policy)
    for backend in pool.backends:
        backend.note_grant(rank=1)
        backend.in_flight_by_rank[0] += 1
    for tier in policy.tiers:
        admission._last_arrival[tier.name] = clock()
    admission.scheduler.take_ledger()
    return admission


async def measure(replicas: int, backends: int, exchanges: int, url: str) -> dict[str, Any]:
    states = [
        SharedState(admission, RedisExchange(url, f"r{i}"), _applier(admission))
        for i, admission in enumerate(_admission(backends) for _ in range(replicas))
    ]
    for state in states:  # warm up: connections, script loaded
        await state.exchange_once()
    cpu0, wall0 = self_cpu_seconds(), time.perf_counter()
    for _ in range(exchanges):
        for state in states:
            await state.exchange_once()
    cpu, wall = self_cpu_seconds() - cpu0, time.perf_counter() - wall0
    total = exchanges * replicas
    for state in states:
        await state.store.close()
    seen = [s.replicas_seen for s in states]
    return {"exchanges": total, "cpu_s": cpu, "wall_s": wall, "replicas_seen": seen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--backends", type=int, default=4)
    parser.add_argument("--exchanges", type=int, default=2000, help="per replica")
    args = parser.parse_args()
    with ProcessGroup() as group:
        port = free_port()
        redis = start_redis(group, port)
        redis_cpu0 = process_cpu_seconds(redis.popen.pid) or 0.0
        result = asyncio.run(measure(args.replicas, args.backends, args.exchanges, redis_url(port)))
        redis_cpu = (process_cpu_seconds(redis.popen.pid) or 0.0) - redis_cpu0
    n = result["exchanges"]
    report = {
        "replicas": args.replicas,
        "backends": args.backends,
        **result,
        "replica_cpu_us_per_exchange": round(result["cpu_s"] / n * 1e6, 1),
        "redis_cpu_us_per_exchange": round(redis_cpu / n * 1e6, 1),
        "round_trip_us": round(result["wall_s"] / n * 1e6, 1),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
