"""Per-route fail-open / fail-closed when the ext_proc service is down.

The ext_proc filter itself is always fail-closed (``failure_mode_allow: false``); a route the
deployment marks ``failure_mode: open`` carries an ``ExtProcPerRoute`` override. The last
test starts the real Envoy with NO service listening and checks what clients get: the
fail-closed route answers Envoy's ``status_on_error`` (503) and never reaches a backend; a
fail-open route reaches the backend, unprocessed.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from extproc.envoy.binary import envoy_argv, validate
from extproc.envoy.bootstrap import render_bootstrap, render_yaml
from extproc.envoy.deployment import DeploymentError, parse_deployment
from extproc.envoy.filter import EXT_PROC_PER_ROUTE_TYPE, ext_proc_filter
from extproc.envoy.overload import OVERLOAD_SUFFIX
from extproc.envoy.params import CATCH_ALL_ROUTE, EnvoyConfigError, EnvoyParams, RouteSpec
from extproc.envoy.render import render, typed_check
from extproc.envoy.snippet import render_mesh_snippet
from extproc.fleet.backend import BackendSpec
from extproc.ops.processes import ProcessGroup, free_port, wait_http_ready
from extproc.wire import EXT_PROC_FILTER
from tests.http_backends import serve_every_path

OPEN_ROUTES = (
    RouteSpec("fairlane_models", prefix="/v1/models", failure_mode_allow=True),
    RouteSpec("fairlane_health", path="/health", failure_mode_allow=True),
    RouteSpec("fairlane_completions", prefix="/v1/completions"),  # explicitly closed
)


def _routes(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    """The routes through the service; their overload twins are tested in test_overload.py."""
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    routes: list[dict[str, Any]] = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    return [r for r in routes if not r["name"].endswith(OVERLOAD_SUFFIX)]


def _allows(route: dict[str, Any]) -> bool:
    """What Envoy does for this route when the service fails (the filter default: closed)."""
    override = route.get("typed_per_filter_config", {}).get(EXT_PROC_FILTER)
    if override is None:
        return False
    assert override["@type"] == EXT_PROC_PER_ROUTE_TYPE
    allow: bool = override["overrides"]["failure_mode_allow"]
    return allow


def test_default_render_has_no_overrides() -> None:
    """The shipped configs are unchanged: one fail-closed catch-all, no per-route config."""
    (route,) = _routes(render_bootstrap(EnvoyParams()))
    assert route["name"] == CATCH_ALL_ROUTE
    assert "typed_per_filter_config" not in route
    assert ext_proc_filter(EnvoyParams())["typed_config"]["failure_mode_allow"] is False


def test_extra_routes_come_first_with_their_failure_mode() -> None:
    params = EnvoyParams(routes=OPEN_ROUTES)
    routes = _routes(render_bootstrap(params))
    assert [r["name"] for r in routes] == [*(s.name for s in OPEN_ROUTES), CATCH_ALL_ROUTE]
    assert [r["match"] for r in routes] == [
        {"prefix": "/v1/models"},
        {"path": "/health"},
        {"prefix": "/v1/completions"},
        {"prefix": "/"},
    ]
    assert [_allows(r) for r in routes] == [True, True, False, False]
    # the filter stays fail-closed: a route someone adds without an override is safe
    assert ext_proc_filter(params)["typed_config"]["failure_mode_allow"] is False
    # everything but name, match and the override is the catch-all's (retries, timeouts...)
    catch_all = routes[-1]
    for extra in routes[:-1]:
        assert extra["route"] == catch_all["route"]
        assert extra["response_headers_to_add"] == catch_all["response_headers_to_add"]
    # the mesh snippet carries the same routes, each also enabling the (scoped) filter
    snippet_routes = render_mesh_snippet(params)["routes"]
    assert [_allows(r) for r in snippet_routes] == [True, True, False, False]
    for pasted, bootstrap_route in zip(snippet_routes, routes, strict=True):
        assert "typed_per_filter_config" in pasted
        assert {k: v for k, v in pasted.items() if k != "typed_per_filter_config"} == {
            k: v for k, v in bootstrap_route.items() if k != "typed_per_filter_config"
        }


def test_catch_all_can_fail_open() -> None:
    (route,) = _routes(render_bootstrap(EnvoyParams(failure_mode_allow=True)))
    assert _allows(route)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "x"}, "exactly one of prefix and path"),
        ({"name": "x", "prefix": "/a", "path": "/b"}, "exactly one of prefix and path"),
        ({"name": "x", "prefix": "v1"}, "must start with '/'"),
        ({"name": CATCH_ALL_ROUTE, "prefix": "/a"}, "route name"),
        ({"name": "", "prefix": "/a"}, "route name"),
    ],
)
def test_bad_route_specs(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(EnvoyConfigError, match=message):
        RouteSpec(**kwargs)


def test_duplicate_route_names() -> None:
    spec = RouteSpec("same", prefix="/a")
    with pytest.raises(EnvoyConfigError, match="listed twice"):
        EnvoyParams(routes=(spec, RouteSpec("same", prefix="/b")))


def test_typed_check_and_envoy_accept_the_overrides(tmp_path: Path) -> None:
    params = EnvoyParams(routes=OPEN_ROUTES, failure_mode_allow=True)
    typed_check(render_bootstrap(params))
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(params))
    validate(path)


DEPLOYMENT = """\
backends:
  - {url: http://127.0.0.1:8101, region: a}
failure_mode: closed
routes:
  - {name: models, prefix: /v1/models, failure_mode: open}
  - {path: /health, failure_mode: open}
  - {prefix: /v1/completions}
"""


def test_deployment_reads_routes_and_failure_modes() -> None:
    deployment = parse_deployment(DEPLOYMENT, "d.yaml")
    params = deployment.params
    assert params.failure_mode_allow is False
    assert params.routes == (
        RouteSpec("models", prefix="/v1/models", failure_mode_allow=True),
        RouteSpec("fairlane_route_1", path="/health", failure_mode_allow=True),
        RouteSpec("fairlane_route_2", prefix="/v1/completions", failure_mode_allow=False),
    )
    rendered = render(deployment)
    assert [_allows(r) for r in _routes(rendered.bootstrap)] == [True, True, False, False]


def test_deployment_route_errors_have_lines() -> None:
    text = """\
backends:
  - {url: http://127.0.0.1:8101}
failure_mode: maybe
routes:
  - {name: a, prefix: /a, path: /b}
  - {name: b, prefix: nope}
  - {name: c, prefix: /c, failure_mode: ajar}
  - {name: c, prefix: /d}
  - {name: fairlane_llm, prefix: /e}
  - {name: d, prefix: /f, when: always}
"""
    with pytest.raises(DeploymentError) as caught:
        parse_deployment(text, "d.yaml")
    errors = caught.value.errors
    assert "d.yaml:3: failure_mode: must be one of ['closed', 'open']" in errors
    assert "d.yaml:5: routes[0]: needs exactly one of `prefix` and `path`" in errors
    assert "d.yaml:6: routes[1].prefix: must start with '/'" in errors
    assert "d.yaml:7: routes[2].failure_mode: must be one of ['closed', 'open']" in errors
    assert "d.yaml:8: routes[3].name: 'c' is already taken" not in errors  # c was refused
    assert "d.yaml:9: routes[4].name: 'fairlane_llm' is already taken" in errors
    assert any(e.startswith("d.yaml:10: routes[5]") and "when" in e for e in errors), errors


def test_dns_backend_error_says_what_to_do() -> None:
    with pytest.raises(DeploymentError, match="write dns://NAME:PORT to follow every address"):
        parse_deployment("backends: [{url: 'http://sim-a:8000'}]\n", "d.yaml")


# --------------------------------------------------------------------------- real Envoy


OWNED_BY_THE_GATEWAY = {
    "authorization": "Bearer sk-chat-demo",
    "x-api-key": "sk-chat-demo",
    "x-priority": "high",
    "x-vllm-priority": "-100",
    "x-gateway-destination-endpoint": "127.0.0.1:1",
    "x-target-cluster": "fairlane_extproc",
    "x-fairlane-tier": "batch",
    "x-fairlane-tenant": "someone-else",
    "x-fairlane-client-authorization": "Bearer sk-chat-demo",
    "x-fairlane-anything": "1",
}
"""What a client may send that is the gateway's (its key, its tier ask, the headers only the
gateway sets): none of it may reach a backend, whether the service ran or not."""


async def _start_upstream(port: int, seen: list[dict[str, Any]]) -> Any:
    """A backend that records what reached it and answers 200 to everything."""
    from aiohttp import web

    async def echo(request: web.Request) -> web.Response:
        body = (await request.read()).decode()
        if request.headers.get("user-agent") != "Envoy/HC":  # Envoy's active health checks
            seen.append({"path": request.path, "headers": dict(request.headers), "body": body})
        return web.json_response({"reached": "backend", "path": request.path})

    return await serve_every_path(echo, port)


@pytest.mark.integration
async def test_real_envoy_with_the_service_down(processes: ProcessGroup, tmp_path: Path) -> None:
    import aiohttp

    listen, admin, backend_port = free_port(), free_port(), free_port()
    params = EnvoyParams(
        listen_port=listen,
        admin_port=admin,
        extproc_port=free_port(),  # nothing listens there: the service is down
        backends=(BackendSpec("127.0.0.1", backend_port, "region-a"),),
        routes=(
            RouteSpec("fairlane_models", prefix="/v1/models", failure_mode_allow=True),
            RouteSpec("fairlane_health", path="/health", failure_mode_allow=True),
        ),
    )
    config = tmp_path / "envoy.yaml"
    config.write_text(render_yaml(params))
    seen: list[dict[str, Any]] = []
    runner = await _start_upstream(backend_port, seen)
    try:
        envoy = processes.start("envoy", envoy_argv(config, concurrency=1))
        await asyncio.to_thread(wait_http_ready, f"http://127.0.0.1:{admin}/ready", envoy, 20)
        base = f"http://127.0.0.1:{listen}"
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as session:
            # fail-closed (generation, the catch-all): Envoy's status_on_error, no backend
            async with session.post(
                f"{base}/v1/chat/completions",
                json=chat,
                headers={"authorization": "Bearer sk-chat-demo"},
            ) as response:
                closed_status = response.status
                closed_body = await response.text()
            assert closed_status == 503, closed_body
            assert seen == []

            # fail-open: forwarded unprocessed to a backend Envoy picked, without anything
            # the gateway owns (Envoy strips it itself: the service is not there to)
            async with session.get(f"{base}/v1/models", headers=OWNED_BY_THE_GATEWAY) as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["reached"] == "backend"
                assert "x-fairlane-tier" not in response.headers
            async with session.get(f"{base}/health") as response:
                assert response.status == 200
            assert [r["path"] for r in seen] == ["/v1/models", "/health"]
            # unprocessed, and still no tenant key, tier ask or gateway header went through
            reached = {name.lower() for name in seen[0]["headers"]}
            assert not reached & set(OWNED_BY_THE_GATEWAY), seen[0]["headers"]
            assert not any(name.startswith("x-fairlane-") for name in reached), reached
            assert "sk-chat-demo" not in json.dumps(seen[0])

        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{admin}/stats?filter=ext_proc"
            async with session.get(url) as response:
                stats = await response.text()
        counters = dict(line.split(": ", 1) for line in stats.splitlines() if line.count(": ") == 1)
        assert int(counters["http.fairlane.ext_proc.fairlane.failure_mode_allowed"]) == 2, stats
        assert int(counters["http.fairlane.ext_proc.fairlane.streams_failed"]) >= 1, stats
    finally:
        await runner.cleanup()


async def _start_hanging_service(port: int) -> Any:
    """An ext_proc service that accepts the stream and never answers (a wedged service)."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

    class Hang(external_processor_pb2_grpc.ExternalProcessorServicer):
        async def Process(self, requests: Any, context: Any) -> None:  # grpc's method name
            # grpc.aio accepts a coroutine for a streaming method (answers via
            # context.write); this one reads everything and answers nothing.
            async for _ in requests:
                pass

    server = grpc.aio.server(
        options=[
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
    )
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(Hang(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


@pytest.mark.integration
async def test_real_envoy_with_a_wedged_service(processes: ProcessGroup, tmp_path: Path) -> None:
    """A service that never answers: fail-closed routes get 504 after message_timeout,
    fail-open routes are forwarded unprocessed after it."""
    import aiohttp

    listen, admin, backend_port, service_port = (free_port() for _ in range(4))
    params = EnvoyParams(
        listen_port=listen,
        admin_port=admin,
        extproc_port=service_port,
        backends=(BackendSpec("127.0.0.1", backend_port, "region-a"),),
        message_timeout_s=0.5,
        routes=(RouteSpec("fairlane_models", prefix="/v1/models", failure_mode_allow=True),),
    )
    config = tmp_path / "envoy.yaml"
    config.write_text(render_yaml(params))
    seen: list[dict[str, Any]] = []
    runner = await _start_upstream(backend_port, seen)
    server = await _start_hanging_service(service_port)
    try:
        envoy = processes.start("envoy", envoy_argv(config, concurrency=1))
        await asyncio.to_thread(wait_http_ready, f"http://127.0.0.1:{admin}/ready", envoy, 20)
        base = f"http://127.0.0.1:{listen}"
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as session:
            started = loop.time()
            async with session.post(f"{base}/v1/chat/completions", json={"model": "m"}) as response:
                assert response.status == 504, await response.text()
            assert loop.time() - started >= 0.4
            assert seen == []
            started = loop.time()
            async with session.get(f"{base}/v1/models") as response:
                assert response.status == 200, await response.text()
            assert loop.time() - started >= 0.4  # after the message timeout, not at once
            assert [r["path"] for r in seen] == ["/v1/models"]
    finally:
        await server.stop(0)
        await runner.cleanup()
