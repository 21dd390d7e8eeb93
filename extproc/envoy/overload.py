"""Envoy's half of overload shedding: a runtime layer from the service, and shed routes.

When the service's own CPU is the bottleneck, a request it refuses still costs it a gRPC
stream, about half of a full decision, so refusals alone cannot keep it at its peak rate.
Envoy can refuse for free. The bootstrap subscribes to the runtime layer the service serves
over RTDS (``extproc.transport.runtime``), and in front of every route sits a twin with the
same match plus a ``runtime_fraction`` on ``SHED_RUNTIME_KEY``: 0 while the service keeps
up, raised by the service when its event loop lags (``extproc.core.overload``). A request
that draws the twin never reaches the service: a fail-closed route answers 503 with
``retry-after`` and an OpenAI-shaped error at once, a fail-open route forwards it
unscheduled, as it would if the service were down.

The mesh snippet and the mesh renderers leave the twins out: a bootstrap someone else owns
has its own ``layered_runtime``. There the service still refuses its least urgent tier
while overloaded.
"""

from __future__ import annotations

from typing import Any

from extproc.core.errors import error_body
from extproc.core.gateway import OVERLOAD_RETRY_AFTER_S
from extproc.envoy.filter import EXT_PROC_PER_ROUTE_TYPE
from extproc.envoy.params import CATCH_ALL_ROUTE, EnvoyParams, RouteSpec
from extproc.envoy.replicas import xds_retry_policy
from extproc.envoy.routes import route
from extproc.wire import EXT_PROC_FILTER, EXTPROC_CLUSTER, RUNTIME_LAYER, SHED_RUNTIME_KEY

SHED_MESSAGE = "the gateway is overloaded; retry later"
SHED_STATUS = 503
SHED_CODE = "gateway_overloaded"
OVERLOAD_SUFFIX = "_overloaded"
"""A twin's name is its route's plus this."""


def layered_runtime(params: EnvoyParams) -> dict[str, Any]:
    """The bootstrap's runtime: the service's RTDS layer, then the admin layer (so that
    ``/runtime_modify`` still works for an operator).

    With replicas the layer comes over one stream to one replica of the ext_proc cluster (the
    load balancer's pick), so Envoy sheds on that replica's view of overload. Envoy spreads
    requests evenly over the replicas, so one replica's lag stands for the others'; when that
    replica dies, the stream is opened again on another within about a second
    (:func:`~extproc.envoy.replicas.xds_retry_policy`) and its layer replaces the last one.
    """
    envoy_grpc: dict[str, Any] = {"cluster_name": EXTPROC_CLUSTER}
    retry = xds_retry_policy(params)
    if retry is not None:
        envoy_grpc["retry_policy"] = retry
    return {
        "layers": [
            {
                "name": RUNTIME_LAYER,
                "rtds_layer": {
                    "name": RUNTIME_LAYER,
                    "rtds_config": {
                        "resource_api_version": "V3",
                        # Envoy waits this long for the layer before it starts listening; a
                        # service that is not up yet must not delay Envoy (nothing is shed
                        # until the layer arrives).
                        "initial_fetch_timeout": "1s",
                        "api_config_source": {
                            "api_type": "GRPC",
                            "transport_api_version": "V3",
                            "grpc_services": [{"envoy_grpc": envoy_grpc}],
                        },
                    },
                },
            },
            {"name": "admin", "admin_layer": {}},
        ]
    }


def buffer_filter(params: EnvoyParams) -> dict[str, Any]:
    """Reads a shed request's body before the twin answers it.

    Envoy closes an HTTP/1.1 connection when it answers a request it has not read to the
    end, so an answer from the twin's ``direct_response`` (decided on the headers) would
    cost every refused client a new connection, and Envoy the churn, exactly while it is
    shedding load. Placed after the ext_proc filter, which has already buffered the body of
    every request it processes, it costs those requests nothing."""
    return {
        "name": "envoy.filters.http.buffer",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": params.buffer_limit_bytes,
        },
    }


def guarded_routes(params: EnvoyParams) -> list[dict[str, Any]]:
    """Every route of ``extproc.envoy.routes.routes``, each behind its twin."""
    rendered = []
    for spec in (*params.routes, None):
        own = route(params, spec)
        rendered += [shed_route(params, spec, own["route"]), own]
    return rendered


def shed_route(
    params: EnvoyParams, spec: RouteSpec | None, forward: dict[str, Any]
) -> dict[str, Any]:
    """The twin in front of a route: its match, drawn with the shed fraction. ``forward`` is
    the route's own ``route`` action, used unscheduled where the route is fail-open."""
    allow = params.failure_mode_allow if spec is None else spec.failure_mode_allow
    match: dict[str, Any] = {"prefix": "/"} if spec is None else dict(spec.match)
    match["runtime_fraction"] = {
        # Envoy reads an integer runtime value as a percentage, whatever this denominator.
        "default_value": {"numerator": 0, "denominator": "HUNDRED"},
        "runtime_key": SHED_RUNTIME_KEY,
    }
    twin: dict[str, Any] = {
        "name": (CATCH_ALL_ROUTE if spec is None else spec.name) + OVERLOAD_SUFFIX,
        "match": match,
        "typed_per_filter_config": {
            EXT_PROC_FILTER: {"@type": EXT_PROC_PER_ROUTE_TYPE, "disabled": True}
        },
    }
    if allow:
        twin["route"] = forward
        return twin
    twin["direct_response"] = {
        "status": SHED_STATUS,
        "body": {"inline_string": error_body(SHED_STATUS, SHED_MESSAGE, SHED_CODE).decode()},
    }
    twin["response_headers_to_add"] = [
        {"header": {"key": "retry-after", "value": str(OVERLOAD_RETRY_AFTER_S)}},
        {"header": {"key": "content-type", "value": "application/json"}},
    ]
    return twin
