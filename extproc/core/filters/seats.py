"""Seats: a tier that seats bound needs a free one, or a place in its engine queue gate.

vLLM never preempts a running request to seat a waiting one, so a request that finds no
seat waits for someone else's to finish; a tier may queue inside the engine only as deep as
its gate's ``max_waiting`` (batch: not at all).
"""

from __future__ import annotations

from extproc.core.filters.view import View
from extproc.fleet.backend import Backend


def admits(backend: Backend, view: View) -> bool:
    if not view.seat_bound or view.queue is None:
        return True
    return backend.free_seats() > -view.queue
