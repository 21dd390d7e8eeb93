"""Small builders for the plain objects unit tests feed the gateway (no sockets)."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.policy import Tenant, Tier

INTERACTIVE = Tier("interactive", rank=0, priority=0, queue_limit=4, queue_deadline_s=5.0)
API = Tier("api", rank=1, priority=10, queue_limit=4, queue_deadline_s=30.0)
BATCH = Tier("batch", rank=2, priority=20, queue_limit=4, queue_deadline_s=600.0)
TENANT = Tenant(
    "acme", api_keys=("sk-acme",), tiers=("interactive", "api", "batch"), default_tier="api"
)


@dataclass(frozen=True)
class Request:
    """The fields of ``classify.RequestClass`` that admission reads."""

    tier: Tier
    user: str = "alice"
    tenant: Tenant = TENANT
