"""Queue depth: the requests ahead of this one on the backend, per seat it has."""

from __future__ import annotations

from extproc.core.scorers.context import Context
from extproc.fleet.backend import Backend

WEIGHT = "queue_weight"


def score(backend: Backend, context: Context) -> float:
    """(engine waiting + gateway in flight) / seats, the seats capped at the slot limit."""
    seats = max(min(backend.seats.count, context.slot_limit), 1)
    return (backend.effective_waiting() + backend.fleet_in_flight) / seats
