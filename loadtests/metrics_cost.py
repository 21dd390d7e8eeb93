"""``python -m loadtests.metrics_cost``: what one Prometheus scrape of the gateway costs.

A scrape runs on the service's event loop, so while it renders no request is handled. This
fills a real ``Gateway`` (default policy, two backends, per-user flows) with many held
requests from thousands of distinct users and models, then times ``generate_latest`` over
the real collector: the pause a scrape puts into request handling.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time

from prometheus_client import CollectorRegistry, generate_latest

from extproc.core.admission import Admission
from extproc.core.events import RequestInfo
from extproc.core.gateway import Gateway
from extproc.fleet.backend import BackendPool, BackendSpec
from extproc.fleet.vllm_metrics import EngineMetrics
from extproc.policy import DEFAULT_POLICY_PATH, PolicyStore
from extproc.transport.prometheus import GatewayCollector

KEYS = ("sk-chat-demo", "sk-api-demo", "sk-batch-demo")


async def measure(held: int, scrapes: int) -> dict[str, float]:
    store = PolicyStore(DEFAULT_POLICY_PATH)
    policy = store.current
    store.current = dataclasses.replace(
        policy,
        tiers=tuple(dataclasses.replace(t, queue_limit=held) for t in policy.tiers),
        fairness=dataclasses.replace(policy.fairness, flow="user"),
    )
    pool = BackendPool([BackendSpec("127.0.0.1", 9001, "a"), BackendSpec("127.0.0.1", 9002, "b")])
    for backend in pool.backends:
        idle = EngineMetrics(
            waiting=0, running=0, kv_cache_usage=0.1, itl_sum_s=0.0, itl_count=0.0,
            scraped_at=pool.clock(),
        )  # fmt: skip
        backend.record_scrape(idle, granted_before=0)
    gateway = Gateway(store, Admission(pool, store.current))
    for i in range(held):
        body = {"model": f"model-{i % 500}", "prompt": "hi", "max_tokens": 4, "user": f"u{i}"}
        headers = {"authorization": f"Bearer {KEYS[i % 3]}", ":path": "/v1/completions"}
        gateway.handle(
            RequestInfo("POST", "/v1/completions", headers, json.dumps(body).encode(), f"r{i}")
        )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(gateway.admission, gateway.stats, store))
    text = generate_latest(registry)
    started = time.perf_counter()
    for _ in range(scrapes):
        text = generate_latest(registry)
    return {
        "held": len(gateway.admission.scheduler),
        "in_flight": gateway.admission.in_flight,
        "series": sum(1 for line in text.splitlines() if not line.startswith(b"#")),
        "scrape_ms": 1000 * (time.perf_counter() - started) / scrapes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=int, default=20_000, help="requests held in queues")
    parser.add_argument("--scrapes", type=int, default=50)
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.held, args.scrapes))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
