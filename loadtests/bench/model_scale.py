"""What the gateway's decisions cost on a fleet of many models: 50 models x 20 engines
against one model on 20 engines, the real core, in one process, in one run.

``python -m loadtests.bench.model_scale`` submits requests through ``Gateway.handle`` with
the default policy, spread over the fleet's models, releases each (its completion), and
prints the core's CPU microseconds per request (handle + release) for each fleet, best of
``--rounds``. Every engine is idle with fresh metrics, so every request is granted at once:
the figure is the decision path itself (classify, route by model, queue in its band, filter,
score, grant), not time spent waiting. A micro-benchmark of the core, not of the wire.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from extproc.core.admission import Admission
from extproc.core.events import RequestInfo
from extproc.core.gateway import Gateway
from extproc.fleet.backend import BackendPool, BackendSpec
from extproc.fleet.models import ServedModels
from extproc.fleet.vllm_metrics import EngineMetrics
from extproc.policy import DEFAULT_POLICY_PATH, PolicyStore

CHAT = "/v1/chat/completions"


def fleet(models: int, engines_per_model: int) -> Gateway:
    """The default policy over ``models x engines_per_model`` idle 64-seat engines; each
    engine's /v1/models as read (one model per engine) when there are several models."""
    now = [1000.0]
    specs = [
        BackendSpec(f"10.{m // 250}.{m % 250}.{e + 1}", 8000, "a", seats=64)
        for m in range(models)
        for e in range(engines_per_model)
    ]
    pool = BackendPool(specs, clock=lambda: now[0])
    for i, backend in enumerate(pool.backends):
        backend.record_scrape(
            EngineMetrics(0, 0, 0.1, 0.0, 0.0, now[0], block_size=16), granted_before=0
        )
        if models > 1:
            pool.set_models(backend, ServedModels(frozenset({f"model-{i // engines_per_model}"})))
    store = PolicyStore(DEFAULT_POLICY_PATH)
    store.current = dataclasses.replace(store.current, max_in_flight_per_backend=10**6)
    return Gateway(store, Admission(pool, store.current))


def per_request_us(gateway: Gateway, models: int, requests: int) -> float:
    """CPU microseconds per request, handle + release, models taken in turn."""
    bodies = [
        json.dumps(
            {"model": f"model-{m}", "messages": [{"role": "user", "content": "hello there"}]}
        ).encode()
        for m in range(models)
    ]
    headers = {":method": "POST", ":path": CHAT, "authorization": "Bearer sk-chat-demo"}
    started = time.process_time()
    for i in range(requests):
        request_id = f"r{i}"
        info = RequestInfo("POST", CHAT, headers, bodies[i % models], request_id)
        gateway.handle(info)
        gateway.admission.release(request_id)
    return (time.process_time() - started) / requests * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.model_scale")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    shapes = {"1 model x 20 engines": (1, 20), "50 models x 20 engines": (50, 20)}
    best: dict[str, float] = {}
    for _ in range(args.rounds):  # the fleets alternate, so a busy moment hits both
        for name, (models, engines) in shapes.items():
            cost = per_request_us(fleet(models, engines), models, args.requests)
            best[name] = min(best.get(name, cost), cost)
    for name, cost in best.items():
        print(f"{name}: {cost:.1f} us per request (best of {args.rounds})")
    one, many = best.values()
    print(f"ratio: {many / one:.2f} x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
