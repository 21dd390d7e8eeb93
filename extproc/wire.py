"""The names the ext_proc service and the rendered Envoy config must agree on.

Nothing checks these at runtime: if the service writes the destination into a metadata
namespace the filter does not accept, or a header the load balancer does not read, Envoy
silently falls back to its own pick and fairness is gone without an error anywhere. So each
name has exactly one definition, here, imported by both sides (``extproc.transport.codec``
and ``extproc.core.gateway`` on the request path, the builders in ``extproc.envoy`` for the
config). The request path imports this module, so it imports nothing but the standard
library.
"""

from __future__ import annotations

# --------------------------------------------------------------------------- Envoy's names

EXTPROC_CLUSTER = "fairlane_extproc"
"""The cluster of the ext_proc service; Envoy's gRPC access log goes to it too."""
BACKEND_CLUSTER = "fairlane_backends"
"""The vLLM engines, one priority level per region, routed by ``override_host``."""
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
"""The HTTP filter's name: ``typed_per_filter_config`` on a route is keyed by it."""
COMPLETIONS_LOG = "fairlane-completions"
"""``log_name`` of the gRPC access log that tells the service a request finished."""

# --------------------------------------------------------------------------- routing

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""``ip:port[,ip:port...]`` the service picked, first choice first (the Gateway API
Inference Extension's name). The ``override_host`` LB policy reads it from the header and
from the same key in :data:`LB_NAMESPACE` metadata."""

# --------------------------------------------------------------------------- dynamic metadata

LB_NAMESPACE = "envoy.lb"
"""Metadata namespace ``override_host`` reads the destination from."""
FAIRLANE_NAMESPACE = "fairlane"
"""Metadata namespace of what the service tells the access log and the response headers."""
# ext_proc drops metadata in every namespace not listed in the filter's receiving namespaces,
# without a warning: the filter lists exactly these two.

TIER_KEY = "tier"
QUEUE_MS_KEY = "queue_ms"

# --------------------------------------------------------------------------- headers

TIER_HEADER = "x-fairlane-tier"
"""The tier a request was served in: set by the service on the upstream request, and by
Envoy on the response from the ``fairlane`` metadata."""
QUEUE_MS_HEADER = "x-fairlane-queue-ms"
"""How long the gateway held the request, on the response."""

VLLM_PRIORITY_HEADER = "x-vllm-priority"
"""The vLLM priority the service sets on a generation request (``core.gateway`` sets it)."""
OWNED_HEADER_PREFIX = "x-fairlane-"
"""Every header under this prefix is the gateway's: a client's copy never reaches a backend."""
CLIENT_AUTHORIZATION_HEADER = "x-fairlane-client-authorization"
"""Where the shipped Envoy moves the client's ``authorization`` before the ext_proc filter, so
that a request the service never processed (a fail-open route) cannot carry a tenant key to
a backend; the codec hands it to the service as ``authorization``."""

RATELIMIT_METADATA: dict[str, str] = {
    f"x-ratelimit-{what}-{kind}": f"ratelimit_{what}_{kind}"
    for what in ("limit", "remaining", "reset")
    for kind in ("requests", "tokens")
}
"""OpenAI's rate-limit headers on an admitted response of a tenant with a budget
(``extproc.core.budgets``) -> the ``fairlane`` metadata key each is copied from."""

RESPONSE_METADATA_HEADERS: dict[str, str] = {
    TIER_HEADER: TIER_KEY,
    QUEUE_MS_HEADER: QUEUE_MS_KEY,
    **RATELIMIT_METADATA,
}
"""Response header -> key in the :data:`FAIRLANE_NAMESPACE` metadata the route copies it from."""

# Router headers the service sets per request. Envoy honours them only from a trusted filter
# (the ext_proc filter's ``mutation_rules.allow_envoy``) and strips a client's copies.
MAX_RETRIES_HEADER = "x-envoy-max-retries"
"""How many listed alternates a retry may use: never more than the service listed."""
PER_TRY_TIMEOUT_HEADER = "x-envoy-upstream-rq-per-try-timeout-ms"
"""A hedged tier's ``hedge_after_ms``."""
HEDGE_ON_TIMEOUT_HEADER = "x-envoy-hedge-on-per-try-timeout"
"""``true``: on the per-try timeout, send a copy to the next listed endpoint."""

# --------------------------------------------------------------------------- sizes

EXTPROC_STREAM_HEADROOM = 1024
"""Streams on the service's port beyond the held requests: in BUFFERED mode a stream stays
open until the upstream's response headers arrive. Envoy's circuit breaker on the ext_proc
cluster and the service's own stream limit are both held requests + this."""
BUFFER_HEADROOM_BYTES = 1 << 20
"""Over the policy's ``max_body_bytes``: Envoy's listener and cluster buffers, and the
largest gRPC message the service accepts (the body, its headers and framing)."""

# --------------------------------------------------------------------------- runtime (RTDS)

RUNTIME_LAYER = "fairlane"
"""The runtime layer the service serves over RTDS and the bootstrap subscribes to."""
SHED_RUNTIME_KEY = "fairlane.overload.shed_percent"
"""The percentage of new requests the overload routes turn away before they reach the
service (Envoy reads an integer runtime value as a percentage)."""
