"""What the gateway tells Envoy about one request: forward it, answer it, or hold it.

``transport.codec`` turns a ``Forward`` or ``Respond`` into an ext_proc response; a
``Hold`` tells the transport to keep the request in Envoy (``override_message_timeout``)
while it waits in a queue, until admission grants it (``Gateway.resume``) or its deadline
passes (``Gateway.give_up``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from extproc.core.admission import Grant
    from extproc.core.classify import RequestClass
    from extproc.core.events import RequestInfo


@dataclass(frozen=True, slots=True)
class AdapterLoad:
    """A runtime LoRA adapter the chosen engine must load before the request goes there
    (``extproc.fleet.adapters``)."""

    address: str
    """``ip:port`` of the engine."""
    name: str
    base: str
    path: str


@dataclass(frozen=True, slots=True)
class Forward:
    """Let the request go upstream, rewritten."""

    body: bytes
    """The new body; the codec sets ``content-length`` to match."""
    endpoints: tuple[str, ...]
    """``ip:port`` of the chosen endpoint first, alternates after (retries, hedges)."""
    set_headers: Mapping[str, str] = field(default_factory=dict)
    remove_headers: tuple[str, ...] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)
    """Dynamic metadata for Envoy's ``fairlane`` namespace (access logs, response headers)."""
    cancel_id: str | None = None
    """Set when the gateway may cancel this request while it runs (``Gateway.preempted``):
    the transport keeps its stream open until the answer starts, and tells admission so
    (``Admission.cancellable``)."""
    load: AdapterLoad | None = None
    """Set when the first endpoint must load the request's adapter first: the transport
    awaits the load, and answers 503 when it fails."""


@dataclass(frozen=True, slots=True)
class Respond:
    """Answer the client directly (Envoy's ImmediateResponse); nothing reaches a backend."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Hold:
    """The request waits in its tier's queue: keep it in Envoy for at most ``hold_s``.

    The transport waits up to ``deadline_s`` for the grant of ``request_id`` and then hands
    this back to the gateway (``resume`` with the grant, or ``give_up``); the rest is what
    the gateway needs to finish the request then.
    """

    request_id: str
    hold_s: float
    deadline_s: float
    tier: str
    info: RequestInfo
    body: dict[str, Any]
    request: RequestClass


@dataclass(frozen=True, slots=True)
class Decision:
    """What one event decided: the answer for the request that caused it (if any), and
    the grants it released for requests waiting in the queues.

    Admission is synchronous: a submission, a completion or a fresh scrape may let several
    held requests go at once. The transport resolves their waits with ``grants``.
    """

    answer: Forward | Respond | Hold | None
    grants: tuple[Grant, ...] = ()
