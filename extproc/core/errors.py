"""Client-facing errors in OpenAI's JSON shape.

Every refusal the gateway makes (bad key, bad JSON, full queue, ...) is raised as a
``Rejection`` by plain code and turned into an Envoy ``ImmediateResponse`` by the codec, so
clients always get ``{"error": {"message", "type", "param", "code"}}`` whatever went wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# HTTP status -> OpenAI error "type"
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> bytes:
    """The JSON bytes of an OpenAI-style error."""
    error = {
        "message": message,
        "type": _TYPES.get(status, "api_error"),
        "param": param,
        "code": code,
    }
    return json.dumps({"error": error}, separators=(",", ":")).encode()


@dataclass
class Rejection(Exception):
    """A request the gateway answers itself instead of forwarding it."""

    status: int
    message: str
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    tier: str | None = None
    """Set when a tier's queue turned the request away (load shedding, not a client error)."""

    def __post_init__(self) -> None:
        super().__init__(f"{self.status} {self.message}")

    @property
    def body(self) -> bytes:
        return error_body(self.status, self.message, self.code, self.param)
