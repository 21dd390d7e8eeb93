"""Token budgets without sockets: the window, the checks, the headers, replicas' charges."""

import dataclasses
import itertools
import json

import pytest

from extproc.core.budgets import Budgets, go_duration
from extproc.core.decisions import Forward, Respond
from extproc.core.errors import Rejection
from extproc.policy import Budget, Policy
from tests.extproc.factories import (
    API,
    BATCH,
    INTERACTIVE,
    TENANT,
    Request,
    make_admission,
    make_gateway,
    request,
)

NOW = 1000.0  # a slot boundary: 1000 / 5


def tenant(budget: Budget | None = None, user_budget: Budget | None = None, name: str = "acme"):  # type: ignore[no-untyped-def]
    return dataclasses.replace(TENANT, name=name, budget=budget, user_budget=user_budget)


def budgets_for(*tenants) -> Budgets:  # type: ignore[no-untyped-def]
    budgets = Budgets()
    budgets.configure(Policy(tiers=(INTERACTIVE, API, BATCH), tenants=tenants))
    return budgets


def ask(budgets: Budgets, request_id: str, request: Request, now: float) -> None:
    """Check and charge as admission does (input + output estimate)."""
    cost = request.prompt_tokens + (request.max_tokens or 0)
    claim = budgets.check(request, cost, now)  # type: ignore[arg-type]
    assert claim is not None
    budgets.charge(request_id, claim, request.prompt_tokens, request.max_tokens or 0, now)


def refused(budgets: Budgets, request: Request, now: float, share: float = 1.0) -> Rejection:
    cost = request.prompt_tokens + (request.max_tokens or 0)
    with pytest.raises(Rejection) as caught:
        budgets.check(request, cost, now, share)  # type: ignore[arg-type]
    return caught.value


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0004, "1ms"),
        (0.02, "20ms"),
        (0.999, "999ms"),
        (1, "1s"),
        (1.5, "2s"),
        (59.25, "1m0s"),
        (360, "6m0s"),
        (61.5, "1m2s"),
        (3600, "1h0m0s"),
        (-3, "0s"),
    ],
)
def test_reset_durations_are_written_like_openais(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


def test_a_tenant_without_a_budget_is_not_tracked() -> None:
    budgets = budgets_for(tenant())
    assert budgets.check(Request(API), 10**9, NOW) is None  # type: ignore[arg-type]
    assert budgets.headers("r1", NOW) == {}
    assert budgets.used_ratios(NOW) == {}


def test_tokens_over_the_minute_are_refused_with_openais_headers() -> None:
    acme = tenant(Budget(tokens_per_minute=1000, requests_per_minute=10))
    budgets = budgets_for(acme)
    request = Request(API, tenant=acme, prompt_tokens=250, max_tokens=50)  # 300 tokens
    for i in range(3):
        ask(budgets, f"r{i}", request, NOW)
    assert budgets.headers("r2", NOW) == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "7",
        "x-ratelimit-reset-requests": "18s",  # 3 requests drain at 10 a minute
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "100",
        "x-ratelimit-reset-tokens": "54s",  # 900 tokens at 1000 a minute
    }
    rejection = refused(budgets, request, NOW)
    assert rejection.status == 429 and rejection.code == "rate_limit_exceeded"
    assert b'"type":"rate_limit_error"' in rejection.body
    assert "tokens per minute: limit 1000, used 900, requested 300" in rejection.message
    assert rejection.headers["retry-after"] == "12"  # 200 more must drain: 12 s
    assert rejection.headers["x-ratelimit-remaining-tokens"] == "100"
    assert rejection.headers["x-ratelimit-reset-tokens"] == "54s"
    assert budgets.rejections == {("acme", "tokens_per_minute"): 1}
    refused(budgets, request, NOW + 11.9)
    ask(budgets, "r3", request, NOW + 12)
    assert budgets.headers("r3", NOW + 12)["x-ratelimit-remaining-tokens"] == "0"


def test_a_flood_is_served_its_budget_per_minute_give_or_take_one_request() -> None:
    limit, cost = 3000, 170
    acme = tenant(Budget(tokens_per_minute=limit))
    budgets = budgets_for(acme)
    request = Request(API, tenant=acme, prompt_tokens=120, max_tokens=50)
    served: dict[int, int] = {}
    admitted_at: list[float] = []
    for step in range(6000):  # ten requests a second for ten minutes
        now = NOW + step * 0.1
        try:
            ask(budgets, f"r{step}", request, now)
        except Rejection:
            continue
        admitted_at.append(now)
        minute = int((now - NOW) // 60)
        served[minute] = served.get(minute, 0) + cost
    assert len(served) == 10
    # Back from idle the tenant may spend its whole limit at once, then its rate.
    assert served[0] <= 2 * limit
    for minute in range(1, 10):
        assert limit - cost <= served[minute] <= limit + cost, (minute, served[minute])
    # Paced, not in bursts: after the first burst, never two admissions closer than the
    # time one request's cost takes to drain (3.4 s) less a step.
    gaps = [b - a for a, b in itertools.pairwise(admitted_at[18:])]
    assert min(gaps) >= cost * 60 / limit - 0.1


def test_completion_corrects_the_output_estimate() -> None:
    acme = tenant(Budget(tokens_per_minute=1000))
    budgets = budgets_for(acme)
    big = Request(API, tenant=acme, prompt_tokens=100, max_tokens=400)  # 500 up front
    small = Request(API, tenant=acme, prompt_tokens=100, max_tokens=200)  # 300
    ask(budgets, "r1", big, NOW)
    ask(budgets, "r2", big, NOW)
    refused(budgets, small, NOW)  # 1000 used
    budgets.finish("r1", NOW, output_tokens=40)  # 360 back
    ask(budgets, "r3", small, NOW)
    assert budgets.headers("r3", NOW)["x-ratelimit-remaining-tokens"] == "60"
    budgets.finish("r1", NOW, output_tokens=0)  # finished once: a repeat changes nothing
    assert budgets.headers("r3", NOW)["x-ratelimit-remaining-tokens"] == "60"
    # 30 s later 500 have drained; r2's 400 back leaves 40 used. A refund never goes below
    # nothing used: r3's 300 back then leaves 0.
    budgets.finish("r2", NOW + 30, output_tokens=0)
    assert budgets.headers("r3", NOW + 30) == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "960",
        "x-ratelimit-reset-tokens": "3s",  # 40 tokens drain in 2.4 s: whole seconds up
    }
    budgets.finish("r3", NOW + 30, output_tokens=0)
    assert budgets.used_ratios(NOW + 30) == {("acme", "tokens_per_minute"): 0.0}


def test_a_request_that_never_reached_a_backend_gets_its_tokens_back_not_its_request() -> None:
    acme = tenant(Budget(tokens_per_minute=1000, requests_per_minute=3))
    budgets = budgets_for(acme)
    request = Request(API, tenant=acme, prompt_tokens=400, max_tokens=100)
    ask(budgets, "r1", request, NOW)
    ask(budgets, "r2", request, NOW)
    budgets.finish("r1", NOW, served=False)
    ask(budgets, "r3", request, NOW)
    rejection = refused(budgets, request, NOW)
    assert "requests per minute: limit 3, used 3" in rejection.message
    assert rejection.headers["x-ratelimit-remaining-requests"] == "0"
    assert rejection.headers["x-ratelimit-remaining-tokens"] == "0"
    assert rejection.headers["retry-after"] == "20"  # a request drains in 20 s at 3 a minute


def test_a_request_larger_than_the_budget_is_refused_as_never_fitting() -> None:
    acme = tenant(Budget(tokens_per_minute=1000))
    budgets = budgets_for(acme)
    rejection = refused(budgets, Request(API, tenant=acme, prompt_tokens=10, max_tokens=5000), NOW)
    assert "requested 5010; the request can never fit" in rejection.message
    assert rejection.headers["retry-after"] == "60"
    assert rejection.headers["x-ratelimit-remaining-tokens"] == "1000"


def test_concurrent_requests_are_bounded_until_one_finishes() -> None:
    acme = tenant(Budget(concurrent=2))
    budgets = budgets_for(acme)
    request = Request(API, tenant=acme)
    ask(budgets, "r1", request, NOW)
    ask(budgets, "r2", request, NOW)
    rejection = refused(budgets, request, NOW)
    assert "concurrent requests: limit 2, in progress 2" in rejection.message
    assert rejection.headers == {"retry-after": "1"}  # no OpenAI header for concurrency
    assert budgets.rejections == {("acme", "concurrent"): 1}
    budgets.finish("r1", NOW + 1, output_tokens=5)
    ask(budgets, "r3", request, NOW + 1)


def test_each_user_has_the_user_budget_and_all_share_the_tenants() -> None:
    acme = tenant(Budget(requests_per_minute=3), user_budget=Budget(requests_per_minute=2))
    budgets = budgets_for(acme)
    alice, bob = Request(API, tenant=acme, user="alice"), Request(API, tenant=acme, user="bob")
    ask(budgets, "a1", alice, NOW)
    ask(budgets, "a2", alice, NOW)
    rejection = refused(budgets, alice, NOW)
    assert "user 'alice' of tenant 'acme'" in rejection.message
    assert budgets.rejections == {("acme", "user_requests_per_minute"): 1}
    ask(budgets, "b1", bob, NOW)
    rejection = refused(budgets, bob, NOW)  # bob has one left, the tenant none
    assert "for tenant 'acme' on requests per minute" in rejection.message
    # The headers show the tighter of the two budgets.
    headers = budgets.headers("b1", NOW)
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert budgets.used_ratios(NOW) == {
        ("acme", "requests_per_minute"): 1.0,
        ("acme", "user_requests_per_minute"): 1.0,  # alice, the most used
    }


def test_a_reload_keeps_the_counts_of_tenants_that_keep_their_budget() -> None:
    acme = tenant(Budget(requests_per_minute=2))
    other = tenant(Budget(requests_per_minute=2), name="other")
    budgets = budgets_for(acme, other)
    ask(budgets, "a1", Request(API, tenant=acme), NOW)
    ask(budgets, "a2", Request(API, tenant=acme), NOW)
    ask(budgets, "o1", Request(API, tenant=other), NOW)
    raised = tenant(Budget(requests_per_minute=3))
    budgets.configure(Policy(tiers=(INTERACTIVE, API, BATCH), tenants=(raised,)))  # "other" removed
    ask(budgets, "a3", Request(API, tenant=raised), NOW)
    refused(budgets, Request(API, tenant=raised), NOW)
    assert set(budgets.used_ratios(NOW)) == {("acme", "requests_per_minute")}
    budgets.finish("o1", NOW)  # a request of a removed tenant finishes harmlessly
    budgets.configure(Policy(tiers=(INTERACTIVE, API, BATCH), tenants=(other, raised)))
    ask(budgets, "o2", Request(API, tenant=other), NOW)
    ask(budgets, "o3", Request(API, tenant=other), NOW)  # its old count was dropped


def test_another_replicas_charges_and_refunds_count_here() -> None:
    acme = tenant(Budget(tokens_per_minute=1000, concurrent=2))
    here, there = budgets_for(acme), budgets_for(acme)
    assert here.take_ledger() == []  # starts recording
    request = Request(API, tenant=acme, prompt_tokens=300, max_tokens=200)
    ask(here, "r1", request, NOW)
    here.finish("r1", NOW, output_tokens=50)  # 150 back
    rows = here.take_ledger()
    assert rows == [("acme", None, 350, 1)]  # one row per key: charges less refunds
    there.charge_elsewhere(rows, NOW)
    assert there.used_ratios(NOW) == {
        ("acme", "tokens_per_minute"): 0.35,
        ("acme", "concurrent"): 0.0,
    }
    assert there.used_ratios(NOW + 6)[("acme", "tokens_per_minute")] == pytest.approx(0.25)
    assert here.take_ledger() == []
    # Requests in progress elsewhere count against ``concurrent``.
    ask(here, "r2", request, NOW + 6)
    there.set_active_elsewhere(here.active())
    assert here.active() == {("acme", None): 1}
    ask(there, "t1", Request(API, tenant=acme, prompt_tokens=1, max_tokens=1), NOW + 6)
    assert (
        "in progress 2" in refused(there, Request(API, tenant=acme, max_tokens=1), NOW + 6).message
    )
    # Charges for a tenant this policy does not budget are not tracked.
    there.charge_elsewhere([("ghost", None, 10, 1)], NOW)
    assert ("ghost", None) not in there.active() and there.prune(NOW + 6) == 0


def test_cut_off_a_replica_enforces_its_share_of_each_limit() -> None:
    acme = tenant(Budget(requests_per_minute=10))
    budgets = budgets_for(acme)
    request = Request(API, tenant=acme)
    for i in range(5):
        claim = budgets.check(request, 1, NOW, share=0.5)  # type: ignore[arg-type]
        assert claim is not None
        budgets.charge(f"r{i}", claim, 1, 0, NOW)
    rejection = refused(budgets, request, NOW, share=0.5)
    assert "limit 5, used 5" in rejection.message
    assert rejection.headers["x-ratelimit-limit-requests"] == "5"


def test_quiet_keys_are_forgotten_by_prune() -> None:
    acme = tenant(user_budget=Budget(requests_per_minute=5))  # a request drains in 12 s
    budgets = budgets_for(acme)
    for user in ("a", "b", "c"):
        ask(budgets, user, Request(API, tenant=acme, user=user), NOW)
    budgets.finish("a", NOW + 1)
    assert budgets.prune(NOW + 5) == 0  # not drained yet
    budgets.finish("b", NOW + 5)
    assert budgets.prune(NOW + 12) == 2  # c is still in progress
    assert budgets.active() == {("acme", "c"): 1}


def test_admission_refuses_over_budget_before_queueing_and_settles_at_release() -> None:
    acme = tenant(Budget(tokens_per_minute=400, concurrent=3))
    admission, _, clock = make_admission(limit=1)
    admission.configure(dataclasses.replace(admission.policy, tenants=(acme,)))
    request = Request(API, tenant=acme, prompt_tokens=100, max_tokens=100)
    admission.submit("r1", request)  # type: ignore[arg-type]  # granted
    admission.submit("r2", request)  # type: ignore[arg-type]  # queued: the one seat is taken
    assert admission.scheduler.depth("api") == 1
    with pytest.raises(Rejection) as caught:
        admission.submit("r3", request)  # type: ignore[arg-type]
    assert caught.value.code == "rate_limit_exceeded" and caught.value.tier is None
    assert admission.scheduler.depth("api") == 1 and not admission.knows("r3")
    # r2 leaves its queue: its 200 tokens come back; r1 finishes with 10 output tokens.
    admission.abandon("r2")
    admission.release("r1", output_tokens=10)
    admission.submit("r4", request)  # type: ignore[arg-type]
    assert admission.grant_of("r4") is not None
    headers = admission.budgets.headers("r4", clock())
    assert headers["x-ratelimit-remaining-tokens"] == str(400 - 110 - 200)


def test_gateway_answers_429_with_headers_and_admitted_requests_carry_them() -> None:
    gateway = make_gateway(limit=8)
    policy = gateway.policies.current
    tenants = tuple(
        dataclasses.replace(t, budget=Budget(requests_per_minute=2, tokens_per_minute=10_000))
        if t.name == "chat-app"
        else t
        for t in policy.tenants
    )
    policy = dataclasses.replace(policy, tenants=tenants)
    gateway.policies.current = policy
    gateway.admission.configure(policy)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    for i in range(2):
        forward = gateway.handle(request("sk-chat-demo", body, request_id=f"c{i}")).answer
        assert isinstance(forward, Forward)
        assert forward.metadata["ratelimit_limit_requests"] == "2"
        assert forward.metadata["ratelimit_remaining_requests"] == str(1 - i)
        assert forward.metadata["ratelimit_limit_tokens"] == "10000"
        assert int(forward.metadata["ratelimit_remaining_tokens"]) < 10_000
        assert forward.metadata["ratelimit_reset_tokens"].endswith("s")
    answer = gateway.handle(request("sk-chat-demo", body, request_id="c2")).answer
    assert isinstance(answer, Respond) and answer.status == 429
    error = json.loads(answer.body)["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert "requests per minute: limit 2" in error["message"]
    assert answer.headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(answer.headers["retry-after"]) <= 60
    assert gateway.admission.in_flight == 2 and not gateway.admission.knows("c2")
    assert gateway.stats.rejected[("429", "rate_limit_exceeded")] == 1
    # Another tenant is untouched, and carries no rate-limit metadata (it has no budget).
    other = gateway.handle(request("sk-api-demo", body, request_id="a1")).answer
    assert isinstance(other, Forward)
    assert not any(key.startswith("ratelimit_") for key in other.metadata)
