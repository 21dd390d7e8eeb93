"""The snippets for existing meshes in deploy/mesh/: fresh, consistent, and valid Envoy config.

All three are rendered from one deployment (deploy/mesh/fairlane.yaml) by ``fairlane
render-envoy`` with the builders in extproc/envoy/, so they cannot drift from the bootstrap:
the tests re-render them and compare, then check each against those builders. The plain
Envoy snippet is wrapped in a minimal bootstrap and validated by Envoy; Istio's EnvoyFilter
patches must be the rendered config and, applied to a stand-in of Istio's gateway config,
form a bootstrap Envoy accepts; Envoy Gateway's objects are checked field by field against
the rendered config and cross-referenced (every targetRef and backendRef names an object in
the file), since no cheap package ships Envoy Gateway's CRD schemas.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.envoy.binary import envoy_argv, validate
from extproc.envoy.clusters import backend_cluster, extproc_cluster, replica_clusters
from extproc.envoy.connection_manager import hcm_settings
from extproc.envoy.deployment import Deployment, load_deployment
from extproc.envoy.filter import ext_proc_filter
from extproc.envoy.mesh import VLLM_SERVICE, route_merge
from extproc.envoy.mesh.envoy_gateway import kube_name
from extproc.envoy.mesh.istio import ISTIO_HEADER, backend_cluster_merge, istio_bootstrap
from extproc.envoy.params import RETRY_ON, EnvoyParams
from extproc.envoy.render import render, typed_check
from extproc.envoy.routes import routes
from extproc.envoy.snippet import render_mesh_snippet, wrap_snippet
from extproc.ops.processes import ProcessGroup, free_port, wait_http_ready
from extproc.wire import DESTINATION_HEADER, EXT_PROC_FILTER, EXTPROC_CLUSTER
from tests.deploy.conftest import REPO
from tests.http_backends import serve_every_path

MESH = REPO / "deploy" / "mesh"
DEPLOYMENT = MESH / "fairlane.yaml"
SNIPPETS: dict[str, dict[str, Any]] = {
    "envoy-snippet.yaml": {"snippet": True},
    "istio.yaml": {"mesh": "istio"},
    "envoy-gateway.yaml": {"mesh": "envoy-gateway"},
}
# Gateway API's Duration
GATEWAY_API_DURATION = re.compile(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")


@pytest.fixture(scope="module")
def deployment() -> Deployment:
    return load_deployment(DEPLOYMENT)


def objects(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((MESH / name).read_text()) if doc is not None]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    return found


@pytest.mark.parametrize("name", SNIPPETS)
def test_snippet_is_fresh(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # headers name files relative to the working directory
    fresh = render(load_deployment(DEPLOYMENT.relative_to(REPO)), **SNIPPETS[name]).text
    flag = "--snippet" if name == "envoy-snippet.yaml" else f"--mesh {SNIPPETS[name]['mesh']}"
    assert (MESH / name).read_text() == fresh, (
        f"deploy/mesh/{name} is stale: fairlane render-envoy deploy/mesh/fairlane.yaml "
        f"{flag} -o deploy/mesh/{name}"
    )


def test_plain_envoy_snippet_validates(deployment: Deployment, tmp_path: Path) -> None:
    snippet = yaml.safe_load((MESH / "envoy-snippet.yaml").read_text())
    assert snippet == render_mesh_snippet(deployment.params)
    path = tmp_path / "wrapped.yaml"
    path.write_text(yaml.safe_dump(wrap_snippet(snippet)))
    typed_check(wrap_snippet(snippet))
    validate(path)


def test_shipped_envoy_mesh_snippet_is_referenced() -> None:
    """envoy/mesh-snippet.yaml (EnvoyParams defaults) is validated by
    tests/extproc/envoy/test_bootstrap.py; the deploy README points at both it and the
    deployment-specific one here."""
    readme = (REPO / "deploy" / "README.md").read_text()
    assert "envoy/mesh-snippet.yaml" in readme
    assert "mesh/envoy-snippet.yaml" in readme


# --------------------------------------------------------------------------- Istio


def test_istio_patches_are_the_rendered_config(deployment: Deployment) -> None:
    params = deployment.params
    docs = objects("istio.yaml")
    envoy_filter = one(docs, "EnvoyFilter")
    assert envoy_filter["apiVersion"] == "networking.istio.io/v1alpha3"
    patches = envoy_filter["spec"]["configPatches"]
    by_target: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for patch in patches:
        assert patch["match"]["context"] == "GATEWAY"
        key = (patch["applyTo"], patch["patch"]["operation"])
        by_target.setdefault(key, []).append(patch)

    (http_filter,) = by_target[("HTTP_FILTER", "INSERT_BEFORE")]
    subfilter = http_filter["match"]["listener"]["filterChain"]["filter"]["subFilter"]
    assert subfilter == {"name": "envoy.filters.http.router"}
    # the rendered filter, but off unless a route enables it (other apps share the gateway)
    assert http_filter["patch"]["value"] == {**ext_proc_filter(params), "disabled": True}
    assert http_filter["patch"]["value"]["name"] == EXT_PROC_FILTER

    (hcm,) = by_target[("NETWORK_FILTER", "MERGE")]
    settings = dict(hcm["patch"]["value"]["typed_config"])
    settings.pop("@type")
    assert settings == hcm_settings(params)

    (listener,) = by_target[("LISTENER", "MERGE")]
    assert listener["patch"]["value"] == {
        "per_connection_buffer_limit_bytes": params.buffer_limit_bytes
    }

    # the ext_proc cluster (every replica, with failover), then each replica's own cluster
    # for its completion feed, each holding one per-pod Service of the StatefulSet
    added = [patch["patch"]["value"] for patch in by_target[("CLUSTER", "ADD")]]
    assert added == [extproc_cluster(params), *replica_clusters(params)]
    assert added[0]["type"] == "STRICT_DNS"
    assert "health_checks" in added[0] and "outlier_detection" in added[0]
    pod_services = {d["metadata"]["name"] for d in by_kind(docs, "Service")}
    for cluster, replica in zip(added[1:], params.service_replicas, strict=True):
        (group,) = cluster["load_assignment"]["endpoints"]
        (endpoint,) = group["lb_endpoints"]
        host = endpoint["endpoint"]["address"]["socket_address"]["address"]
        assert host == replica.host
        assert host.split(".", 1)[0] in pod_services

    (merged,) = by_target[("CLUSTER", "MERGE")]
    assert merged["patch"]["value"] == backend_cluster_merge(params)
    override = merged["patch"]["value"]["load_balancing_policy"]["policies"][0]
    assert override["typed_extension_config"]["name"] == (
        "envoy.load_balancing_policies.override_host"
    )
    assert merged["match"]["cluster"] == {
        "service": f"{VLLM_SERVICE}.llm.svc.cluster.local",
        "portNumber": 8000,
    }

    rendered_routes = routes(params)
    route_patches = by_target[("HTTP_ROUTE", "MERGE")]
    for patch, rendered in zip(route_patches, rendered_routes, strict=True):
        value = dict(patch["patch"]["value"])
        expected = route_merge(rendered)
        value.pop("typed_per_filter_config")
        expected.pop("typed_per_filter_config", None)  # the fail-open route's override
        assert value == expected
    patched_names = [
        p["match"]["routeConfiguration"]["vhost"]["route"]["name"] for p in route_patches
    ]
    assert patched_names == [r["name"] for r in rendered_routes]
    # every fairlane route enables the filter, with its own failure mode
    allows = [
        p["patch"]["value"]["typed_per_filter_config"][EXT_PROC_FILTER]["overrides"][
            "failure_mode_allow"
        ]
        for p in route_patches
    ]
    assert allows == [spec.failure_mode_allow for spec in params.routes] + [False]


def test_istio_routes_and_workload_agree(deployment: Deployment) -> None:
    params = deployment.params
    docs = objects("istio.yaml")
    virtual_service = one(docs, "VirtualService")["spec"]
    assert virtual_service["gateways"] == [one(docs, "Gateway")["metadata"]["name"]]
    assert [h["name"] for h in virtual_service["http"]] == [r["name"] for r in routes(params)]
    for http, rendered in zip(virtual_service["http"], routes(params), strict=True):
        (kind, value) = next(iter(rendered["match"].items()))
        assert http["match"] == [{"uri": {"prefix" if kind == "prefix" else "exact": value}}]
        assert http["retries"]["retryOn"] == RETRY_ON
        assert http["timeout"] == "0s"
    _check_workload(docs, deployment)


def test_istio_patched_config_validates(tmp_path: Path) -> None:
    """The patch values, applied where Istio applies them, make a config Envoy accepts."""
    bootstrap = istio_bootstrap(objects("istio.yaml"))
    filters = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
    http_filters = filters[0]["typed_config"]["http_filters"]
    assert [f["name"] for f in http_filters] == [EXT_PROC_FILTER, "envoy.filters.http.router"]
    typed_check(bootstrap)
    path = tmp_path / "istio-bootstrap.yaml"
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    validate(path)


def test_istio_header_states_what_it_needs() -> None:
    text = (MESH / "istio.yaml").read_text()
    assert text.split("---", 1)[0].count(ISTIO_HEADER.splitlines()[0]) == 1
    for needed in ("override_host", "EnvoyFilter", "1.40", "x-gateway-destination-endpoint"):
        assert needed in text.split("---", 1)[0]


# --------------------------------------------------------------------------- Envoy Gateway


def test_envoy_gateway_objects_derive_from_the_rendered_config(deployment: Deployment) -> None:
    params = deployment.params
    docs = objects("envoy-gateway.yaml")
    filter_config = ext_proc_filter(params)["typed_config"]
    mode = filter_config["processing_mode"]
    assert (mode["request_header_mode"], mode["request_body_mode"]) == ("SEND", "BUFFERED")
    assert (mode["response_header_mode"], mode["response_body_mode"]) == ("SKIP", "NONE")
    assert filter_config["allow_mode_override"] is True

    rendered_routes = routes(params)
    http_routes = by_kind(docs, "HTTPRoute")
    assert [r["metadata"]["name"] for r in http_routes] == [
        kube_name(r["name"]) for r in rendered_routes
    ]
    failure_modes = [spec.failure_mode_allow for spec in params.routes] + [
        params.failure_mode_allow
    ]
    for http_route, rendered, allow in zip(
        http_routes, rendered_routes, failure_modes, strict=True
    ):
        name = http_route["metadata"]["name"]
        (rule,) = http_route["spec"]["rules"]
        (kind, value) = next(iter(rendered["match"].items()))
        assert rule["matches"] == [
            {"path": {"type": "PathPrefix" if kind == "prefix" else "Exact", "value": value}}
        ]
        assert rule["backendRefs"] == [{"name": VLLM_SERVICE, "port": 8000}]

        policy = one(docs, "EnvoyExtensionPolicy", name)
        assert policy["apiVersion"] == "gateway.envoyproxy.io/v1alpha1"
        assert policy["spec"]["targetRefs"] == [
            {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": name}
        ]
        (ext_proc,) = policy["spec"]["extProc"]
        # request present = headers SEND; body Buffered; no response = SKIP/NONE, unless
        # the service overrides it for one request
        assert ext_proc["processingMode"] == {
            "request": {"body": "Buffered"},
            "allowModeOverride": True,
        }
        assert ext_proc["failOpen"] is allow
        assert (
            ext_proc["metadata"]["writableNamespaces"]
            == (filter_config["metadata_options"]["receiving_namespaces"]["untyped"])
        )
        timeout = ext_proc["messageTimeout"]
        assert GATEWAY_API_DURATION.match(timeout)
        assert float(timeout.rstrip("s")) >= params.longest_hold_s  # the hold must fit in it
        # every replica, each at its pod's own Service, with the replicas' health checks
        assert _service_refs(docs, ext_proc["backendRefs"], params.extproc_port) == (
            _pod_services(params)
        )
        checks = ext_proc["backendSettings"]["healthCheck"]
        cluster = extproc_cluster(params)
        assert checks["active"]["type"] == "TCP"
        assert checks["active"]["interval"] == cluster["health_checks"][0]["interval"]
        assert (
            checks["passive"]["consecutiveLocalOriginFailures"]
            == (cluster["outlier_detection"]["consecutive_local_origin_failure"])
        )
        assert checks["passive"]["splitExternalLocalOriginErrors"] is True

    traffic = one(docs, "BackendTrafficPolicy")["spec"]
    assert {ref["name"] for ref in traffic["targetRefs"]} == {
        r["metadata"]["name"] for r in http_routes
    }
    override_sources = backend_cluster(params)["load_balancing_policy"]["policies"][0][
        "typed_extension_config"
    ]["typed_config"]["override_host_sources"]
    assert {"header": DESTINATION_HEADER} in override_sources
    assert traffic["loadBalancer"]["endpointOverride"] == {
        "extractFrom": [{"header": DESTINATION_HEADER}]
    }
    assert ",".join(traffic["retry"]["retryOn"]["triggers"]) == RETRY_ON
    assert traffic["timeout"]["http"]["requestTimeout"] == "0s"
    breakers = backend_cluster(params)["circuit_breakers"]["thresholds"][0]
    assert traffic["circuitBreaker"]["maxParallelRetries"] == breakers["max_retries"]
    assert traffic["circuitBreaker"]["maxParallelRequests"] == breakers["max_requests"]

    client = one(docs, "ClientTrafficPolicy")["spec"]
    gateway = one(docs, "Gateway")
    assert client["targetRefs"][0]["name"] == gateway["metadata"]["name"]
    assert int(client["connection"]["bufferLimit"]) == params.buffer_limit_bytes
    idle = client["timeout"]["http"]["streamIdleTimeout"]
    assert GATEWAY_API_DURATION.match(idle)
    assert float(idle.rstrip("s")) == params.stream_idle_timeout_s


def test_envoy_gateway_completion_feed_and_references(deployment: Deployment) -> None:
    params = deployment.params
    docs = objects("envoy-gateway.yaml")
    gateway = one(docs, "Gateway")
    ref = gateway["spec"]["infrastructure"]["parametersRef"]
    proxy = one(docs, ref["kind"], ref["name"])
    (setting,) = proxy["spec"]["telemetry"]["accessLog"]["settings"]
    # one sink per replica, each to that replica alone: every replica gets every completion
    sinks = setting["sinks"]
    als = hcm_settings(params)["access_log"][0]["typed_config"]["common_config"]
    targets = []
    for sink in sinks:
        assert sink["type"] == "ALS"
        assert sink["als"]["type"] == "HTTP"
        assert sink["als"]["logName"] == als["log_name"]
        (target,) = _service_refs(docs, sink["als"]["backendRefs"], params.extproc_port)
        targets.append(target)
    assert targets == _pod_services(params)
    for route in by_kind(docs, "HTTPRoute"):
        assert route["spec"]["parentRefs"] == [{"name": gateway["metadata"]["name"]}]
    namespaces = {doc["metadata"]["namespace"] for doc in docs}
    assert namespaces == {"llm"}  # one namespace: no ReferenceGrant needed
    _check_workload(docs, deployment)


def test_envoy_gateway_header_states_what_it_needs() -> None:
    header = (MESH / "envoy-gateway.yaml").read_text().split("---", 1)[0]
    for needed in (
        "not tried on a cluster",
        "endpointOverride",
        "override_host",
        "max_message_timeout",
        "500",
    ):
        assert needed in header


# --------------------------------------------------------------------------- shared


def _service_refs(docs: list[dict[str, Any]], refs: list[dict[str, Any]], port: int) -> list[str]:
    """The Services ``refs`` name (each must exist and serve ``port``), in order."""
    for ref in refs:
        service = one(docs, "Service", ref["name"])
        assert ref["port"] == port
        assert port in [p["port"] for p in service["spec"]["ports"]]
    return [ref["name"] for ref in refs]


def _pod_services(params: EnvoyParams) -> list[str]:
    """The per-pod Services the replicas are reached at (fairlane-0, ...)."""
    return [replica.host.split(".", 1)[0] for replica in params.service_replicas]


def _check_workload(docs: list[dict[str, Any]], deployment: Deployment) -> None:
    """fairlane's StatefulSet serves on the Service's port, lists the deployment's backends
    (the ip:port override_host matches), runs one replica per pod sharing the deployment's
    Redis, and each pod has a Service of its own, selecting just that pod."""
    params = deployment.params
    service = one(docs, "Service", "fairlane")
    workload = one(docs, "StatefulSet", "fairlane")
    assert not by_kind(docs, "Deployment")
    assert service["spec"]["selector"] == workload["spec"]["selector"]["matchLabels"]
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["appProtocol"] == "kubernetes.io/h2c"
    assert params.extproc_host.startswith(f"{service['metadata']['name']}.")
    spec = workload["spec"]
    assert spec["replicas"] == len(params.service_replicas) == 3
    assert spec["serviceName"] == "fairlane"
    (container,) = spec["template"]["spec"]["containers"]
    args = container["args"]
    assert f"--port={grpc['targetPort']}" in args
    assert [a.split("=", 1)[1] for a in args if a.startswith("--backend=")] == [
        f"{b.region}={b.url}" for b in params.backends
    ]
    assert f"--state={params.state_url}" in args
    assert "--replica-id=$(POD_NAME)" in args
    assert container["env"] == [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    ]
    for ordinal, name in enumerate(_pod_services(params)):
        assert name == f"fairlane-{ordinal}"  # the StatefulSet's pod of that ordinal
        pod_service = one(docs, "Service", name)
        assert pod_service["spec"]["selector"] == {
            **spec["selector"]["matchLabels"],
            "statefulset.kubernetes.io/pod-name": name,
        }
        assert pod_service["spec"]["ports"] == service["spec"]["ports"]


async def fairlane_and_another_app(
    processes: ProcessGroup, tmp_path: Path, bootstrap: dict[str, Any]
) -> tuple[tuple[int, int, int], dict[str, str]]:
    """Run ``bootstrap`` on the real Envoy, on loopback, with no fairlane service (its
    cluster points at a port nothing listens on) and another application's route put in
    front of fairlane's, the way a mesh adds it (no per-route config for ext_proc).

    Returns the statuses of a generation request, ``GET /v1/models`` and the other app's
    request, and Envoy's ext_proc stats."""
    import aiohttp
    from aiohttp import web

    listen, admin, backend, dead = (free_port() for _ in range(4))
    bootstrap["admin"] = {
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}
    }
    (listener,) = bootstrap["static_resources"]["listeners"]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen}

    def on_loopback(port: int) -> list[dict[str, Any]]:
        return [
            {
                "endpoint": {
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}
                }
            }
        ]

    for cluster in bootstrap["static_resources"]["clusters"]:
        endpoints = cluster["load_assignment"]["endpoints"]
        if cluster["name"].startswith(EXTPROC_CLUSTER):  # the service (every replica) is down
            cluster["type"] = "STATIC"
            endpoints[0]["lb_endpoints"] = on_loopback(dead)
        else:  # the vLLM cluster: every locality on the local backend
            for locality in endpoints:
                locality["lb_endpoints"] = on_loopback(backend)
            outbound = cluster["name"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    vhost = hcm["route_config"]["virtual_hosts"][0]
    vhost["routes"].insert(
        0, {"name": "other-app", "match": {"prefix": "/other"}, "route": {"cluster": outbound}}
    )
    config = tmp_path / "standin.yaml"
    config.write_text(yaml.safe_dump(bootstrap, sort_keys=False))

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path})

    runner = await serve_every_path(answer, backend)
    try:
        envoy = processes.start("envoy", envoy_argv(config, concurrency=1))
        await asyncio.to_thread(wait_http_ready, f"http://127.0.0.1:{admin}/ready", envoy, 20)
        base = f"http://127.0.0.1:{listen}"
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{base}/v1/chat/completions", json={"model": "m"}) as r:
                generation = r.status
            async with session.get(f"{base}/v1/models") as r:
                models = r.status
            async with session.get(f"{base}/other/thing") as r:
                other = r.status
            async with session.get(f"http://127.0.0.1:{admin}/stats?filter=ext_proc") as r:
                stats = dict(
                    line.split(": ", 1) for line in (await r.text()).splitlines() if ": " in line
                )
    finally:
        await runner.cleanup()
    return (generation, models, other), stats


@pytest.mark.integration
async def test_istio_patches_on_a_real_envoy(processes: ProcessGroup, tmp_path: Path) -> None:
    """The Istio stand-in on the real Envoy: fairlane's generation route fails closed (503),
    its /v1/models route fails open, and another application's route on the same gateway
    never goes through ext_proc (the filter is disabled unless a route enables it)."""
    bootstrap = istio_bootstrap(objects("istio.yaml"))
    statuses, stats = await fairlane_and_another_app(processes, tmp_path, bootstrap)
    assert statuses == (503, 200, 200)
    prefix = "http.outbound_0.0.0.0_8080.ext_proc.fairlane."
    # two fairlane routes tried the (dead) service; the other app's route did not
    assert int(stats[prefix + "streams_failed"]) == 2, stats
    assert int(stats[prefix + "failure_mode_allowed"]) == 1, stats


@pytest.mark.integration
async def test_plain_envoy_snippet_leaves_other_routes_alone(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """The plain snippet pasted into an Envoy that serves another app too: the same three
    outcomes as Istio's (the snippet's filter is scoped to its own routes)."""
    bootstrap = wrap_snippet(yaml.safe_load((MESH / "envoy-snippet.yaml").read_text()))
    statuses, stats = await fairlane_and_another_app(processes, tmp_path, bootstrap)
    assert statuses == (503, 200, 200)
    prefix = "http.mesh.ext_proc.fairlane."
    assert int(stats[prefix + "streams_failed"]) == 2, stats
    assert int(stats[prefix + "failure_mode_allowed"]) == 1, stats
