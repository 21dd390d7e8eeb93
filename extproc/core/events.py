"""What Envoy tells the gateway: a request arrived, a request finished.

``transport.codec`` builds these from ext_proc and access-log protobuf messages; the core
sees only these frozen objects, so every decision can be unit-tested without sockets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """One client request as Envoy reported it (headers, then the whole buffered body)."""

    method: str
    path: str
    headers: Mapping[str, str]
    """Lower-cased names; pseudo-headers (``:path`` ...) included."""
    body: bytes = b""
    request_id: str = ""
    invalid_headers: tuple[str, ...] = ()
    """Names of headers whose value was not valid UTF-8 (they are not in ``headers``)."""

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name, default)


@dataclass(frozen=True, slots=True)
class Completion:
    """One finished request, from Envoy's gRPC access log (the completion feedback channel)."""

    request_id: str
    status: int
    """HTTP status sent to the client (0 when the client went away before a response)."""
    upstream: str
    """``ip:port`` of the backend that answered last, or "" when none did."""
    duration_s: float
    """From the first byte Envoy received to the last it sent: queue time included."""
    response_bytes: int
    ttfb_s: float | None = None
    """From the first byte received to the first response byte sent (None: none was sent)."""
