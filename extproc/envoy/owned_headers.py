"""The headers the gateway owns, stripped from what clients send by Envoy itself.

The service removes the client's copies from every request it forwards (``core.gateway``),
but a request on a fail-open route goes upstream unprocessed while the service is down. So
the shipped bootstrap strips them before anything reads them, in two places: a filter before
the ext_proc filter removes what only the gateway may set and moves the client's
``authorization`` aside (``strip_filter``), so the service can set an engine's own key under
that name without a tenant key ever riding along; and every route removes what the service
reads but never sets (``route_headers_to_remove``). Header matching in a plain list cannot
remove by prefix; ``remove_on_match`` with a prefix matcher can. The snippet for an existing
Envoy and the mesh objects do not carry the filter (the service still strips on every
request it forwards); their routes carry the route part.
"""

from __future__ import annotations

from typing import Any

from extproc.wire import (
    CLIENT_AUTHORIZATION_HEADER,
    DESTINATION_HEADER,
    OWNED_HEADER_PREFIX,
    VLLM_PRIORITY_HEADER,
)

HEADER_MUTATION_FILTER = "envoy.filters.http.header_mutation"

OWNED_HEADERS = (VLLM_PRIORITY_HEADER, DESTINATION_HEADER, "x-target-cluster")
"""Headers only the gateway sets (besides every ``x-fairlane-*``): a client's copy is
removed before the service sees the request."""
CONSUMED_HEADERS = ("x-priority", "x-api-key", CLIENT_AUTHORIZATION_HEADER)
"""Headers the service reads and never sets: removed on the route, after the service."""


def strip_filter() -> dict[str, Any]:
    """The header_mutation filter that goes first in the chain (see below).

    Mutations apply in order: the client's ``x-fairlane-*`` go first, so the moved key is
    the only ``x-fairlane-client-authorization`` left; an absent ``authorization`` formats
    as empty and adds nothing.

    It removes what only the gateway may set (``x-fairlane-*``, ``x-vllm-priority``,
    ``x-gateway-destination-endpoint``, ``x-target-cluster``) and moves the client's
    ``authorization`` to ``x-fairlane-client-authorization``, which the service reads. Removing
    ``authorization`` there is what lets the service set an engine's own key under that name
    (``extproc.transport.credentials``) without a tenant key ever riding along.
    """
    mutations: list[dict[str, Any]] = [
        {"remove_on_match": {"key_matcher": {"prefix": OWNED_HEADER_PREFIX}}},
        *({"remove": name} for name in OWNED_HEADERS),
        {
            "append": {
                "header": {"key": CLIENT_AUTHORIZATION_HEADER, "value": "%REQ(authorization)%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        },
        {"remove": "authorization"},
    ]
    return {
        "name": HEADER_MUTATION_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3."
            "HeaderMutation",
            "mutations": {"request_mutations": mutations},
        },
    }


def route_headers_to_remove() -> list[str]:
    """A route's ``request_headers_to_remove``: what the service consumed.

    It removes what the service reads but never sets (the client's tier ask, its key headers).
    Route headers apply after the filters, so they cannot touch anything the service sets, only
    what it left.
    """
    return list(CONSUMED_HEADERS)
