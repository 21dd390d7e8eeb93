"""Admission's filters: which backends may take a band's next request now, one module each.

Each module has ``admits(backend, view) -> bool``; a backend is a candidate when every
filter admits it, cheapest first (``FILTERS``), and the picker then scores the candidates
(``extproc.core.scorers``). ``Placement`` (``extproc.core.admission``) builds one ``View``
per band and dispatch round: what the request is for and what the filters compare with.
Seats and reservations also bound how many may go at all (``reservations.headroom``), and a
tier that keeps seats prefers a free one; those decide over the fleet, not per backend, and
stay in admission.
"""

from __future__ import annotations

from collections.abc import Callable

from extproc.core.filters import cap, gate, health, model, seats
from extproc.core.filters.view import View
from extproc.fleet.backend import Backend

Filter = Callable[[Backend, View], bool]

FILTERS: tuple[Filter, ...] = (cap.admits, health.admits, model.admits, seats.admits, gate.admits)
"""In the order they are asked: the cheapest and the most often failing first."""


def admits(backend: Backend, view: View) -> bool:
    """Whether every filter admits ``backend`` for the request ``view`` describes."""
    return all(admit(backend, view) for admit in FILTERS)


__all__ = ["FILTERS", "View", "admits"]
