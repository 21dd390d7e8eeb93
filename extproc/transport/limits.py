"""What a client of the service's gRPC port may make it hold, derived from the policy.

The port serves Envoy, but anything that reaches it can connect: the limits keep a broken
or hostile client from exhausting the service, without ever refusing what the deployment
asks of it. Streams and messages are sized exactly as Envoy's side of the same deployment
(its ext_proc circuit breaker and buffer limit, :mod:`extproc.envoy.params`), from the
policy the service starts with; a reload that raises the queue or body limits needs a
restart of both, as it always did for Envoy.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.policy import DEFAULT_MAX_BODY_BYTES, Policy
from extproc.wire import BUFFER_HEADROOM_BYTES, EXTPROC_STREAM_HEADROOM

MESSAGE_FRAMING_BYTES = 64 << 10
"""Over Envoy's buffer limit: the protobuf fields around the body in one ext_proc message."""


@dataclass(frozen=True)
class ServerLimits:
    max_message_bytes: int = DEFAULT_MAX_BODY_BYTES + BUFFER_HEADROOM_BYTES + MESSAGE_FRAMING_BYTES
    """The largest gRPC message accepted (the body of the largest request, and its framing)."""
    max_concurrent_streams: int = 10_000 + EXTPROC_STREAM_HEADROOM
    """Per connection, advertised and enforced: every held request is one stream."""
    max_connections: int = 1024
    """Open connections at once: Envoy opens a few per worker; beyond, a new one is closed."""
    handshake_timeout_s: float = 10.0
    """A connection that has not sent its HTTP/2 preface by then is closed."""
    idle_timeout_s: float = 300.0
    """A connection with no stream for this long is closed (GOAWAY; Envoy reconnects)."""
    stream_window_bytes: int = 1 << 20
    """What a stream may send that its handler has not read yet (its receive window)."""

    @classmethod
    def for_policy(cls, policy: Policy, max_connections: int = 1024) -> ServerLimits:
        held = sum(tier.queue_limit for tier in policy.tiers)
        return cls(
            max_message_bytes=policy.max_body_bytes + BUFFER_HEADROOM_BYTES + MESSAGE_FRAMING_BYTES,
            max_concurrent_streams=held + EXTPROC_STREAM_HEADROOM,
            max_connections=max_connections,
        )
