"""The Envoy bootstrap **without** fairlane: the baseline arms of ``fairlane bench``.

A benchmark is only fair if the arms differ in what is being measured and nothing else, so
this bootstrap reuses the gateway's own pieces (the backend cluster's timeouts and limits,
the listener's buffer, the idle timeout, the overload manager) and leaves out exactly
fairlane: no ext_proc filter, no completion access log, and plain round-robin over every
backend (one locality: a FIFO fleet has no regional preference), so requests reach the
engines in arrival order and the engines' own FCFS queues decide. The client's headers
(``authorization`` included) pass through untouched; the simulator ignores them.
``extproc_*``, ``max_held_requests`` and ``message_timeout_s`` of the params are unused.
"""

from __future__ import annotations

from typing import Any

from extproc.envoy.bootstrap import overload_manager
from extproc.envoy.clusters import backend_cluster
from extproc.envoy.connection_manager import file_access_log
from extproc.envoy.params import EnvoyParams
from extproc.envoy.protojson import (
    HCM_TYPE,
    duration,
    hcm_filter_chains,
    lb_endpoint,
    router_filter,
    socket_address,
)

FIFO_CLUSTER = "fifo_backends"


def render_fifo_bootstrap(params: EnvoyParams) -> dict[str, Any]:
    """The baseline bootstrap for ``params``: one listener straight to one cluster."""
    return {
        "admin": {"address": socket_address(params.admin_host, params.admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "fifo_http",
                    "address": socket_address(params.listen_host, params.listen_port),
                    "per_connection_buffer_limit_bytes": params.buffer_limit_bytes,
                    "filter_chains": hcm_filter_chains(_fifo_hcm(params)),
                }
            ],
            "clusters": [fifo_cluster(params)],
        },
        "overload_manager": overload_manager(params),
    }


def fifo_cluster(params: EnvoyParams) -> dict[str, Any]:
    """The gateway's backend cluster with round-robin over every backend in one locality."""
    cluster = backend_cluster(params)
    cluster["name"] = FIFO_CLUSTER
    cluster["load_balancing_policy"] = {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies."
                        "round_robin.v3.RoundRobin",
                    },
                }
            }
        ]
    }
    cluster["load_assignment"] = {
        "cluster_name": FIFO_CLUSTER,
        "endpoints": [
            {"lb_endpoints": [lb_endpoint(b.host, b.port, b.weight) for b in params.backends]}
        ],
    }
    return cluster


def _fifo_hcm(params: EnvoyParams) -> dict[str, Any]:
    """The gateway's connection-manager settings without the completion feed, routing
    everything to :data:`FIFO_CLUSTER` with the same no-timeout route."""
    path = params.access_log_path
    access_logs = [] if path is None else [file_access_log(path)]
    return {
        "@type": HCM_TYPE,
        "stat_prefix": "fifo",
        "codec_type": "AUTO",
        "stream_idle_timeout": duration(params.stream_idle_timeout_s),
        "request_headers_timeout": "10s",
        "max_request_headers_kb": 96,
        "generate_request_id": True,
        "access_log": access_logs,
        "route_config": {
            "name": "fifo",
            "virtual_hosts": [
                {
                    "name": "fifo",
                    "domains": ["*"],
                    "routes": [
                        {
                            "name": "fifo_llm",
                            "match": {"prefix": "/"},
                            "route": {
                                "cluster": FIFO_CLUSTER,
                                "timeout": "0s",  # long generations
                                "idle_timeout": duration(params.stream_idle_timeout_s),
                            },
                        }
                    ],
                }
            ],
        },
        "http_filters": [router_filter()],
    }
