"""The ext_proc HTTP filter: one gRPC stream per request to the fairlane service.

Its settings are what let the service hold a request for minutes, rewrite its body and
name the upstream (see ``envoy/README.md``): request headers SEND and body BUFFERED, the
response phases skipped; a short ``message_timeout`` so a wedged service fails fast, and
``max_message_timeout`` 3600 s so the service can hold a request with a standalone
``override_message_timeout``; fail-closed unless a route says otherwise.
"""

from __future__ import annotations

from typing import Any

from extproc.envoy.params import MAX_MESSAGE_TIMEOUT_S, EnvoyParams
from extproc.envoy.protojson import duration
from extproc.envoy.replicas import stream_affinity_metadata, stream_retry_policy
from extproc.wire import EXT_PROC_FILTER, EXTPROC_CLUSTER, FAIRLANE_NAMESPACE, LB_NAMESPACE

EXT_PROC_PER_ROUTE_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
)


def ext_proc_filter(params: EnvoyParams) -> dict[str, Any]:
    """The ext_proc HTTP filter: one gRPC stream per request to the fairlane service."""
    return {
        "name": EXT_PROC_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
            "ExternalProcessor",
            "grpc_service": _grpc_service(params),
            # Headers stay held until the body response in BUFFERED mode, so the service can
            # classify on the JSON and still set headers/routing in the body response.
            # Responses never go through Python (SKIP/NONE): one round trip less per phase.
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED",
                "response_header_mode": "SKIP",
                "response_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
            # Where a policy has a preemptible tier, the service turns response headers on
            # in its request-headers answer (mode_override): a cancellable request's stream
            # stays open until its answer starts (extproc.core.preemption). A reply Envoy
            # makes before the service saw the request (a 431) never reaches it.
            "allow_mode_override": True,
            # Short, so a wedged service fails requests fast; a queued request is held by the
            # service's standalone ProcessingResponse{override_message_timeout} (<= max).
            "message_timeout": duration(params.message_timeout_s),
            "max_message_timeout": duration(MAX_MESSAGE_TIMEOUT_S),
            # Never forward a request the scheduler has not admitted: that would bypass
            # fairness and overload the engines exactly when the service is in trouble.
            "failure_mode_allow": False,
            # A broken or unreachable service is "the gateway is unavailable" (retryable by
            # clients), not a 500 bug report. Message timeouts still answer 504.
            "status_on_error": {"code": 503},
            # The service sets x-envoy-upstream-rq-per-try-timeout-ms and
            # x-envoy-hedge-on-per-try-timeout for hedged tiers; Envoy's default mutation rules
            # reject x-envoy-* (clients' copies are stripped at the edge anyway).
            "mutation_rules": {"allow_envoy": True},
            "metadata_options": {
                "receiving_namespaces": {"untyped": [LB_NAMESPACE, FAIRLANE_NAMESPACE]},
            },
            "stat_prefix": "fairlane",
            # When Envoy received the request: how old it is when the service decides it is
            # how far behind the service is (its overload signal, extproc.transport.overload).
            "request_attributes": ["request.time"],
        },
    }


def _grpc_service(params: EnvoyParams) -> dict[str, Any]:
    service: dict[str, Any] = {
        # envoy_grpc: Envoy's own HTTP/2 client, so the service is an ordinary cluster
        # with circuit breakers and stats. GrpcService.timeout would not bound the
        # stream anyway (the hold is governed by message timeouts).
        "envoy_grpc": {
            "cluster_name": EXTPROC_CLUSTER,
            # the body response carries the rewritten body: allow it (and a bit more)
            "max_receive_message_length": params.buffer_limit_bytes,
        },
    }
    retry = stream_retry_policy(params)
    if retry is not None:  # replicas: a stream a dead replica cannot take goes to another
        service["retry_policy"] = retry
    affinity = stream_affinity_metadata(params)
    if affinity:  # replicas: each client key's streams to one replica
        service["initial_metadata"] = affinity
    return service


def failure_mode_override(allow: bool) -> dict[str, Any]:
    """``typed_per_filter_config`` that sets the ext_proc failure mode for one route."""
    return {
        EXT_PROC_FILTER: {
            "@type": EXT_PROC_PER_ROUTE_TYPE,
            "overrides": {"failure_mode_allow": allow},
        }
    }
