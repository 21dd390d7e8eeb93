"""Budgets are fleet-wide: what one replica charges counts on the others (real Redis).

Like ``test_replica``, every exchange is driven by hand: what one replica knows of another
is decided by the exchanges, never by timing.
"""

from __future__ import annotations

import dataclasses

import pytest

from extproc.core.errors import Rejection
from extproc.policy import Budget, Tenant
from tests.extproc.factories import API, TENANT, Request
from tests.extproc.state.test_replica import Replica, replicas, round_trip

__all__ = ["replicas"]  # the fixture, shared with test_replica


def budgeted(replicas: tuple[Replica, Replica], budget: Budget) -> Tenant:
    tenant = dataclasses.replace(TENANT, budget=budget)
    for replica in replicas:
        admission = replica.admission
        admission.configure(dataclasses.replace(admission.policy, tenants=(tenant,)))
    return tenant


def refusal(replica: Replica, request_id: str, request: Request) -> str:
    with pytest.raises(Rejection) as caught:
        replica.admission.submit(request_id, request)  # type: ignore[arg-type]
    assert caught.value.status == 429 and caught.value.code == "rate_limit_exceeded"
    return caught.value.message


async def test_tokens_spent_on_one_replica_count_on_the_other(
    replicas: tuple[Replica, Replica],
) -> None:
    r1, r2 = replicas
    await round_trip(r1, r2)  # both recording, each seen by the other
    tenant = budgeted(replicas, Budget(tokens_per_minute=300))
    request = Request(API, tenant=tenant, prompt_tokens=50, max_tokens=100)  # 150 each
    for i in range(2):
        r1.admission.submit(f"a{i}", request)  # type: ignore[arg-type]
    assert r2.admission.budgets.used_ratios(r2.clock())[("acme", "tokens_per_minute")] == 0
    await round_trip(r1, r2)
    assert "limit 300, used 300, requested 150" in refusal(r2, "b0", request)
    # Their completions' corrections travel too: 100 output tokens estimated, none made.
    r1.admission.release("a0", output_tokens=0)
    r1.admission.release("a1", output_tokens=0)
    await round_trip(r1, r2)
    r2.admission.submit("b0", request)  # type: ignore[arg-type]  # 100 + 150 <= 300
    await round_trip(r1, r2)
    assert "used 250" in refusal(r1, "a2", request)


async def test_requests_in_progress_on_one_replica_count_against_concurrent(
    replicas: tuple[Replica, Replica],
) -> None:
    r1, r2 = replicas
    tenant = budgeted(replicas, Budget(concurrent=2))
    request = Request(API, tenant=tenant)
    r1.admission.submit("a0", request)  # type: ignore[arg-type]
    r1.admission.submit("a1", request)  # type: ignore[arg-type]
    await round_trip(r1, r2)
    assert "concurrent requests: limit 2, in progress 2" in refusal(r2, "b0", request)
    r1.admission.release("a0", output_tokens=10)
    await round_trip(r1, r2)
    r2.admission.submit("b0", request)  # type: ignore[arg-type]
    await round_trip(r1, r2)
    assert "in progress 2" in refusal(r1, "a2", request)
