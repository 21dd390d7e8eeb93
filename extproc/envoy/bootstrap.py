"""The Envoy bootstrap for the fairlane gateway core: one listener, two clusters.

Envoy terminates the OpenAI-compatible traffic and calls the fairlane ext_proc service for
every request; the service may hold a request for minutes, then rewrites it and names the
upstream endpoint. This module assembles the whole bootstrap from the pieces the other
modules of ``extproc.envoy`` build (``filter``, ``connection_manager``, ``routes``,
``clusters``, ``replicas``, ``overload``), each with the reasons for its settings next to it;
here are the listener, whose buffer must exceed the largest allowed body (else BUFFERED mode
turns big prompts into 413s), and the overload manager's connection cap.

The bootstrap is built as **plain dicts** (proto3 JSON shape), not envoy-data-plane's typed
messages: they map one-to-one onto the Envoy docs and the YAML users paste into their meshes,
and import nothing heavy. Envoy itself validates them (``envoy --mode validate``), the only
check that catches semantic errors; ``fairlane render-envoy`` adds a typed check first.
``python -m extproc.envoy.bootstrap [--mesh-snippet]`` prints the default render.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from extproc.envoy.clusters import backend_cluster, extproc_cluster, replica_clusters
from extproc.envoy.connection_manager import hcm_settings
from extproc.envoy.filter import ext_proc_filter
from extproc.envoy.generated import comment, dump_yaml, generated_header
from extproc.envoy.overload import buffer_filter, guarded_routes, layered_runtime
from extproc.envoy.owned_headers import strip_filter
from extproc.envoy.params import EnvoyParams
from extproc.envoy.protojson import HCM_TYPE, hcm_filter_chains, router_filter, socket_address
from extproc.envoy.snippet import render_mesh_snippet_yaml
from extproc.envoy.tls import downstream_tls

BOOTSTRAP_COMMAND = "python -m extproc.envoy.bootstrap"


def render_bootstrap(params: EnvoyParams) -> dict[str, Any]:
    """The whole Envoy bootstrap (proto3 JSON shape) for ``params``."""
    return {
        "admin": {"address": socket_address(params.admin_host, params.admin_port)},
        "static_resources": {
            "listeners": [_listener(params)],
            "clusters": [
                extproc_cluster(params),
                backend_cluster(params),
                *replica_clusters(params),
            ],
        },
        "overload_manager": overload_manager(params),
        # RTDS needs a node; the service serves the same layer to every Envoy.
        "node": {"id": "fairlane-envoy", "cluster": "fairlane"},
        "layered_runtime": layered_runtime(params),
    }


def render_yaml(params: EnvoyParams, header: str | None = None) -> str:
    """The bootstrap as YAML, preceded by a comment saying it is generated."""
    text = dump_yaml(render_bootstrap(params))
    first = header or generated_header(BOOTSTRAP_COMMAND, "extproc/envoy/bootstrap.py")
    return comment(first) + text


def overload_manager(params: EnvoyParams) -> dict[str, Any]:
    """A bound on client connections (Envoy warns at startup without one). Check the
    process's file-descriptor limit (ulimit -n) is above it."""
    return {
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
    }


def _listener(params: EnvoyParams) -> dict[str, Any]:
    hcm: dict[str, Any] = {
        "@type": HCM_TYPE,
        "stat_prefix": "fairlane",
        "codec_type": "AUTO",
        **hcm_settings(params),
        "route_config": {
            "name": "fairlane",
            "virtual_hosts": [
                {"name": "fairlane", "domains": ["*"], "routes": guarded_routes(params)}
            ],
        },
        # The client's copies of the gateway's headers go before anything reads them, so a
        # fail-open route cannot pass them on either (extproc.envoy.owned_headers).
        "http_filters": [
            strip_filter(),
            ext_proc_filter(params),
            buffer_filter(params),
            router_filter(),
        ],
    }
    chains = hcm_filter_chains(hcm)
    if params.tls_cert_path is not None and params.tls_key_path is not None:
        for chain in chains:
            chain["transport_socket"] = downstream_tls(params.tls_cert_path, params.tls_key_path)
    return {
        "name": "fairlane_http",
        "address": socket_address(params.listen_host, params.listen_port),
        # BUFFERED mode needs the whole body in this buffer: the default 1 MiB would 413
        # requests the policy allows.
        "per_connection_buffer_limit_bytes": params.buffer_limit_bytes,
        "filter_chains": chains,
    }


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
