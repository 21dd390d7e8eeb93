"""What Envoy strips itself agrees with what the service strips, and nothing the service
sets is removed after it."""

from __future__ import annotations

from extproc.core.gateway import PRIORITY_HEADER, TENANT_HEADER, client_headers_to_strip
from extproc.envoy.bootstrap import render_bootstrap
from extproc.envoy.owned_headers import (
    CONSUMED_HEADERS,
    HEADER_MUTATION_FILTER,
    OWNED_HEADERS,
    route_headers_to_remove,
    strip_filter,
)
from extproc.envoy.params import EnvoyParams
from extproc.wire import (
    CLIENT_AUTHORIZATION_HEADER,
    DESTINATION_HEADER,
    TIER_HEADER,
    VLLM_PRIORITY_HEADER,
)


def test_the_priority_header_is_the_gateways() -> None:
    assert VLLM_PRIORITY_HEADER == PRIORITY_HEADER


def test_every_header_envoy_strips_the_service_strips_too() -> None:
    """Both sides remove the same client headers: Envoy for requests the service never saw,
    the service for an Envoy without the filter (a mesh)."""
    names = [*OWNED_HEADERS, *CONSUMED_HEADERS, "authorization", "x-fairlane-anything"]
    stripped = set(client_headers_to_strip(dict.fromkeys(names, "x")))
    # the destination is always overwritten by the codec, so the gateway does not list it
    assert stripped == set(names) - {DESTINATION_HEADER}


def test_the_filter_removes_owned_headers_and_moves_the_key_aside() -> None:
    mutations = strip_filter()["typed_config"]["mutations"]["request_mutations"]
    assert mutations[0] == {"remove_on_match": {"key_matcher": {"prefix": "x-fairlane-"}}}
    removed = [m["remove"] for m in mutations if "remove" in m]
    assert set(OWNED_HEADERS) | {"authorization"} == set(removed)
    assert removed[-1] == "authorization"  # after it was copied
    (moved,) = [m["append"]["header"] for m in mutations if "append" in m]
    assert moved == {"key": CLIENT_AUTHORIZATION_HEADER, "value": "%REQ(authorization)%"}


def test_routes_never_remove_what_the_service_sets() -> None:
    service_sets = {PRIORITY_HEADER, TIER_HEADER, TENANT_HEADER, DESTINATION_HEADER}
    service_sets.add("authorization")  # an engine's key (extproc.transport.credentials)
    assert not service_sets & set(route_headers_to_remove())
    hcm = render_bootstrap(EnvoyParams())["static_resources"]["listeners"][0]["filter_chains"][0]
    config = hcm["filters"][0]["typed_config"]
    assert config["http_filters"][0]["name"] == HEADER_MUTATION_FILTER
    for route in config["route_config"]["virtual_hosts"][0]["routes"]:
        if "route" in route:
            assert route["request_headers_to_remove"] == list(CONSUMED_HEADERS)
