"""Istio: fairlane's ext_proc filter in the ingress gateway, as an EnvoyFilter.

The EnvoyFilter's patches carry the rendered filter (disabled unless a route enables it),
clusters, HCM settings and route settings verbatim; :func:`istio_bootstrap` applies them to a
stand-in for the gateway config Istio generates, so ``fairlane render-envoy``'s typed check
and ``envoy --mode validate`` see each patch value where Istio puts it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from extproc.envoy.clusters import backend_cluster, extproc_cluster, replica_clusters
from extproc.envoy.connection_manager import hcm_settings
from extproc.envoy.filter import failure_mode_override
from extproc.envoy.mesh import GATEWAY, KubeNames, kube_names, route_merge, route_specs
from extproc.envoy.mesh.workload import workload
from extproc.envoy.params import EnvoyParams
from extproc.envoy.protojson import (
    HCM_FILTER,
    HCM_TYPE,
    ROUTER_FILTER,
    hcm_filter_chains,
    previous_hosts,
    router_filter,
    socket_address,
)
from extproc.envoy.snippet import scoped_ext_proc_filter

ISTIO_API = "networking.istio.io/v1alpha3"

ISTIO_HEADER = """\
Istio: fairlane's ext_proc filter in the ingress gateway, as an EnvoyFilter.

Needs: Istio with EnvoyFilter (networking.istio.io/v1alpha3) whose proxy is an Envoy with
  - envoy.filters.http.ext_proc with max_message_timeout/override_message_timeout,
    status_on_error and metadata_options.receiving_namespaces;
  - envoy.load_balancing_policies.override_host (the upstream LB policy that routes to the
    ip:port the service names in x-gateway-destination-endpoint, alternates for retries);
  check `istioctl version` / the proxy's `envoy --version`: this file is validated against
  Envoy 1.40.0 (tests/deploy/test_mesh_snippets.py); older proxies may lack override_host.
What the mesh must provide:
  - the vLLM pods behind the Service `vllm` (rename below), the gateway's outbound cluster
    for it is patched to override_host: its endpoints are pod IP:port, which is what the
    service must list (`fairlane serve --backend REGION=http://POD_IP:PORT`, a static list:
    restart the service when vLLM pods move);
  - the fairlane Service reachable in plain gRPC (h2c) from the gateway: the pods below run
    without a sidecar; with STRICT mTLS in its namespace use PERMISSIVE for it;
  - with replicas (a StatefulSet, one Service per pod: each replica gets every completion
    over a cluster of its own), the Redis they share at the URL in their --state;
  - Gateway + VirtualService routes named like the HTTP_ROUTE patches (the VirtualService
    below), because EnvoyFilter matches routes by name.
The filter is inserted disabled and enabled per route (ExtProcPerRoute on fairlane's routes):
the gateway's other routes never reach fairlane.
Apply: kubectl apply -f istio.yaml (the EnvoyFilter lives in istio-system, beside the gateway).
"""


def enabling_route_merge(
    rendered_route: dict[str, Any], failure_mode_allow: bool
) -> dict[str, Any]:
    """:func:`route_merge` plus the ``ExtProcPerRoute`` that enables the (disabled by
    default) ext_proc filter on this route, with the route's failure mode."""
    merged = route_merge(rendered_route)
    merged["typed_per_filter_config"] = failure_mode_override(failure_mode_allow)
    return merged


def backend_cluster_merge(params: EnvoyParams) -> dict[str, Any]:
    """What a mesh merges into its own cluster of the vLLM Service: override_host routing,
    raised circuit breakers and the buffer limit (its endpoints come from the mesh)."""
    cluster = backend_cluster(params)
    keys = ("per_connection_buffer_limit_bytes", "load_balancing_policy", "circuit_breakers")
    return {key: cluster[key] for key in keys}


def render_istio(params: EnvoyParams) -> list[dict[str, Any]]:
    """Kubernetes objects for Istio: fairlane's Deployment and Service, a Gateway and a
    VirtualService with one named route per rendered route, and the EnvoyFilter that patches
    the ingress gateway with the rendered ext_proc filter, clusters and settings."""
    names = kube_names(params)
    specs = route_specs(params)
    envoy_filter = {
        "apiVersion": ISTIO_API,
        "kind": "EnvoyFilter",
        "metadata": {"name": "fairlane-ext-proc", "namespace": "istio-system"},
        "spec": {
            "workloadSelector": {"labels": {"istio": "ingressgateway"}},
            "configPatches": config_patches(params, names, specs),
        },
    }
    routes = [rendered for rendered, _ in specs]
    return [
        *workload(params, names),
        _gateway(names),
        _virtual_service(names, routes),
        envoy_filter,
    ]


def config_patches(
    params: EnvoyParams, names: KubeNames, specs: list[tuple[dict[str, Any], bool]]
) -> list[dict[str, Any]]:
    """The EnvoyFilter's patches: the scoped filter before the router, the HCM settings,
    the listener buffer, the ext_proc cluster (and each replica's), the vLLM cluster's
    routing, and per route
    the settings plus the ``ExtProcPerRoute`` that enables the filter on it."""
    hcm_match = {
        "context": "GATEWAY",
        "listener": {"filterChain": {"filter": {"name": HCM_FILTER}}},
    }
    return [
        {
            "applyTo": "HTTP_FILTER",
            "match": {
                "context": "GATEWAY",
                "listener": {
                    "filterChain": {
                        "filter": {"name": HCM_FILTER, "subFilter": {"name": ROUTER_FILTER}}
                    }
                },
            },
            "patch": {"operation": "INSERT_BEFORE", "value": scoped_ext_proc_filter(params)},
        },
        {
            "applyTo": "NETWORK_FILTER",
            "match": hcm_match,
            "patch": {
                "operation": "MERGE",
                "value": {
                    "name": HCM_FILTER,
                    "typed_config": {"@type": HCM_TYPE, **hcm_settings(params)},
                },
            },
        },
        {
            "applyTo": "LISTENER",
            "match": {"context": "GATEWAY"},
            "patch": {
                "operation": "MERGE",
                "value": {"per_connection_buffer_limit_bytes": params.buffer_limit_bytes},
            },
        },
        *(
            {
                "applyTo": "CLUSTER",
                "match": {"context": "GATEWAY"},
                "patch": {"operation": "ADD", "value": cluster},
            }
            # with replicas, each one's own cluster too (its completion feed)
            for cluster in (extproc_cluster(params), *replica_clusters(params))
        ),
        {
            "applyTo": "CLUSTER",
            "match": {
                "context": "GATEWAY",
                "cluster": {"service": names.vllm_host, "portNumber": names.backend_port},
            },
            "patch": {"operation": "MERGE", "value": backend_cluster_merge(params)},
        },
        *(_route_patch(rendered, allow) for rendered, allow in specs),
    ]


def _route_patch(rendered: dict[str, Any], failure_mode_allow: bool) -> dict[str, Any]:
    return {
        "applyTo": "HTTP_ROUTE",
        "match": {
            "context": "GATEWAY",
            "routeConfiguration": {"vhost": {"route": {"name": rendered["name"]}}},
        },
        "patch": {
            "operation": "MERGE",
            "value": enabling_route_merge(rendered, failure_mode_allow),
        },
    }


def _gateway(names: KubeNames) -> dict[str, Any]:
    return {
        "apiVersion": ISTIO_API,
        "kind": "Gateway",
        "metadata": {"name": GATEWAY, "namespace": names.namespace},
        "spec": {
            "selector": {"istio": "ingressgateway"},
            "servers": [
                {"port": {"number": 80, "name": "http", "protocol": "HTTP"}, "hosts": ["*"]}
            ],
        },
    }


def _virtual_service(names: KubeNames, routes: list[dict[str, Any]]) -> dict[str, Any]:
    """The VirtualService: one named HTTP route per rendered route, to the vLLM Service."""
    http_routes = []
    for rendered in routes:
        kind, value = next(iter(rendered["match"].items()))
        http_routes.append(
            {
                "name": rendered["name"],  # the HTTP_ROUTE patches match this name
                "match": [{"uri": {"prefix" if kind == "prefix" else "exact": value}}],
                "route": [
                    {
                        "destination": {
                            "host": names.vllm_host,
                            "port": {"number": names.backend_port},
                        }
                    }
                ],
                "timeout": rendered["route"]["timeout"],
                "retries": {
                    "attempts": rendered["route"]["retry_policy"]["num_retries"],
                    "retryOn": rendered["route"]["retry_policy"]["retry_on"],
                },
            }
        )
    return {
        "apiVersion": ISTIO_API,
        "kind": "VirtualService",
        "metadata": {"name": "llm", "namespace": names.namespace},
        "spec": {"hosts": ["*"], "gateways": [GATEWAY], "http": http_routes},
    }


def proto_merge(base: Any, patch: Any) -> Any:
    """Protobuf merge semantics on proto3-JSON dicts, as Istio's MERGE applies a patch:
    messages merge field by field, repeated fields append, scalars are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = proto_merge(base[key], value) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(patch, list):
        return [*base, *patch]
    return patch


def istio_bootstrap(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """A whole bootstrap: the EnvoyFilter's patches applied to a stand-in for what Istio
    generates for the gateway from the VirtualService (a listener whose HCM ends in the
    router, routes named like the VirtualService's with Istio's default retry predicate, and
    the vLLM Service's outbound cluster with ``lb_policy: LEAST_REQUEST`` and static
    endpoints instead of EDS). ``envoy --mode validate`` on it shows that every patch value
    is config Envoy accepts where Istio puts it."""
    by_kind = {obj["kind"]: obj for obj in objects}
    patches = by_kind["EnvoyFilter"]["spec"]["configPatches"]
    virtual_service = by_kind["VirtualService"]["spec"]
    destination = virtual_service["http"][0]["route"][0]["destination"]
    outbound = f"outbound|{destination['port']['number']}||{destination['host']}"
    routes = _stand_in_routes(virtual_service, patches, outbound)
    pods = by_kind.get("Deployment") or by_kind["StatefulSet"]
    vllm = _stand_in_vllm_cluster(pods, outbound)
    for value in _patch_values(patches, "CLUSTER", "MERGE"):
        vllm = proto_merge(vllm, value)
    return {
        "static_resources": {
            "listeners": [_stand_in_listener(routes, patches)],
            "clusters": [*_patch_values(patches, "CLUSTER", "ADD"), vllm],
        }
    }


def _patch_values(
    patches: list[dict[str, Any]], apply_to: str, operation: str
) -> list[dict[str, Any]]:
    return [
        p["patch"]["value"]
        for p in patches
        if p["applyTo"] == apply_to and p["patch"]["operation"] == operation
    ]


def _stand_in_routes(
    virtual_service: dict[str, Any], patches: list[dict[str, Any]], outbound: str
) -> list[dict[str, Any]]:
    """The routes Istio renders from the VirtualService, with the HTTP_ROUTE patches merged
    into the route of the same name."""
    route_patches = {
        p["match"]["routeConfiguration"]["vhost"]["route"]["name"]: p["patch"]["value"]
        for p in patches
        if p["applyTo"] == "HTTP_ROUTE"
    }
    routes = []
    for http in virtual_service["http"]:
        (uri,) = http["match"]
        kind, value = next(iter(uri["uri"].items()))
        istio_route = {
            "name": http["name"],
            "match": {"prefix" if kind == "prefix" else "path": value},
            "route": {
                "cluster": outbound,
                "timeout": http["timeout"],
                "retry_policy": {
                    "retry_on": http["retries"]["retryOn"],
                    "num_retries": http["retries"]["attempts"],
                    "retry_host_predicate": [previous_hosts()],
                    "host_selection_retry_max_attempts": 5,
                },
            },
        }
        routes.append(proto_merge(istio_route, route_patches.get(http["name"], {})))
    return routes


def _stand_in_listener(
    routes: list[dict[str, Any]], patches: list[dict[str, Any]]
) -> dict[str, Any]:
    """Istio's gateway listener on 8080 with the HTTP_FILTER, NETWORK_FILTER and LISTENER
    patches applied."""
    hcm: dict[str, Any] = {
        "@type": HCM_TYPE,
        "stat_prefix": "outbound_0.0.0.0_8080",
        "route_config": {
            "name": "http.8080",
            "virtual_hosts": [{"name": "*:80", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [*_patch_values(patches, "HTTP_FILTER", "INSERT_BEFORE"), router_filter()],
    }
    for value in _patch_values(patches, "NETWORK_FILTER", "MERGE"):
        hcm = proto_merge(hcm, value["typed_config"])
    listener: dict[str, Any] = {
        "name": "0.0.0.0_8080",
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": 8080}},
        "filter_chains": hcm_filter_chains(hcm),
    }
    for value in _patch_values(patches, "LISTENER", "MERGE"):
        listener = proto_merge(listener, value)
    return listener


def _stand_in_vllm_cluster(pods: dict[str, Any], outbound: str) -> dict[str, Any]:
    """Istio's outbound cluster of the vLLM Service, its endpoints the backends fairlane's
    pods (its Deployment or StatefulSet) are started with (Istio would take them from EDS)."""
    args = pods["spec"]["template"]["spec"]["containers"][0]["args"]
    backends = [urlsplit(arg.split("=", 2)[2]) for arg in args if arg.startswith("--backend")]
    return {
        "name": outbound,
        "type": "STATIC",
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": {
            "cluster_name": outbound,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": socket_address(url.hostname, url.port)}}
                        for url in backends
                    ]
                }
            ],
        },
    }
