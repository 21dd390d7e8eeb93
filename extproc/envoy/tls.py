"""TLS on the client listener: Envoy's ``DownstreamTlsContext`` from two PEM files.

Optional (``EnvoyParams.tls_cert_path`` and ``tls_key_path``, set together): without them the
listener speaks plain HTTP, as a gateway behind a TLS-terminating load balancer or mesh does.
Envoy reads the files at startup (paths as Envoy sees them, inside its container in compose),
so the key never enters the rendered config; replacing the files takes an Envoy restart.
ALPN offers HTTP/2 and HTTP/1.1 (the connection manager's codec is ``AUTO``).
"""

from __future__ import annotations

from typing import Any

TLS_TRANSPORT_SOCKET = "envoy.transport_sockets.tls"


def downstream_tls(cert_path: str, key_path: str) -> dict[str, Any]:
    """A listener filter chain's ``transport_socket`` terminating TLS with these files."""
    return {
        "name": TLS_TRANSPORT_SOCKET,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
            "DownstreamTlsContext",
            "common_tls_context": {
                "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
                "tls_certificates": [
                    {
                        "certificate_chain": {"filename": cert_path},
                        "private_key": {"filename": key_path},
                    }
                ],
                "alpn_protocols": ["h2", "http/1.1"],
            },
        },
    }
