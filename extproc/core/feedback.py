"""Completion feedback: what a finished request tells the scheduler.

Envoy's gRPC access log reports every finished request (status, duration, upstream, response
bytes) without its body passing through Python. That frees the request's backend slot and
settles its fairness charge: output tokens were charged up front as an estimate
(``max_tokens``, or the policy's default), and the real count is estimated here from the
response size, at vLLM's response shapes as the simulator reproduces them (the constants
below): within some tens of percent, enough to stop a flow that asked for 4096 tokens and got
50 from paying for 4096, not a bill.

A completion is also the gateway's view of a backend's health from inside the traffic: a
5xx, or a status 0 with no response byte, counts as a failure of the backend that answered
(or, when none did, the one it was sent to); any other status as a success.
``Backend.note_outcome`` sets a backend aside after several failures in a row.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.core.admission import Admission, Grant
from extproc.core.events import Completion
from extproc.fleet.backend import BackendPool

STREAM_BYTES_PER_TOKEN = 224.0
BODY_ENVELOPE_BYTES = 690
BODY_BYTES_PER_TOKEN = 4.9


def estimate_output_tokens(response_bytes: int, stream: bool, max_tokens: int | None) -> int:
    """Output tokens a response of ``response_bytes`` most likely carried."""
    if stream:
        tokens = round(response_bytes / STREAM_BYTES_PER_TOKEN)
    else:
        tokens = round(max(0, response_bytes - BODY_ENVELOPE_BYTES) / BODY_BYTES_PER_TOKEN)
    return tokens if max_tokens is None else min(tokens, max_tokens)


def failed(completion: Completion) -> bool:
    """The backend failed this request: a 5xx, or a connection that returned nothing.

    A status 0 with bytes sent is a client that left mid-response: not the backend's fault.
    """
    return completion.status >= 500 or (completion.status == 0 and completion.response_bytes == 0)


@dataclass(frozen=True, slots=True)
class Settled:
    """A completion applied: the output tokens it was charged, the grants its slot allowed."""

    output_tokens: int
    grants: list[Grant]


def settle(admission: Admission, pool: BackendPool, completion: Completion) -> Settled | None:
    """Release ``completion``'s slot, correct its flow's output charge, and tell the backend
    that answered how it went.

    None when the request was not in flight (a request the gateway answered itself, or a
    duplicate event). A request that failed (no status, or an error status) produced
    nothing billable.
    """
    request = admission.request_of(completion.request_id)
    if request is None:
        return None
    # The backend that answered last (a retry or hedge may have moved it), else the first.
    backend = pool.by_address.get(completion.upstream) or admission.backend_of(
        completion.request_id
    )
    if backend is not None:
        backend.note_outcome(ok=not failed(completion))
    output = 0
    if 200 <= completion.status < 300:
        output = estimate_output_tokens(
            completion.response_bytes, request.stream, request.max_tokens
        )
    return Settled(output, admission.release(completion.request_id, output_tokens=output))
