"""Envoy's half of overload shedding: the runtime layer, the shed twins, the buffer filter.

Structure checks on the rendered bootstrap, and ``envoy --mode validate`` on it; one real
Envoy run checks that the ``request.time`` it sends the service decodes to its arrival. What
a real Envoy does with the twins is tested in ``tests/integration/test_overload.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from extproc.core.errors import error_body
from extproc.core.gateway import OVERLOAD_RETRY_AFTER_S
from extproc.envoy.binary import envoy_argv, validate
from extproc.envoy.bootstrap import render_bootstrap, render_yaml
from extproc.envoy.filter import EXT_PROC_PER_ROUTE_TYPE
from extproc.envoy.mesh import MESHES, render_mesh_yaml
from extproc.envoy.overload import OVERLOAD_SUFFIX
from extproc.envoy.params import CATCH_ALL_ROUTE, EnvoyParams, RouteSpec
from extproc.envoy.render import typed_check
from extproc.envoy.snippet import render_mesh_snippet, render_mesh_snippet_yaml, wrap_snippet
from extproc.fleet.backend import BackendSpec
from extproc.ops.processes import ProcessGroup, free_port, wait_http_ready
from extproc.transport import codec
from extproc.wire import EXT_PROC_FILTER, EXTPROC_CLUSTER, RUNTIME_LAYER, SHED_RUNTIME_KEY
from tests.extproc.envoy.filters import ext_proc_of

ROUTES = (
    RouteSpec("models", prefix="/v1/models", failure_mode_allow=True),
    RouteSpec("health", path="/health", failure_mode_allow=True),
    RouteSpec("completions", prefix="/v1/completions"),  # fail-closed
)
SHED_BODY = error_body(503, "the gateway is overloaded; retry later", "gateway_overloaded")
PARAMS = {
    "default": EnvoyParams(),
    "routes": EnvoyParams(routes=ROUTES),
    "routes_open": EnvoyParams(routes=ROUTES, failure_mode_allow=True),
}


def _hcm(bootstrap: dict[str, Any]) -> dict[str, Any]:
    listener = bootstrap["static_resources"]["listeners"][0]
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def _routes(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = _hcm(bootstrap)["route_config"]["virtual_hosts"][0]["routes"]
    return routes


def _pairs(params: EnvoyParams) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(twin, route) in match order; asserts they alternate."""
    routes = _routes(render_bootstrap(params))
    assert len(routes) % 2 == 0
    twins, owns = routes[0::2], routes[1::2]
    assert [t["name"] for t in twins] == [o["name"] + OVERLOAD_SUFFIX for o in owns]
    assert not any(o["name"].endswith(OVERLOAD_SUFFIX) for o in owns)
    return list(zip(twins, owns, strict=True))


def _allows(route: dict[str, Any], params: EnvoyParams) -> bool:
    if route["name"] == CATCH_ALL_ROUTE:
        return params.failure_mode_allow
    (spec,) = [s for s in params.routes if s.name == route["name"]]
    return spec.failure_mode_allow


def test_each_route_is_preceded_by_its_twin_in_order() -> None:
    pairs = _pairs(PARAMS["routes"])
    assert [own["name"] for _, own in pairs] == [*(s.name for s in ROUTES), CATCH_ALL_ROUTE]
    assert [twin["name"] for twin, _ in pairs] == [
        "models_overloaded",
        "health_overloaded",
        "completions_overloaded",
        f"{CATCH_ALL_ROUTE}_overloaded",
    ]
    (only,) = _pairs(PARAMS["default"])
    assert only[1]["name"] == CATCH_ALL_ROUTE


@pytest.mark.parametrize("name", PARAMS)
def test_a_twin_matches_its_route_drawn_with_the_shed_fraction(name: str) -> None:
    for twin, own in _pairs(PARAMS[name]):
        match = dict(twin["match"])
        fraction = match.pop("runtime_fraction")
        assert match == own["match"]
        assert "runtime_fraction" not in own["match"]  # the route itself always matches
        assert fraction == {
            "default_value": {"numerator": 0, "denominator": "HUNDRED"},
            "runtime_key": SHED_RUNTIME_KEY,
        }


@pytest.mark.parametrize("name", PARAMS)
def test_a_twin_never_reaches_the_service(name: str) -> None:
    for twin, _ in _pairs(PARAMS[name]):
        per_filter = twin["typed_per_filter_config"]
        assert per_filter == {EXT_PROC_FILTER: {"@type": EXT_PROC_PER_ROUTE_TYPE, "disabled": True}}


@pytest.mark.parametrize("name", PARAMS)
def test_a_fail_closed_twin_answers_503_with_an_openai_error_and_retry_after(name: str) -> None:
    params = PARAMS[name]
    closed = [(t, o) for t, o in _pairs(params) if not _allows(o, params)]
    assert closed or name == "routes_open"
    for twin, _ in closed:
        assert "route" not in twin
        response = twin["direct_response"]
        assert response["status"] == 503
        body = response["body"]["inline_string"]
        assert body.encode() == SHED_BODY
        assert json.loads(body)["error"]["code"] == "gateway_overloaded"
        headers = {
            h["header"]["key"]: h["header"]["value"] for h in twin["response_headers_to_add"]
        }
        assert headers == {
            "retry-after": str(OVERLOAD_RETRY_AFTER_S),
            "content-type": "application/json",
        }


@pytest.mark.parametrize("name", ["routes", "routes_open"])
def test_a_fail_open_twin_forwards_unscheduled_with_the_routes_own_action(name: str) -> None:
    params = PARAMS[name]
    opened = [(t, o) for t, o in _pairs(params) if _allows(o, params)]
    assert len(opened) == (2 if name == "routes" else 3)  # + the catch-all
    for twin, own in opened:
        assert twin["route"] == own["route"]
        assert "direct_response" not in twin


def test_which_twins_forward_follows_each_routes_failure_mode() -> None:
    kinds = [
        "route" if "route" in twin else "direct_response" for twin, _ in _pairs(PARAMS["routes"])
    ]
    assert kinds == ["route", "route", "direct_response", "direct_response"]


@pytest.mark.parametrize("name", PARAMS)
def test_the_bootstrap_subscribes_to_the_services_runtime_layer(name: str) -> None:
    bootstrap = render_bootstrap(PARAMS[name])
    assert bootstrap["node"]["id"] and bootstrap["node"]["cluster"]  # RTDS needs a node
    rtds, admin = bootstrap["layered_runtime"]["layers"]
    assert rtds["name"] == RUNTIME_LAYER
    assert rtds["rtds_layer"]["name"] == RUNTIME_LAYER
    config = rtds["rtds_layer"]["rtds_config"]
    assert config["resource_api_version"] == "V3"
    source = config["api_config_source"]
    assert source["api_type"] == "GRPC" and source["transport_api_version"] == "V3"
    assert source["grpc_services"] == [{"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}}]
    clusters = [c["name"] for c in bootstrap["static_resources"]["clusters"]]
    assert EXTPROC_CLUSTER in clusters
    # the admin layer last: /runtime_modify overrides what the service publishes
    assert admin == {"name": "admin", "admin_layer": {}}


@pytest.mark.parametrize("name", PARAMS)
def test_the_buffer_filter_sits_between_ext_proc_and_the_router(name: str) -> None:
    params = PARAMS[name]
    filters = _hcm(render_bootstrap(params))["http_filters"]
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.header_mutation",  # the client's copies of owned headers go first
        EXT_PROC_FILTER,
        "envoy.filters.http.buffer",
        "envoy.filters.http.router",
    ]
    buffer = filters[2]["typed_config"]
    assert buffer["@type"].endswith("envoy.extensions.filters.http.buffer.v3.Buffer")
    assert buffer["max_request_bytes"] == params.buffer_limit_bytes


def test_the_ext_proc_filter_asks_for_the_request_time() -> None:
    ext_proc = ext_proc_of(_hcm(render_bootstrap(EnvoyParams())))["typed_config"]
    assert "request.time" in ext_proc["request_attributes"]


def test_the_mesh_snippet_and_the_mesh_renders_have_no_twins() -> None:
    params = EnvoyParams(
        routes=ROUTES,
        extproc_host="fairlane.llm.svc.cluster.local",  # what a mesh config needs
        backends=(BackendSpec("10.0.0.11", 8000, "a"), BackendSpec("10.0.0.12", 8000, "a")),
    )
    snippet = render_mesh_snippet(params)
    assert [r["name"] for r in snippet["routes"]] == [*(s.name for s in ROUTES), CATCH_ALL_ROUTE]
    assert not any("runtime_fraction" in r["match"] for r in snippet["routes"])
    assert "layered_runtime" not in wrap_snippet(snippet)
    assert [f["name"] for f in snippet["http_filters"]] == [EXT_PROC_FILTER]
    texts = [render_mesh_snippet_yaml(params)] + [
        render_mesh_yaml(params, mesh, "test") for mesh in MESHES
    ]
    for text in texts:
        assert OVERLOAD_SUFFIX not in text and SHED_RUNTIME_KEY not in text


@pytest.mark.parametrize("name", PARAMS)
def test_typed_check_and_envoy_accept_it(name: str, tmp_path: Path) -> None:
    params = PARAMS[name]
    typed_check(render_bootstrap(params))
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(params))
    assert yaml.safe_load(path.read_text()) == render_bootstrap(params)
    validate(path)


class Recorder(external_processor_pb2_grpc.ExternalProcessorServicer):
    """An ext_proc service that keeps each request's headers message and answers 418."""

    def __init__(self) -> None:
        self.headers: list[pb.ProcessingRequest] = []

    async def Process(  # grpc's method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in request_iterator:
            if codec.kind(message) == "request_headers":
                self.headers.append(message)
                yield codec.continue_headers()
            else:
                yield pb.ProcessingResponse(
                    immediate_response=pb.ImmediateResponse(status={"code": 418})
                )
                return


@pytest.mark.integration
async def test_real_envoy_sends_the_request_time_the_codec_reads(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    recorder = Recorder()
    server = grpc.aio.server()
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(recorder, server)
    service_port, listen, admin = free_port(), free_port(), free_port()
    server.add_insecure_port(f"127.0.0.1:{service_port}")
    await server.start()
    try:
        params = EnvoyParams(
            listen_port=listen,
            admin_port=admin,
            extproc_port=service_port,
            backends=(BackendSpec("127.0.0.1", free_port(), "a"),),
        )
        config = tmp_path / "envoy.yaml"
        config.write_text(render_yaml(params))
        envoy = processes.start("envoy", envoy_argv(config, concurrency=1))
        await asyncio.to_thread(wait_http_ready, f"http://127.0.0.1:{admin}/ready", envoy, 20)
        sent_at = time.time()
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.post(f"http://127.0.0.1:{listen}/v1/chat/completions", data=b"{}") as r,
        ):
            assert r.status == 418
        answered_at = time.time()
        (message,) = recorder.headers
        received_at = codec.decode_headers(message).received_at
        assert received_at is not None, message.attributes
        # Envoy's clock is this machine's: its arrival lies between send and answer.
        assert sent_at - 0.01 <= received_at <= answered_at + 0.01
    finally:
        await server.stop(grace=None)
