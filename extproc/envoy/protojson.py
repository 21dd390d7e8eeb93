"""Small values in Envoy's proto3-JSON shape, shared by every config fairlane renders.

The configs are plain dicts that map one-to-one onto the Envoy docs (see
:mod:`extproc.envoy.bootstrap` for why not typed messages); these helpers spell the few
message shapes that recur, so each is written one way only.
"""

from __future__ import annotations

from typing import Any

ROUTER_FILTER = "envoy.filters.http.router"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
HCM_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.network."
    "http_connection_manager.v3.HttpConnectionManager"
)


def duration(seconds: float) -> str:
    """proto3 JSON Duration: ``2s``, ``2.5s``, ``0.001s``."""
    text = f"{seconds:.3f}".rstrip("0").rstrip(".")
    return f"{text}s"


def socket_address(host: str, port: int) -> dict[str, Any]:
    """An ``Address`` holding a TCP socket address."""
    return {"socket_address": {"address": host, "port_value": port}}


def lb_endpoint(host: str, port: int, weight: int | None = None) -> dict[str, Any]:
    """One endpoint; ``weight`` (BackendSpec.weight) steers Envoy's own picks, i.e. the
    fallback LB once the service's listed endpoints are used up."""
    endpoint: dict[str, Any] = {"endpoint": {"address": socket_address(host, port)}}
    if weight is not None:
        endpoint["load_balancing_weight"] = weight
    return endpoint


def previous_hosts() -> dict[str, Any]:
    """The retry host predicate that keeps a retry off the hosts already tried (routes,
    the ext_proc stream's retry on another replica, Istio's gateway route)."""
    return {
        "name": "envoy.retry_host_predicates.previous_hosts",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.retry.host."
            "previous_hosts.v3.PreviousHostsPredicate"
        },
    }


def router_filter() -> dict[str, Any]:
    """The terminal HTTP filter every filter chain here ends with."""
    return {
        "name": ROUTER_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        },
    }


def hcm_filter_chains(hcm: dict[str, Any]) -> list[dict[str, Any]]:
    """A listener's ``filter_chains``: one chain holding the HTTP connection manager ``hcm``
    (its ``typed_config``)."""
    return [{"filters": [{"name": HCM_FILTER, "typed_config": hcm}]}]
