"""The clusters: the ext_proc service (gRPC), the vLLM backends, and each service replica's own.

The service's cluster must carry one stream per held request, so its circuit breakers and
HTTP/2 windows are sized from the queue limits and the body limit. With several replicas it
lists them all, with the failover settings of ``extproc.envoy.replicas``, and each replica
also gets a cluster of its own for its completion feed (``replica_clusters``).

The backends' cluster routes with the ``override_host`` LB policy: the service's
``x-gateway-destination-endpoint`` (``ip:port[,ip:port...]``, also in ``envoy.lb`` metadata)
picks the host; regions are priority levels for failover of the fallback LB, and Envoy's own
limits are lifted because admission is fairlane's job. With ``dns://`` backends its hosts
come from the service over EDS, so they are the service's backends (``_hosts``).
"""

from __future__ import annotations

from typing import Any

from extproc.envoy.params import (
    BACKEND_MAX_REQUESTS,
    BACKEND_MAX_RETRIES,
    H2_DEFAULT_CONNECTION_WINDOW,
    H2_DEFAULT_STREAM_WINDOW,
    H2_MAX_WINDOW,
    EnvoyParams,
)
from extproc.envoy.protojson import duration, lb_endpoint
from extproc.envoy.replicas import (
    discovery_type,
    failover_settings,
    replica_cluster_name,
    stream_hash_policy,
    xds_retry_policy,
)
from extproc.wire import BACKEND_CLUSTER, DESTINATION_HEADER, EXTPROC_CLUSTER, LB_NAMESPACE


def extproc_cluster(params: EnvoyParams) -> dict[str, Any]:
    """The cluster of the fairlane ext_proc service (gRPC, so HTTP/2): every replica."""
    replicas = params.service_replicas
    # Each stream that cannot be opened on one replica is retried on another, and the
    # retries count against this limit: with replicas, as many as there may be streams.
    retries = params.extproc_stream_limit if params.replicated else 3
    return {
        "name": EXTPROC_CLUSTER,
        "type": discovery_type(replicas),
        "connect_timeout": "1s",
        "typed_extension_protocol_options": _grpc_protocol_options(
            params, **stream_hash_policy(params)
        ),
        # Every held request keeps one stream open. The defaults (1024 requests) would cap the
        # queue depth of the whole gateway and fail the excess with status_on_error.
        "circuit_breakers": {
            "thresholds": [
                _extproc_threshold("DEFAULT", params.extproc_stream_limit, retries),
                _extproc_threshold("HIGH", params.extproc_stream_limit, retries),
            ]
        },
        **failover_settings(params),
        "load_assignment": {
            "cluster_name": EXTPROC_CLUSTER,
            "endpoints": [{"lb_endpoints": [lb_endpoint(r.host, r.port) for r in replicas]}],
        },
    }


def replica_clusters(params: EnvoyParams) -> list[dict[str, Any]]:
    """One cluster per replica, holding just that replica: its completion feed
    (extproc.envoy.replicas says why each replica needs every completion). None with one
    replica, whose feed goes to the ext_proc cluster. These carry one access-log stream per
    Envoy worker, so Envoy's default limits are plenty."""
    if not params.replicated:
        return []
    clusters = []
    for position, replica in enumerate(params.service_replicas, start=1):
        name = replica_cluster_name(position)
        clusters.append(
            {
                "name": name,
                "type": discovery_type((replica,)),
                "connect_timeout": "1s",
                "typed_extension_protocol_options": _grpc_protocol_options(params),
                "load_assignment": {
                    "cluster_name": name,
                    "endpoints": [{"lb_endpoints": [lb_endpoint(replica.host, replica.port)]}],
                },
            }
        )
    return clusters


def _grpc_protocol_options(params: EnvoyParams, **extra: Any) -> dict[str, Any]:
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": _extproc_http2(params)},
            **extra,
        }
    }


def _extproc_http2(params: EnvoyParams) -> dict[str, Any]:
    return {
        # Held streams are silent for minutes: pings detect a dead service
        # (the server must permit them: grpc.http2.max_ping_strikes=0 etc.).
        "connection_keepalive": {"interval": "10s", "timeout": "5s"},
        # BUFFERED sends the whole body in one message: the windows must not
        # be smaller than it (Envoy's defaults are 16/24 MiB).
        "initial_stream_window_size": _window(params.buffer_limit_bytes, H2_DEFAULT_STREAM_WINDOW),
        "initial_connection_window_size": _window(
            params.buffer_limit_bytes, H2_DEFAULT_CONNECTION_WINDOW
        ),
    }


def _extproc_threshold(priority: str, limit: int, retries: int) -> dict[str, Any]:
    return {
        "priority": priority,
        "max_connections": limit,
        "max_pending_requests": limit,
        "max_requests": limit,
        "max_retries": retries,
    }


BACKEND_IDLE_TIMEOUT_S = 4.0
"""Envoy closes a backend connection idle this long. vLLM's HTTP server (uvicorn) closes
one after 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``): a request Envoy sends on a connection as
the server closes it meets a reset, a 503 "connection termination" before any header,
which a fleet of one backend cannot retry elsewhere. Closing first avoids the race."""


def backend_cluster(params: EnvoyParams) -> dict[str, Any]:
    """The vLLM backends: one priority level per region, routed by override_host."""
    return {
        "name": BACKEND_CLUSTER,
        "type": "EDS" if params.dynamic_fleet else "STATIC",
        "connect_timeout": "2s",
        "per_connection_buffer_limit_bytes": params.buffer_limit_bytes,
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": _override_host(),
                    }
                }
            ]
        },
        # Admission is fairlane's job; Envoy's defaults (1024 requests, 3 retries) would
        # only add a second, blind limit.
        "circuit_breakers": {
            "thresholds": [
                {
                    "priority": "DEFAULT",
                    "max_connections": BACKEND_MAX_REQUESTS,
                    "max_pending_requests": BACKEND_MAX_REQUESTS,
                    "max_requests": BACKEND_MAX_REQUESTS,
                    "max_retries": BACKEND_MAX_RETRIES,
                }
            ]
        },
        "health_checks": [_health_check()],
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                "HttpProtocolOptions",
                "common_http_protocol_options": {"idle_timeout": duration(BACKEND_IDLE_TIMEOUT_S)},
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
        # Passive checks on real traffic: ejected hosts leave the fallback LB (and make
        # previous_priorities move on). They do not stop override_host from using a listed
        # host, which is why the service lists only endpoints its own probes call healthy.
        "outlier_detection": {
            "consecutive_5xx": 5,
            "consecutive_gateway_failure": 3,
            "interval": "5s",
            "base_ejection_time": "30s",
            "max_ejection_percent": 50,
        },
        **_hosts(params),
    }


EDS_INITIAL_FETCH_TIMEOUT = "2s"
"""How long Envoy waits at startup for the service's first host set before it listens
anyway (with no backend until the set arrives; the service answers once it is up)."""


def _hosts(params: EnvoyParams) -> dict[str, Any]:
    """Where the backends' hosts come from: the config (STATIC) or the service (EDS).

    With ``dns://`` backends the cluster is **EDS**, its hosts served by the service itself
    (``extproc.transport.endpoints``) over the ext_proc cluster's gRPC connection, so Envoy's
    hosts are the service's backends, joined and drained at the same moments.
    ``ignore_health_on_host_removal`` makes Envoy drop a host as soon as the service does (the
    service removes one only once its requests in flight have finished); without it Envoy keeps
    a removed host that still passes its health check, and the two sets differ. A fleet of fixed
    addresses keeps its STATIC cluster: nothing in it changes, and Envoy knows its hosts even
    while the service is down (a fail-open route still has somewhere to go).
    """
    if not params.dynamic_fleet:
        return {
            "load_assignment": {
                "cluster_name": BACKEND_CLUSTER,
                # Envoy's default, explicit: priority 0 (the first region) keeps all traffic
                # until fewer than 1/1.4 = ~71% of its hosts are healthy, then spills over.
                "policy": {"overprovisioning_factor": 140},
                "endpoints": _region_endpoints(params),
            },
        }
    envoy_grpc: dict[str, Any] = {"cluster_name": EXTPROC_CLUSTER}
    retry = xds_retry_policy(params)
    if retry is not None:
        envoy_grpc["retry_policy"] = retry
    return {
        "eds_cluster_config": {
            "eds_config": {
                "resource_api_version": "V3",
                "initial_fetch_timeout": EDS_INITIAL_FETCH_TIMEOUT,
                "api_config_source": {
                    "api_type": "GRPC",
                    "transport_api_version": "V3",
                    "grpc_services": [{"envoy_grpc": envoy_grpc}],
                },
            }
        },
        "ignore_health_on_host_removal": True,
    }


def _override_host() -> dict[str, Any]:
    return {
        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies."
        "override_host.v3.OverrideHost",
        # The header and the same value in envoy.lb metadata (the GIE
        # protocol). Listed hosts are used even when health checks fail
        # them: the service must list only healthy endpoints.
        "override_host_sources": [
            {"header": DESTINATION_HEADER},
            {
                "metadata": {
                    "key": LB_NAMESPACE,
                    "path": [{"key": DESTINATION_HEADER}],
                }
            },
        ],
        # No (usable) listed host left: least-request over healthy hosts,
        # honouring priorities (regions).
        "fallback_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.least_request",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions."
                            "load_balancing_policies.least_request.v3."
                            "LeastRequest",
                        },
                    }
                }
            ]
        },
    }


def _health_check() -> dict[str, Any]:
    return {
        "timeout": "2s",
        "interval": "5s",
        # Without it a standby region that never carried traffic is checked only
        # every 60 s.
        "no_traffic_interval": "5s",
        "unhealthy_threshold": 2,
        "healthy_threshold": 1,
        "http_health_check": {"path": "/health"},
    }


def _region_endpoints(params: EnvoyParams) -> list[dict[str, Any]]:
    """One ``LocalityLbEndpoints`` per region, its priority the order the region was named."""
    return [
        {
            "locality": {"region": region},
            "priority": priority,
            "lb_endpoints": [
                lb_endpoint(b.host, b.port, b.weight) for b in params.backends if b.region == region
            ],
        }
        for priority, region in enumerate(params.regions)
    ]


def _window(needed: int, default: int) -> int:
    return min(max(needed, default), H2_MAX_WINDOW)
