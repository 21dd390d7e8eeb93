"""The gateway's Prometheus exposition, rendered from the real gateway without sockets."""

from __future__ import annotations

import dataclasses
import math

from prometheus_client import CollectorRegistry, generate_latest

from extproc.core.admission import Admission
from extproc.core.counters import GatewayStats
from extproc.core.decisions import Forward, Hold, Respond
from extproc.core.events import Completion
from extproc.core.gateway import Gateway
from extproc.fleet.backend import BackendPool, BackendSpec
from extproc.fleet.models import ServedModels
from extproc.fleet.seats import FALLBACK_SEATS
from extproc.fleet.vllm_metrics import EngineMetrics
from extproc.transport.prometheus import GatewayCollector
from tests.exported_metrics import gateway_exposition, parse_samples
from tests.extproc.core.test_model_routing import chat, two_pools
from tests.extproc.factories import (
    API,
    BATCH,
    INTERACTIVE,
    FakeClock,
    make_gateway,
    policy,
    request,
)


def value(text: str, name: str, **labels: str) -> float:
    return parse_samples(text)[(name, frozenset(labels.items()))]


def exposition(gateway: Gateway) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(gateway.admission, gateway.stats, gateway.policies))
    return generate_latest(registry).decode()


def test_every_outcome_is_counted_where_an_operator_looks_for_it() -> None:
    text = gateway_exposition()
    # one chat request, and one more within chat-app's budget (the next is refused)
    assert value(text, "fairlane_requests_admitted_total", tier="interactive", model="m") == 2
    assert value(text, "fairlane_requests_shed_total", tier="batch", reason="queue_full") == 1
    assert (
        value(text, "fairlane_requests_rejected_total", status="401", reason="invalid_api_key") == 1
    )
    assert (
        value(text, "fairlane_requests_rejected_total", status="500", reason="internal_error") == 1
    )
    assert value(text, "fairlane_picks_total", backend="127.0.0.1:8102", reason="failover") == 1
    assert value(text, "fairlane_policy_reloads_total", result="ok") == 1
    assert value(text, "fairlane_policy_reloads_total", result="error") == 1
    assert value(text, "fairlane_tier_slo_ttft_seconds", tier="interactive") == 0.5
    assert value(text, "fairlane_tier_in_flight", tier="api") == 1
    assert value(text, "fairlane_tier_in_flight", tier="batch") == 0  # present, not missing
    assert (
        value(
            text, "fairlane_backend_seats", backend="127.0.0.1:8101", region="a", source="declared"
        )
        == 2
    )
    assert value(text, "fairlane_fleet_seats") == 4
    assert value(text, "fairlane_tier_reserved_seats", tier="batch") == 0  # reserves nothing
    assert value(text, "fairlane_request_duration_seconds_count", tier="interactive") == 1
    assert value(text, "fairlane_request_duration_seconds_sum", tier="interactive") == 0.8
    assert (
        value(text, "fairlane_time_to_first_byte_seconds_bucket", tier="interactive", le="0.05")
        == 1
    )
    assert (
        value(text, "fairlane_time_to_first_byte_seconds_bucket", tier="interactive", le="0.025")
        == 0
    )
    assert (
        value(
            text, "fairlane_flow_tokens_total", tier="interactive", flow="chat-app", kind="output"
        )
        > 0
    )


def test_a_request_past_its_queue_deadline_is_shed_by_its_tier() -> None:
    gateway = make_gateway(limit=1)
    policy = gateway.policies.current
    tiers = tuple(
        dataclasses.replace(t, queue_deadline_s=0.05) if t.name == "api" else t
        for t in policy.tiers
    )
    gateway.policies.current = dataclasses.replace(policy, tiers=tiers, max_in_flight_per_backend=1)
    gateway.admission.configure(gateway.policies.current)
    for i in range(2):  # both backends busy
        assert isinstance(
            gateway.handle(request("sk-api-demo", request_id=f"busy-{i}")).answer, Forward
        )
    held = gateway.handle(request("sk-api-demo", request_id="late")).answer
    assert isinstance(held, Hold)
    outcome = gateway.give_up(held).answer  # the transport's timer fired
    assert isinstance(outcome, Respond) and outcome.status == 503
    text = exposition(gateway)
    assert (
        value(text, "fairlane_requests_shed_total", tier="api", reason="queue_deadline_exceeded")
        == 1
    )
    assert (
        "fairlane_requests_rejected_total",
        frozenset({("status", "503"), ("reason", "queue_deadline_exceeded")}),
    ) not in parse_samples(text)


def test_backend_state_shows_staleness_and_never_scraped_engines() -> None:
    gateway = make_gateway()
    first, second = gateway.admission.pool.backends
    clock = gateway.admission.pool.clock
    assert isinstance(clock, FakeClock)
    second.metrics = None  # as at start-up, before its first scrape
    clock.now += 2.5  # past the default policy's stale_after_s of 1 s
    text = exposition(gateway)
    labels = {"backend": first.address, "region": first.region}
    assert value(text, "fairlane_backend_metrics_age_seconds", **labels) == 2.5
    assert value(text, "fairlane_backend_metrics_stale", **labels) == 1
    assert value(text, "fairlane_backend_kv_cache_usage_ratio", **labels) == 0.1
    fresh = {"backend": second.address, "region": second.region}
    assert math.isinf(value(text, "fairlane_backend_metrics_age_seconds", **fresh))
    assert ("fairlane_backend_waiting", frozenset(fresh.items())) not in parse_samples(text)


def test_each_optional_series_a_backend_lacks_is_shown() -> None:
    gateway = make_gateway()
    first, second = gateway.admission.pool.backends
    first.record_scrape(
        EngineMetrics(0, 0, 0.1, None, None, scraped_at=1000.0, block_size=16), granted_before=0
    )
    second.metrics = None  # never scraped: nothing to say yet
    text = exposition(gateway)
    labels = {"backend": first.address, "region": first.region}
    itl, config = "vllm:inter_token_latency_seconds", "vllm:cache_config_info"
    assert value(text, "fairlane_backend_metrics_absent", **labels, series=itl) == 1
    assert value(text, "fairlane_backend_metrics_absent", **labels, series=config) == 0
    shown = {
        dict(sample)["backend"]
        for name, sample in parse_samples(text)
        if name == "fairlane_backend_metrics_absent"
    }
    assert shown == {first.address}


def test_thousands_of_made_up_users_and_models_cannot_grow_the_exposition() -> None:
    gateway = make_gateway(limit=64)
    gateway.policies.current = dataclasses.replace(
        gateway.policies.current,
        fairness=dataclasses.replace(gateway.policies.current.fairness, flow="user"),
    )
    gateway.admission.configure(gateway.policies.current)
    backend = gateway.admission.pool.backends[0].address

    def flood(start: int, count: int) -> None:
        for i in range(start, start + count):
            body = {"model": f"model-{i}", "prompt": "hi", "max_tokens": 1, "user": f"user-{i}"}
            info = request("sk-api-demo", body=body, path="/v1/completions", request_id=f"r{i}")
            assert isinstance(gateway.handle(info).answer, Forward)
            gateway.completed(Completion(f"r{i}", 200, backend, 0.1, 700, ttfb_s=0.05))

    flood(0, 1000)
    lines_after_1000 = len(exposition(gateway).splitlines())
    flood(1000, 4000)
    text = exposition(gateway)
    assert len(text.splitlines()) == lines_after_1000  # 5000 values: not one more series
    models = {
        labels for name, labels in parse_samples(text) if name == "fairlane_requests_admitted_total"
    }
    assert len(models) == 51  # the first 50 models, then "other"
    assert value(text, "fairlane_requests_admitted_total", tier="api", model="other") == 4950
    assert value(text, "fairlane_flow_requests_total", tier="api", flow="other") == 4800


def test_seats_show_each_backends_count_and_source_the_fleet_and_each_tiers_reserve() -> None:
    """One ``fairlane_backend_seats`` series per backend, labelled with where its count
    comes now (a learned count replaces the fallback series), the fleet's seats and each
    tier's reserve by name (0 for a tier that reserves nothing)."""
    clock = FakeClock()
    pool = BackendPool(
        [BackendSpec("127.0.0.1", 8001, "east"), BackendSpec("127.0.0.1", 8002, "west", seats=6)],
        clock=clock,
    )
    learning, declared = pool.backends
    tiers = (dataclasses.replace(INTERACTIVE, reserved_share=0.5), API, BATCH)
    admission = Admission(pool, policy(limit=32, tiers=tiers))
    collector = GatewayCollector(admission, GatewayStats())

    def render() -> str:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        return generate_latest(registry).decode()

    def seats(text: str) -> dict[tuple[str, str], float]:
        return {
            (dict(labels)["backend"], dict(labels)["source"]): v
            for (name, labels), v in parse_samples(text).items()
            if name == "fairlane_backend_seats"
        }

    text = render()
    assert seats(text) == {
        (learning.address, "fallback"): FALLBACK_SEATS,
        (declared.address, "declared"): 6,
    }
    # a count not learned yet is being probed: one seat more in the fleet reserves share
    assert value(text, "fairlane_fleet_seats") == FALLBACK_SEATS + 1 + 6
    assert value(text, "fairlane_tier_reserved_seats", tier="interactive") == 1  # idle: 1 seat
    assert value(text, "fairlane_tier_reserved_seats", tier="api") == 0
    assert value(text, "fairlane_tier_reserved_seats", tier="batch") == 0

    # requests wait while KV has room for steps on end: the engine runs 12 at once
    for tokens in (10.0, 40.0):
        learning.record_scrape(EngineMetrics(3, 12, 0.4, tokens / 10, tokens, clock()), 0)
    text = render()
    assert seats(text) == {(learning.address, "learned"): 12, (declared.address, "declared"): 6}
    assert value(text, "fairlane_fleet_seats") == 18 == admission.capacity
    learning.healthy = False  # the fleet counts healthy backends only
    assert value(render(), "fairlane_fleet_seats") == 6


class Port:
    open_connections = 3
    open_streams = 17
    refused_connections = 2


def test_the_grpc_ports_connections_and_streams_are_exported() -> None:
    gateway = make_gateway()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        GatewayCollector(gateway.admission, gateway.stats, gateway.policies, port=Port())
    )
    text = generate_latest(registry).decode()
    assert value(text, "fairlane_grpc_connections") == 3
    assert value(text, "fairlane_grpc_streams") == 17
    assert value(text, "fairlane_grpc_connections_refused_total") == 2


def test_each_engines_models_are_exported_with_their_parent() -> None:
    gateway = make_gateway()
    pool = gateway.admission.pool
    first = pool.backends[0]
    pool.set_models(first, ServedModels(frozenset({"tiny"}), {"ad1": "tiny"}))
    text = exposition(gateway)
    labels = {"backend": first.address, "region": first.region}
    assert value(text, "fairlane_backend_model", **labels, model="tiny", parent="") == 1
    assert value(text, "fairlane_backend_model", **labels, model="ad1", parent="tiny") == 1


def test_the_queue_is_exported_per_tier_and_model_pool() -> None:
    gateway = two_pools(limit=2)
    for i in range(4):  # batch takes one free seat a scrape: the rest wait in qwen's band
        gateway.handle(chat("qwen-7b", request_id=f"q{i}", key="sk-batch-demo"))
    text = exposition(gateway)
    assert value(text, "fairlane_pool_queue_depth", tier="batch", pool="qwen-7b") == 3
    assert value(text, "fairlane_pool_queue_depth", tier="batch", pool="") == 0
    assert value(text, "fairlane_queue_depth", tier="batch") == 3
