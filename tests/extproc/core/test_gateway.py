"""The per-request pipeline without sockets: real policy, real admission, plain objects."""

import dataclasses
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from extproc.core.admission import Grant
from extproc.core.decisions import Forward, Hold, Respond
from extproc.core.events import Completion, RequestInfo
from extproc.core.gateway import (
    NO_METRICS_GRACE_S,
    NO_METRICS_RETRY_AFTER_S,
    OVERLOAD_RETRY_AFTER_S,
    Gateway,
)
from extproc.transport.prometheus import GatewayCollector
from tests.extproc.factories import CHAT, FakeClock, make_gateway, request, scraped


def test_forward_injects_priority_in_body_and_header_and_names_endpoints() -> None:
    gateway = make_gateway()
    decision = gateway.handle(request()).answer
    assert isinstance(decision, Forward)
    body = json.loads(decision.body)
    assert body["priority"] == 0 and decision.set_headers["x-vllm-priority"] == "0"
    assert decision.endpoints == ("127.0.0.1:8101", "127.0.0.1:8102")
    assert decision.metadata == {"tier": "interactive", "queue_ms": "0"}


def test_client_internal_headers_and_numeric_priority_never_pass() -> None:
    gateway = make_gateway()
    info = request(
        key="sk-api-demo",
        body={"model": "m", "prompt": "x", "priority": -100},
        **{
            "x-vllm-priority": "-100",
            "x-gateway-destination-endpoint": "6.6.6.6:1",
            "x-fairlane-tier": "interactive",
            "x-target-cluster": "evil",
        },
    )
    decision = gateway.handle(info).answer
    assert isinstance(decision, Forward)
    assert json.loads(decision.body)["priority"] == 10
    assert decision.set_headers["x-vllm-priority"] == "10"
    assert decision.set_headers["x-fairlane-tier"] == "api"
    assert "6.6.6.6:1" not in decision.endpoints
    # the codec always overwrites x-gateway-destination-endpoint with decision.endpoints
    assert {"authorization", "x-target-cluster"} <= set(decision.remove_headers)
    assert "x-vllm-priority" not in decision.remove_headers  # overwritten, not removed


def test_each_pending_request_of_a_user_ranks_one_lower() -> None:
    gateway = make_gateway(limit=10)
    priorities = []
    for i in range(3):
        decision = gateway.handle(request(key="sk-api-demo", request_id=f"r{i}")).answer
        assert isinstance(decision, Forward)
        priorities.append(int(decision.set_headers["x-vllm-priority"]))
    assert priorities == [10, 11, 12]


@pytest.mark.parametrize(
    ("info", "status"),
    [
        (request(key="sk-nobody"), 401),
        (RequestInfo("POST", CHAT, {"authorization": "Bearer sk-chat-demo"}, b"{nope"), 400),
        (request(**{"x-priority": "platinum"}), 400),
    ],
)
def test_bad_requests_become_openai_errors(info: RequestInfo, status: int) -> None:
    decision = make_gateway().handle(info).answer
    assert isinstance(decision, Respond)
    assert decision.status == status
    assert set(json.loads(decision.body)["error"]) == {"message", "type", "param", "code"}


def test_held_request_is_released_by_a_completion() -> None:
    gateway = make_gateway(limit=1)
    first = gateway.handle(request(request_id="a", key="sk-batch-demo")).answer
    assert isinstance(first, Forward)
    assert isinstance(gateway.handle(request(request_id="b", key="sk-batch-demo")).answer, Forward)
    held = gateway.handle(request(request_id="c")).answer
    assert isinstance(held, Hold)
    assert held.hold_s > 10  # the interactive deadline plus a margin
    (grant,) = gateway.completed(Completion("a", 200, "127.0.0.1:8101", 1.0, 10))
    assert grant.request_id == "c"
    decision = gateway.resume(held, grant)
    assert isinstance(decision, Forward)
    assert decision.endpoints[0] == "127.0.0.1:8101"


def unusable(gateway: Gateway) -> FakeClock:
    """Make every backend's metrics unusable, one failing, one never scraped (as at
    start-up); returns the pool's clock."""
    failing, never = gateway.admission.pool.backends
    failing.scrape_ok, failing.scrape_error = False, "HTTP 404"
    never.metrics = None
    clock = gateway.admission.pool.clock
    assert isinstance(clock, FakeClock)
    return clock


NO_METRICS = (
    "no backend has usable metrics: 127.0.0.1:8101 (scrape failed: HTTP 404), "
    "127.0.0.1:8102 (not scraped yet)"
)


def test_a_request_no_backend_could_ever_take_is_told_why_at_its_deadline() -> None:
    gateway = make_gateway()
    unusable(gateway)
    held = gateway.handle(request()).answer
    assert isinstance(held, Hold)  # within the grace: the next scrapes may come any moment
    answer = gateway.give_up(held).answer
    assert isinstance(answer, Respond) and answer.status == 503
    assert answer.headers == {"retry-after": str(NO_METRICS_RETRY_AFTER_S)}
    error = json.loads(answer.body)["error"]
    assert error == {
        "message": NO_METRICS,
        "type": "service_unavailable",
        "param": None,
        "code": "no_usable_metrics",
    }
    assert gateway.stats.shed == {("interactive", "no_usable_metrics"): 1}
    assert len(gateway.admission.scheduler) == 0


def test_a_request_that_waited_for_a_busy_fleet_is_told_it_waited() -> None:
    gateway = make_gateway(limit=1)
    for i in range(2):
        assert isinstance(gateway.handle(request(request_id=f"busy-{i}")).answer, Forward)
    held = gateway.handle(request(request_id="late")).answer
    assert isinstance(held, Hold)
    answer = gateway.give_up(held).answer
    assert isinstance(answer, Respond) and answer.status == 503
    error = json.loads(answer.body)["error"]
    assert error["code"] == "queue_deadline_exceeded" and "waited" in error["message"]


def test_past_the_grace_a_new_request_is_refused_at_once_without_queueing() -> None:
    gateway = make_gateway()
    clock = unusable(gateway)
    clock.now += NO_METRICS_GRACE_S - 0.5  # a blip: it still waits
    assert isinstance(gateway.handle(request(request_id="blip")).answer, Hold)
    clock.now += 1.0
    answer = gateway.handle(request(request_id="now")).answer
    assert isinstance(answer, Respond) and answer.status == 503
    assert json.loads(answer.body)["error"]["message"] == NO_METRICS
    assert not gateway.admission.knows("now")
    # One backend readable again: requests queue (and go) as usual.
    failing, _ = gateway.admission.pool.backends
    failing.scrape_ok = True
    scraped(failing, clock)
    assert isinstance(gateway.handle(request(request_id="back")).answer, Forward)


def test_the_grace_runs_from_start_up_while_nothing_was_ever_scraped() -> None:
    gateway = make_gateway()
    for backend in gateway.admission.pool.backends:
        backend.metrics = None  # the first scrapes are still on their way
    clock = unusable(gateway)
    gateway.admission.pool.backends[0].scrape_ok = True
    clock.now += NO_METRICS_GRACE_S  # a slow start: still within the grace
    assert isinstance(gateway.handle(request(request_id="early")).answer, Hold)
    clock.now += 0.5
    answer = gateway.handle(request(request_id="late")).answer
    assert isinstance(answer, Respond) and answer.status == 503
    assert "127.0.0.1:8101 (not scraped yet)" in json.loads(answer.body)["error"]["message"]


def test_batch_path_is_rewritten_and_served_as_batch() -> None:
    decision = make_gateway().handle(request(path="/v1/batch/chat/completions")).answer
    assert isinstance(decision, Forward)
    assert decision.set_headers[":path"] == "/v1/chat/completions"


def test_reused_request_id_gets_a_fresh_one() -> None:
    gateway = make_gateway()
    gateway.handle(request(request_id="same"))
    second = gateway.handle(request(request_id="same")).answer
    assert isinstance(second, Forward)
    assert second.set_headers["x-request-id"] != "same"


def test_bodiless_get_is_authenticated_and_routed_without_queueing() -> None:
    gateway = make_gateway()
    info = RequestInfo(
        "GET", "/v1/models", {"authorization": "Bearer sk-chat-demo", "x-vllm-priority": "-9"}
    )
    decision = gateway.handle(info).answer
    assert isinstance(decision, Forward) and decision.endpoints
    assert set(decision.remove_headers) == {"authorization", "x-vllm-priority"}
    assert gateway.admission.in_flight == 0
    anonymous = gateway.handle(RequestInfo("GET", "/v1/models", {})).answer
    assert isinstance(anonymous, Respond) and anonymous.status == 401


def test_hedged_tiers_ask_envoy_to_hedge_and_others_do_not() -> None:
    gateway = make_gateway()
    chat = gateway.handle(request(request_id="c")).answer
    assert isinstance(chat, Forward)
    assert chat.set_headers["x-envoy-upstream-rq-per-try-timeout-ms"] == "1000"
    assert chat.set_headers["x-envoy-hedge-on-per-try-timeout"] == "true"
    assert chat.set_headers["x-envoy-max-retries"] == str(len(chat.endpoints) - 1)
    batch = gateway.handle(request(key="sk-batch-demo", request_id="b")).answer
    assert isinstance(batch, Forward)
    assert "x-envoy-hedge-on-per-try-timeout" not in batch.set_headers
    assert batch.set_headers["x-envoy-max-retries"] == str(len(batch.endpoints) - 1)


SUPPORT = "You are ACME's support assistant. Answer in two sentences, cite the manual. " * 40


def chat(request_id: str, *messages: tuple[str, str]) -> RequestInfo:
    body = {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}
    return request(body=body, request_id=request_id)


def endpoint(gateway: Gateway, info: RequestInfo) -> str:
    decision = gateway.handle(info).answer
    assert isinstance(decision, Forward)
    return decision.endpoints[0]


def test_a_conversation_stays_on_its_backend_while_unrelated_requests_spread() -> None:
    gateway = make_gateway(regions=("r", "r"))
    one, two = "127.0.0.1:8101", "127.0.0.1:8102"
    assert endpoint(gateway, chat("u1", ("user", "What is the capital of France?"))) == one
    first_turn = [("system", SUPPORT), ("user", "My order 1234 has not arrived.")]
    assert endpoint(gateway, chat("c1", *first_turn)) == two  # the idle one: by load
    # Both now carry one request. By load alone the tie goes to 8101; the conversation's
    # second turn shares its long prefix with the first and stays on 8102.
    second_turn = [*first_turn, ("assistant", "Sorry to hear that."), ("user", "Any update?")]
    decision = gateway.handle(chat("c2", *second_turn)).answer
    assert isinstance(decision, Forward) and decision.endpoints == (two, one)
    # Unrelated requests keep going where the load is lowest.
    assert endpoint(gateway, chat("u2", ("user", "Write a haiku about rain."))) == one
    assert gateway.admission.picks[(two, "prefix")] == 1
    assert gateway.admission.picks[(one, "load")] == 2


def test_a_new_conversation_with_the_same_system_prompt_joins_its_backend() -> None:
    gateway = make_gateway(regions=("r", "r"))
    gateway.handle(chat("u1", ("user", "unrelated")))
    alice = [("system", SUPPORT), ("user", "Where is my parcel?")]
    assert endpoint(gateway, chat("a1", *alice)) == "127.0.0.1:8102"
    gateway.completed(Completion("u1", 200, "127.0.0.1:8101", 0.5, 900))
    gateway.completed(Completion("a1", 200, "127.0.0.1:8102", 0.5, 900))
    bob = [("system", SUPPORT), ("user", "How do I return a lamp?")]
    assert endpoint(gateway, chat("b1", *bob)) == "127.0.0.1:8102"


def test_picks_are_exported_per_backend_and_reason() -> None:
    gateway = make_gateway(regions=("r", "r"))
    gateway.handle(chat("a", ("system", SUPPORT), ("user", "first")))
    gateway.completed(Completion("a", 200, "127.0.0.1:8101", 0.5, 900))
    gateway.handle(chat("b", ("system", SUPPORT), ("user", "second")))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(gateway.admission, gateway.stats))
    text = generate_latest(registry).decode()
    assert 'fairlane_picks_total{backend="127.0.0.1:8101",reason="load"} 1.0' in text
    assert 'fairlane_picks_total{backend="127.0.0.1:8101",reason="prefix"} 1.0' in text


def test_a_bug_after_submission_still_hands_over_the_grants_made_for_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A submission may let other held requests go; a bug answering this one must cost this
    one a 500, not leave the others waiting for grants nobody delivers."""
    gateway = make_gateway()
    submit = gateway.admission.submit
    other = Grant("held-elsewhere", ("127.0.0.1:8101",), 10, 0.5, "acme")
    monkeypatch.setattr(gateway.admission, "submit", lambda rid, req: [*submit(rid, req), other])

    def broken(*_: object) -> Forward:
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(gateway, "forward", broken)
    decision = gateway.handle(request())
    assert isinstance(decision.answer, Respond) and decision.answer.status == 500
    assert decision.grants == (other,)


# --------------------------------------------------------------------------- overload

ONE_TIER_POLICY = """\
tiers:
  - name: only
    priority: 0
    queue_limit: 10
    queue_deadline_s: 5
tenants:
  - name: chat-app
    api_keys: [sk-chat-demo]
    tiers: [only]
"""


def overloaded(gateway: Gateway) -> Gateway:
    gateway.overload.period(1.0)  # a second of lag: far past the bound
    assert gateway.overload.overloaded
    return gateway


def test_overloaded_refuses_the_lowest_tier_with_429_and_counts_its_shed() -> None:
    gateway = overloaded(make_gateway())
    assert gateway.policies.current.lowest_tier.name == "batch"
    refused = gateway.handle(request(key="sk-batch-demo", request_id="b")).answer
    assert isinstance(refused, Respond)
    assert refused.status == 429
    assert refused.headers == {"retry-after": str(OVERLOAD_RETRY_AFTER_S)}
    assert json.loads(refused.body)["error"]["code"] == "gateway_overloaded"
    assert gateway.stats.shed == {("batch", "gateway_overloaded"): 1}
    assert gateway.admission.in_flight == 0  # refused before it took a seat or a queue entry
    # The more urgent tiers are still admitted.
    for key, tier in (("sk-chat-demo", "interactive"), ("sk-api-demo", "api")):
        decision = gateway.handle(request(key=key, request_id=tier)).answer
        assert isinstance(decision, Forward), tier
        assert decision.set_headers["x-fairlane-tier"] == tier
    assert gateway.admission.in_flight == 2
    assert sum(gateway.stats.shed.values()) == 1


def test_a_one_tier_policy_is_never_refused_for_overload(tmp_path: Path) -> None:
    path = tmp_path / "one.yaml"
    path.write_text(ONE_TIER_POLICY)
    gateway = overloaded(make_gateway(policy_path=path))
    (only,) = gateway.policies.current.tiers
    assert gateway.policies.current.lowest_tier is only
    decision = gateway.handle(request(request_id="o")).answer
    assert isinstance(decision, Forward)
    assert not gateway.stats.shed


def test_every_decision_is_counted_for_the_overload_control() -> None:
    gateway = make_gateway()
    for key in ("sk-batch-demo", "sk-batch-demo", "sk-chat-demo", "sk-api-demo"):
        gateway.handle(request(key=key, request_id=f"{key}-{gateway.admission.in_flight}"))
    # Half of them batch, the least urgent tier: refusing it would relieve the service, so
    # a lagging period makes the service refuse batch and Envoy turn nothing away.
    assert gateway.overload.period(1.0) == 0.0
    assert gateway.overload.overloaded
    refused = gateway.handle(request(key="sk-batch-demo", request_id="late")).answer
    assert isinstance(refused, Respond) and refused.status == 429


def test_grants_and_completions_of_batch_count_as_batch_work_for_the_overload() -> None:
    """A batch flood decided earlier comes back as completions and grants of held batch
    requests while the only new decisions are chat's: that work is batch's, so a lagging
    period refuses batch, and Envoy (blind to tiers) turns no chat away."""
    gateway = make_gateway(limit=1, seats=1)
    for rid in ("b1", "b2", "b3"):
        gateway.handle(request(key="sk-batch-demo", request_id=rid))
    held = gateway.handle(request(key="sk-batch-demo", request_id="b4")).answer
    assert isinstance(held, Hold)
    gateway.overload.period(0.0)  # a new period: what follows is all it counts
    (grant,) = gateway.completed(Completion("b1", 200, "127.0.0.1:8101", 1.0, 10))
    gateway.completed(Completion("b2", 200, "127.0.0.1:8102", 1.0, 10))
    assert isinstance(gateway.resume(held, grant), Forward)
    gateway.handle(request(key="sk-chat-demo", request_id="chat"))
    assert gateway.overload.period(1.0) == 0.0  # three batch messages to one chat
    assert gateway.overload.overloaded


def test_overloaded_refuses_a_key_of_the_least_urgent_tier_on_its_headers() -> None:
    """A tenant allowed only batch sends batch whatever its body says: refused unread."""
    gateway = make_gateway()
    headers_only = dataclasses.replace(request(key="sk-batch-demo"), body=b"")
    assert gateway.refuse_early(headers_only) is None  # not overloaded
    overloaded(gateway)
    refused = gateway.refuse_early(headers_only)
    assert isinstance(refused, Respond) and refused.status == 429
    assert refused.headers == {"retry-after": str(OVERLOAD_RETRY_AFTER_S)}
    assert json.loads(refused.body)["error"]["code"] == "gateway_overloaded"
    assert gateway.stats.shed == {("batch", "gateway_overloaded"): 1}
    # A key allowed a more urgent tier may be promoted by its body: decided on the body.
    for key in ("sk-chat-demo", "sk-api-demo"):
        assert gateway.refuse_early(dataclasses.replace(request(key=key), body=b"")) is None
    # A bad key is answered on the body as usual (401 there, not a 429 here).
    assert gateway.refuse_early(dataclasses.replace(request(key="sk-nope"), body=b"")) is None
    assert gateway.admission.in_flight == 0


def test_not_overloaded_refuses_nothing() -> None:
    gateway = make_gateway()
    gateway.overload.period(1.0)
    while gateway.overload.overloaded:  # overloaded once, recovered since
        gateway.overload.period(0.0)
    for key in ("sk-batch-demo", "sk-api-demo", "sk-chat-demo"):
        assert isinstance(gateway.handle(request(key=key, request_id=key)).answer, Forward)
    assert not gateway.stats.shed and not gateway.stats.rejected
