"""The routes to the backends: no timeout a hold or a long generation hits, retries only
where a replay is safe, and the ``x-fairlane-*`` response headers.

The route timer starts only once ext_proc released the request, so the hold itself is
bounded by the filter's message timeouts and the connection manager's idle timeout, never
here. A route's failure mode (what Envoy does when the service is down) is the filter's,
overridden per route (:class:`~extproc.envoy.params.RouteSpec`).
"""

from __future__ import annotations

from typing import Any

from extproc.envoy.filter import failure_mode_override
from extproc.envoy.owned_headers import route_headers_to_remove
from extproc.envoy.params import CATCH_ALL_ROUTE, NUM_RETRIES, RETRY_ON, EnvoyParams, RouteSpec
from extproc.envoy.protojson import duration, previous_hosts
from extproc.wire import BACKEND_CLUSTER, FAIRLANE_NAMESPACE, RESPONSE_METADATA_HEADERS


def routes(params: EnvoyParams) -> list[dict[str, Any]]:
    """Every route, in match order: the deployment's extra routes, then the catch-all."""
    return [*(route(params, spec) for spec in params.routes), route(params)]


def route(params: EnvoyParams, spec: RouteSpec | None = None) -> dict[str, Any]:
    """A route to the backends: no timeouts that a hold or a long generation hits, a retry
    policy for connection failures, and the x-fairlane-* response headers.

    Without ``spec`` it is the catch-all ``/`` route; with one, the spec's name and match.
    A fail-open route (or catch-all) carries an ``ExtProcPerRoute`` override; fail-closed
    routes carry none, since the filter itself is fail-closed."""
    allow = params.failure_mode_allow if spec is None else spec.failure_mode_allow
    rendered = plain_route(params, spec)
    if allow:
        rendered["typed_per_filter_config"] = failure_mode_override(True)
    return rendered


def plain_route(params: EnvoyParams, spec: RouteSpec | None) -> dict[str, Any]:
    """:func:`route` without any per-route filter config (callers add their own)."""
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
            "idle_timeout": duration(params.stream_idle_timeout_s),
            # Also the retry policy hedging needs: the service turns hedging on per request
            # (x-envoy-hedge-on-per-try-timeout + x-envoy-upstream-rq-per-try-timeout-ms for
            # tiers with hedge_after_ms), and Envoy hedges only with num_retries and at least
            # one retry_on condition. Hedges count as retries: a hedged request runs at most
            # 1 + num_retries copies, each on the next listed endpoint.
            "retry_policy": _retry_policy(),
        },
        "response_headers_to_add": _response_headers(),
        # What the service read and never sets (the client's tier ask and key headers): gone
        # even when the service was bypassed (fail-open). Route headers apply after the
        # filters, so they never touch what the service set.
        "request_headers_to_remove": route_headers_to_remove(),
    }


def _retry_policy() -> dict[str, Any]:
    return {
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
        "retry_host_predicate": [previous_hosts()],
        "host_selection_retry_max_attempts": 3,
        "retry_priority": {
            "name": "envoy.retry_priorities.previous_priorities",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.retry.priority."
                "previous_priorities.v3.PreviousPrioritiesConfig",
                "update_frequency": 1,
            },
        },
    }


def _response_headers() -> list[dict[str, Any]]:
    """From the service's ``fairlane`` dynamic metadata (numbers print as "12", "12.5").

    Verified on Envoy 1.40: a missing namespace/key formats as empty and empty values are
    skipped (keep_empty_value false), so the header is absent, never "-". Route headers also
    apply to local replies: an ImmediateResponse whose ProcessingResponse carries
    ``fairlane`` metadata gets them too, and headers the ImmediateResponse sets itself win
    over these."""
    return [
        {
            "header": {
                "key": header,
                "value": f"%DYNAMIC_METADATA({FAIRLANE_NAMESPACE}:{key})%",
            },
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
        for header, key in RESPONSE_METADATA_HEADERS.items()
    ]
