"""The Redis outage bench's policy: the default policy with its two tenants added (the bench
itself needs replicas, Redis and Envoy: run by hand, docs/benchmarks/replicas.md)."""

from __future__ import annotations

from pathlib import Path

from extproc.policy import load_policy
from loadtests.bench.replicas.redis_outage import write_policy


def test_the_policy_has_the_benchs_tenants_and_the_defaults(tmp_path: Path) -> None:
    """A comment on the default policy's ``tenants:`` line once made the bench's tenants go
    missing: every request got 401 and the bench reported 100 % failed."""
    policy = load_policy(write_policy(tmp_path))
    names = [tenant.name for tenant in policy.tenants]
    assert names[:2] == ["heavy", "light"] and "chat-app" in names
    assert policy.tenant_for_key("sk-heavy") is not None
