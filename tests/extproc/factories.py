"""Small builders for the plain objects unit tests feed the gateway (no sockets)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.core.admission import Admission
from extproc.core.events import RequestInfo
from extproc.core.gateway import Gateway
from extproc.fleet.backend import Backend, BackendPool, BackendSpec
from extproc.fleet.prefix_cache import DEFAULT_BLOCK_SIZE
from extproc.fleet.vllm_metrics import EngineMetrics
from extproc.policy import DEFAULT_POLICY_PATH, Policy, PolicyStore, Tenant, Tier
from extproc.policy.model import Gate

OPEN = Gate(max_waiting=None, max_kv_cache_usage=None)
"""A gate that only asks for fresh metrics: admission limited by slots alone."""
INTERACTIVE = Tier(
    "interactive", rank=0, priority=0, queue_limit=4, queue_deadline_s=5.0, gate=OPEN
)
API = Tier("api", rank=1, priority=10, queue_limit=4, queue_deadline_s=30.0, gate=OPEN)
BATCH = Tier("batch", rank=2, priority=20, queue_limit=4, queue_deadline_s=600.0, gate=OPEN)
TENANT = Tenant(
    "acme", api_keys=("sk-acme",), tiers=("interactive", "api", "batch"), default_tier="api"
)


@dataclass(frozen=True)
class Request:
    """The fields of ``classify.RequestClass`` that admission reads."""

    tier: Tier
    user: str = "alice"
    tenant: Tenant = TENANT
    prompt_tokens: int = 100
    max_tokens: int | None = 50
    stream: bool = False
    prompt_text: str = ""
    model: str | None = None
    body: Mapping[str, Any] | None = None


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def policy(
    limit: int = 1, tiers: Sequence[Tier] = (INTERACTIVE, API, BATCH), **kw: object
) -> Policy:
    return Policy(tiers=tuple(tiers), tenants=(TENANT,), max_in_flight_per_backend=limit, **kw)  # type: ignore[arg-type]


def scraped(
    backend: Backend, clock: Callable[[], float], waiting: float = 0, kv: float = 0.1
) -> None:
    """Give ``backend`` a fresh scrape of an engine with ``waiting`` queued requests."""
    backend.record_scrape(
        EngineMetrics(
            waiting=waiting,
            running=0,
            kv_cache_usage=kv,
            itl_sum_s=0.0,
            itl_count=0.0,
            scraped_at=clock(),
            block_size=DEFAULT_BLOCK_SIZE,  # as vLLM's cache_config_info says
        ),
        granted_before=backend.granted_since_scrape,
    )


def make_admission(
    limit: int = 1,
    backends: int = 1,
    tiers: Sequence[Tier] = (INTERACTIVE, API, BATCH),
    seats: int | None = None,
    **policy_fields: object,
) -> tuple[Admission, BackendPool, FakeClock]:
    """Admission over ``backends`` idle engines of ``seats`` seats each (default: ``limit``,
    the policy's per-backend cap)."""
    clock = FakeClock()
    seats = limit if seats is None else seats
    pool = BackendPool(
        [BackendSpec("127.0.0.1", 9000 + i, "r", seats=seats) for i in range(backends)],
        clock=clock,
    )
    for backend in pool.backends:
        scraped(backend, clock)
    admission = Admission(pool, policy(limit, tiers, **policy_fields))
    return admission, pool, clock


def with_gate(tier: Tier, gate: Gate) -> Tier:
    return dataclasses.replace(tier, gate=gate)


CHAT = "/v1/chat/completions"


def make_gateway(
    limit: int = 4,
    policy_path: Path = DEFAULT_POLICY_PATH,
    regions: tuple[str, str] = ("a", "b"),
    seats: int | None = None,
) -> Gateway:
    """The default policy over two idle backends with ``seats`` seats each (default:
    ``limit``, the policy's per-backend cap)."""
    clock = FakeClock()
    specs = [
        BackendSpec("127.0.0.1", 8100 + i, region, seats=limit if seats is None else seats)
        for i, region in enumerate(regions, 1)
    ]
    pool = BackendPool(specs, clock=clock)
    for backend in pool.backends:
        scraped(backend, clock)
    store = PolicyStore(policy_path)
    policy = dataclasses.replace(store.current, max_in_flight_per_backend=limit)
    store.current = policy
    return Gateway(store, Admission(pool, policy))


def request(
    key: str = "sk-chat-demo",
    body: object = None,
    path: str = CHAT,
    request_id: str = "rid-1",
    **headers: str,
) -> RequestInfo:
    payload = (
        body
        if body is not None
        else {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    )
    all_headers = {
        ":method": "POST",
        ":path": path,
        "x-request-id": request_id,
        "authorization": f"Bearer {key}",
        **headers,
    }
    return RequestInfo("POST", path, all_headers, json.dumps(payload).encode(), request_id)
