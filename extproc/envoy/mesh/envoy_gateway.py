"""Envoy Gateway: fairlane as an EnvoyExtensionPolicy (ext_proc) on the LLM HTTPRoutes.

Envoy Gateway takes no raw Envoy config, so every field is derived from the rendered one
(processing mode, failure mode per route, metadata namespaces, the override_host header,
retries, limits); what Envoy Gateway has no field for is listed in :data:`ENVOY_GATEWAY_HEADER`.
"""

from __future__ import annotations

from typing import Any

from extproc.envoy.clusters import backend_cluster, extproc_cluster
from extproc.envoy.connection_manager import hcm_settings
from extproc.envoy.filter import ext_proc_filter
from extproc.envoy.mesh import (
    GATEWAY,
    VLLM_SERVICE,
    KubeNames,
    kube_names,
    route_merge,
    route_specs,
)
from extproc.envoy.mesh.workload import pod_service_names, workload
from extproc.envoy.params import (
    BACKEND_MAX_REQUESTS,
    BACKEND_MAX_RETRIES,
    NUM_RETRIES,
    RETRY_ON,
    EnvoyParams,
)
from extproc.envoy.routes import route
from extproc.wire import DESTINATION_HEADER

GATEWAY_API = "gateway.networking.k8s.io"
ENVOY_GATEWAY_API = "gateway.envoyproxy.io/v1alpha1"
# Envoy Gateway's names for ext_proc body modes (ExtProcBodyProcessingMode).
_EG_BODY_MODES = {"BUFFERED": "Buffered", "STREAMED": "Streamed"}

ENVOY_GATEWAY_HEADER = """\
Envoy Gateway: fairlane as an EnvoyExtensionPolicy (ext_proc) on the LLM HTTPRoutes.

Needs a recent Envoy Gateway (gateway.envoyproxy.io/v1alpha1) with these fields; written
against its current API types and checked structurally, not tried on a cluster:
  - EnvoyExtensionPolicy extProc (backendRefs, processingMode, messageTimeout, failOpen,
    metadata.writableNamespaces);
  - BackendTrafficPolicy loadBalancer.endpointOverride (Envoy's override_host LB policy:
    routes to the ip:port the service names in x-gateway-destination-endpoint, then its
    alternates for retries); Envoy Gateway's proxy must be an Envoy that has override_host;
  - EnvoyProxy telemetry accessLog ALS sink (the completion feed that frees backend slots);
  - ClientTrafficPolicy connection.bufferLimit and timeout.http.streamIdleTimeout.
What differs from the plain Envoy bootstrap (Envoy Gateway exposes no such fields):
  - no max_message_timeout: a held request is bounded by messageTimeout itself, set to the
    longest hold; a wedged service therefore holds requests that long instead of failing them
    after 2 s (the bootstrap's message_timeout);
  - no mutation_rules.allow_envoy: the service's x-envoy-* headers (per-request hedging,
    x-envoy-max-retries) are rejected (rejected_header_mutations), so there is no hedging and
    retries follow the BackendTrafficPolicy;
  - no status_on_error: a failed ext_proc stream answers 500 (Envoy's default), not 503.
  - with replicas: no GrpcService.retry_policy, so a request whose stream opens on a replica
    the moment it died gets 503 (retry-after) until the health checks (1 s) or the passive
    check take that replica out; the plain bootstrap retries such a stream on another one;
    and no stream initial_metadata nor hash policy, so a tenant's requests spread over the
    replicas instead of meeting in one (fair across them all the same, a little less:
    extproc.envoy.replicas).
What the mesh must provide: the vLLM pods behind the Service `vllm` (rename below); their pod
IP:port is what the service lists (`--backend REGION=http://POD_IP:PORT`, a static list);
with replicas, the Redis they share at the URL in their --state.
Per-route fail-open: one HTTPRoute and one EnvoyExtensionPolicy per route of the deployment.
"""


def kube_name(route_name: str) -> str:
    """A route name as a Kubernetes object name (DNS-1123: no underscores)."""
    return route_name.replace("_", "-").lower()


def _gateway_api_duration(seconds: float) -> str:
    """Gateway API Duration (``^([0-9]{1,5}(h|m|s|ms)){1,4}$``): whole seconds, else ms."""
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{round(seconds * 1000)}ms"


def render_envoy_gateway(params: EnvoyParams) -> list[dict[str, Any]]:
    """Kubernetes objects for Envoy Gateway: fairlane's Deployment and Service, an EnvoyProxy
    with the completion feed (ALS), the Gateway, one HTTPRoute + EnvoyExtensionPolicy per
    rendered route (failOpen per route), a BackendTrafficPolicy (override_host routing,
    retries, circuit breakers, health checks) and a ClientTrafficPolicy (buffer, idle)."""
    names = kube_names(params)
    # with replicas, each pod's own Service (extproc.envoy.mesh.workload says why)
    fairlane_refs = [
        {"name": name, "port": params.extproc_port}
        for name in pod_service_names(params, names) or [names.service]
    ]
    objects: list[dict[str, Any]] = [
        *workload(params, names),
        _envoy_proxy(params, names, fairlane_refs),
        _gateway(names),
        _client_policy(params, names),
    ]
    route_refs = []
    for rendered, allow in route_specs(params):
        name = kube_name(rendered["name"])
        route_refs.append({"group": GATEWAY_API, "kind": "HTTPRoute", "name": name})
        objects.append(_http_route(rendered, name, names))
        objects.append(_extension_policy(params, name, names, fairlane_refs, allow))
    objects.append(_backend_policy(params, names, route_refs))
    return objects


def _envoy_proxy(
    params: EnvoyParams, names: KubeNames, fairlane_refs: list[dict[str, Any]]
) -> dict[str, Any]:
    """The EnvoyProxy: Envoy Gateway's proxy settings, here the completion feed (ALS): one
    sink per replica, each to that replica alone (every replica needs every completion)."""
    sinks = [
        {
            "type": "ALS",
            "als": {"backendRefs": [ref], "type": "HTTP", "logName": _als_log_name(params)},
        }
        for ref in fairlane_refs
    ]
    return {
        "apiVersion": ENVOY_GATEWAY_API,
        "kind": "EnvoyProxy",
        "metadata": {"name": "fairlane-proxy", "namespace": names.namespace},
        "spec": {"telemetry": {"accessLog": {"settings": [{"sinks": sinks}]}}},
    }


def _gateway(names: KubeNames) -> dict[str, Any]:
    return {
        "apiVersion": f"{GATEWAY_API}/v1",
        "kind": "Gateway",
        "metadata": {"name": GATEWAY, "namespace": names.namespace},
        "spec": {
            "gatewayClassName": "eg",
            "infrastructure": {
                "parametersRef": {
                    "group": "gateway.envoyproxy.io",
                    "kind": "EnvoyProxy",
                    "name": "fairlane-proxy",
                }
            },
            "listeners": [{"name": "http", "protocol": "HTTP", "port": 80}],
        },
    }


def _client_policy(params: EnvoyParams, names: KubeNames) -> dict[str, Any]:
    """The listener's buffer and idle timeout (the bootstrap's listener and HCM settings)."""
    return {
        "apiVersion": ENVOY_GATEWAY_API,
        "kind": "ClientTrafficPolicy",
        "metadata": {"name": "fairlane-client", "namespace": names.namespace},
        "spec": {
            "targetRefs": [{"group": GATEWAY_API, "kind": "Gateway", "name": GATEWAY}],
            "connection": {"bufferLimit": str(params.buffer_limit_bytes)},
            "timeout": {
                "http": {"streamIdleTimeout": _gateway_api_duration(params.stream_idle_timeout_s)}
            },
        },
    }


def _http_route(rendered: dict[str, Any], name: str, names: KubeNames) -> dict[str, Any]:
    """The HTTPRoute of one rendered route: its match, to the vLLM Service."""
    kind, value = next(iter(rendered["match"].items()))
    return {
        "apiVersion": f"{GATEWAY_API}/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": name, "namespace": names.namespace},
        "spec": {
            "parentRefs": [{"name": GATEWAY}],
            "rules": [
                {
                    "matches": [
                        {
                            "path": {
                                "type": "PathPrefix" if kind == "prefix" else "Exact",
                                "value": value,
                            }
                        }
                    ],
                    "backendRefs": [{"name": VLLM_SERVICE, "port": names.backend_port}],
                }
            ],
        },
    }


def _extension_policy(
    params: EnvoyParams,
    name: str,
    names: KubeNames,
    fairlane_refs: list[dict[str, Any]],
    failure_mode_allow: bool,
) -> dict[str, Any]:
    """The ext_proc filter on one HTTPRoute, with that route's failure mode; with replicas,
    the health checks that move new requests off a dead one."""
    filter_config = ext_proc_filter(params)["typed_config"]
    mode = filter_config["processing_mode"]
    namespaces = filter_config["metadata_options"]["receiving_namespaces"]["untyped"]
    ext_proc: dict[str, Any] = {
        "backendRefs": fairlane_refs,
        "processingMode": {
            # request present = request headers SEND; no `response`:
            # response headers and body are skipped, unless the service turns response
            # headers on for one request (mode_override, extproc.core.preemption)
            "request": {"body": _EG_BODY_MODES[mode["request_body_mode"]]},
            "allowModeOverride": filter_config["allow_mode_override"],
        },
        # no max_message_timeout in Envoy Gateway: the hold must fit here
        "messageTimeout": _gateway_api_duration(
            max(params.longest_hold_s, params.message_timeout_s)
        ),
        "failOpen": failure_mode_allow,
        "metadata": {"writableNamespaces": list(namespaces)},
    }
    if params.replicated:
        ext_proc["backendSettings"] = {"healthCheck": _replica_health_check(params)}
    return {
        "apiVersion": ENVOY_GATEWAY_API,
        "kind": "EnvoyExtensionPolicy",
        "metadata": {"name": name, "namespace": names.namespace},
        "spec": {
            "targetRefs": [{"group": GATEWAY_API, "kind": "HTTPRoute", "name": name}],
            "extProc": [ext_proc],
        },
    }


def _backend_policy(
    params: EnvoyParams, names: KubeNames, route_refs: list[dict[str, Any]]
) -> dict[str, Any]:
    """The backend cluster's settings on every fairlane route: override_host routing,
    retries, circuit breakers, no request timeout, active and passive health checks."""
    backend = backend_cluster(params)
    check = backend["health_checks"][0]
    outlier = backend["outlier_detection"]
    return {
        "apiVersion": ENVOY_GATEWAY_API,
        "kind": "BackendTrafficPolicy",
        "metadata": {"name": "fairlane-backends", "namespace": names.namespace},
        "spec": {
            "targetRefs": route_refs,
            "loadBalancer": {
                # the fallback when no listed endpoint is usable, as in the bootstrap
                "type": "LeastRequest",
                "endpointOverride": {"extractFrom": [{"header": DESTINATION_HEADER}]},
            },
            "retry": {
                "numRetries": NUM_RETRIES,
                "retryOn": {"triggers": RETRY_ON.split(",")},
            },
            "circuitBreaker": {
                "maxConnections": BACKEND_MAX_REQUESTS,
                "maxPendingRequests": BACKEND_MAX_REQUESTS,
                "maxParallelRequests": BACKEND_MAX_REQUESTS,
                "maxParallelRetries": BACKEND_MAX_RETRIES,
            },
            "timeout": {"http": {"requestTimeout": route_merge(route(params))["route"]["timeout"]}},
            "healthCheck": {
                "active": {
                    "type": "HTTP",
                    "http": {"path": check["http_health_check"]["path"]},
                    "interval": check["interval"],
                    "timeout": check["timeout"],
                    "unhealthyThreshold": check["unhealthy_threshold"],
                    "healthyThreshold": check["healthy_threshold"],
                },
                "passive": {
                    "consecutive5XxErrors": outlier["consecutive_5xx"],
                    "consecutiveGatewayErrors": outlier["consecutive_gateway_failure"],
                    "interval": outlier["interval"],
                    "baseEjectionTime": outlier["base_ejection_time"],
                    "maxEjectionPercent": outlier["max_ejection_percent"],
                },
            },
        },
    }


def _replica_health_check(params: EnvoyParams) -> dict[str, Any]:
    """The ext_proc cluster's active and passive checks (extproc.envoy.replicas) in Envoy
    Gateway's terms."""
    cluster = extproc_cluster(params)
    (check,) = cluster["health_checks"]
    outlier = cluster["outlier_detection"]
    return {
        "active": {
            "type": "TCP",
            "interval": check["interval"],
            "timeout": check["timeout"],
            "unhealthyThreshold": check["unhealthy_threshold"],
            "healthyThreshold": check["healthy_threshold"],
        },
        "passive": {
            "splitExternalLocalOriginErrors": outlier["split_external_local_origin_errors"],
            "consecutiveLocalOriginFailures": outlier["consecutive_local_origin_failure"],
            "interval": outlier["interval"],
            "baseEjectionTime": outlier["base_ejection_time"],
            "maxEjectionPercent": outlier["max_ejection_percent"],
        },
    }


def _als_log_name(params: EnvoyParams) -> str:
    log: str = hcm_settings(params)["access_log"][0]["typed_config"]["common_config"]["log_name"]
    return log
