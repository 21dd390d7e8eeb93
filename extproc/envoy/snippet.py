"""The mesh snippet: fairlane's pieces for an Envoy someone else configures.

An existing Envoy has its own listeners, routes and filters; fairlane needs only its filter,
its routes, its two clusters and a few listener and connection-manager settings merged in.
The filter is inserted **disabled** and enabled per route, so the other applications'
routes on that Envoy never reach fairlane (they would be refused for want of a tenant key,
or fail closed). :func:`wrap_snippet` puts the pieces into a minimal bootstrap, as a user
would paste them, so that Envoy can validate the snippet as a whole.
"""

from __future__ import annotations

from typing import Any

from extproc.envoy.clusters import backend_cluster, extproc_cluster, replica_clusters
from extproc.envoy.connection_manager import hcm_settings
from extproc.envoy.filter import ext_proc_filter, failure_mode_override
from extproc.envoy.generated import comment, dump_yaml, generated_header
from extproc.envoy.params import EnvoyParams, RouteSpec
from extproc.envoy.protojson import HCM_TYPE, hcm_filter_chains, router_filter
from extproc.envoy.routes import plain_route

SNIPPET_COMMAND = "python -m extproc.envoy.bootstrap --mesh-snippet"
PASTE_INSTRUCTIONS = (
    "Not a bootstrap: pieces for an existing Envoy (see envoy/README.md).\n"
    "- listener_settings: merge into your listener.\n"
    "- http_connection_manager_settings: merge into your HTTP connection manager.\n"
    "- http_filters: put the ext_proc filter before envoy.filters.http.router. It is\n"
    "  disabled by default: only the routes below enable it, your others never reach\n"
    "  fairlane.\n"
    "- routes: the routes for the LLM paths (narrow the catch-all's match to your API\n"
    "  prefix); each carries the per-route config that enables the filter.\n"
    "- clusters: add every one to static_resources.clusters (or serve them via CDS).\n"
)


def render_mesh_snippet(params: EnvoyParams) -> dict[str, Any]:
    """The pieces to paste into an existing Envoy: filter, route, the two clusters, and the
    listener/HCM settings the hold needs."""
    return {
        "listener_settings": {"per_connection_buffer_limit_bytes": params.buffer_limit_bytes},
        "http_connection_manager_settings": hcm_settings(params),
        "http_filters": [scoped_ext_proc_filter(params)],
        "routes": [
            *(enabled_route(params, spec) for spec in params.routes),
            enabled_route(params),
        ],
        "clusters": [extproc_cluster(params), backend_cluster(params), *replica_clusters(params)],
    }


def scoped_ext_proc_filter(params: EnvoyParams) -> dict[str, Any]:
    """The ext_proc filter, disabled unless a route enables it.

    An existing Envoy's connection manager serves other applications' routes too; with the
    filter on by default each of them would go through fairlane and be refused (no tenant
    key) or fail closed. ``HttpFilter.disabled`` keeps it off, and a per-route
    ``ExtProcPerRoute`` (:func:`enabled_route`) turns it on for fairlane's routes only."""
    return {**ext_proc_filter(params), "disabled": True}


def enabled_route(params: EnvoyParams, spec: RouteSpec | None = None) -> dict[str, Any]:
    """A route carrying the ``ExtProcPerRoute`` that enables the scoped filter on it, with
    the route's failure mode."""
    allow = params.failure_mode_allow if spec is None else spec.failure_mode_allow
    return {**plain_route(params, spec), "typed_per_filter_config": failure_mode_override(allow)}


def wrap_snippet(snippet: dict[str, Any]) -> dict[str, Any]:
    """A minimal bootstrap around the mesh snippet, as a user would paste it: one listener
    with the snippet's settings, filter and route, plus the snippet's clusters."""
    hcm = {
        "@type": HCM_TYPE,
        "stat_prefix": "mesh",
        **snippet["http_connection_manager_settings"],
        "route_config": {
            "virtual_hosts": [{"name": "llm", "domains": ["*"], "routes": snippet["routes"]}]
        },
        "http_filters": [*snippet["http_filters"], router_filter()],
    }
    listener = {
        "name": "mesh",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10000}},
        **snippet["listener_settings"],
        "filter_chains": hcm_filter_chains(hcm),
    }
    return {"static_resources": {"listeners": [listener], "clusters": snippet["clusters"]}}


def render_mesh_snippet_yaml(params: EnvoyParams, generated_by: str | None = None) -> str:
    """:func:`render_mesh_snippet` as YAML, with paste instructions in the header comment.

    ``generated_by`` replaces the first header line (``fairlane render-envoy --snippet``
    names its deployment file there)."""
    first = generated_by or generated_header(SNIPPET_COMMAND, "extproc/envoy/snippet.py")
    return comment(f"{first}\n{PASTE_INSTRUCTIONS}") + dump_yaml(render_mesh_snippet(params))
