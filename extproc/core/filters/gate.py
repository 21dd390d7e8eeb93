"""The tier's gate on the engine's scraped metrics (``extproc.core.gates``)."""

from __future__ import annotations

from extproc.core.filters.view import View
from extproc.core.gates import passes
from extproc.fleet.backend import Backend


def admits(backend: Backend, view: View) -> bool:
    tier = view.tier
    if tier is None:  # a band a reload removed: served with no gate
        return True
    return passes(
        tier.gate,
        backend,
        view.now,
        view.stale_after_s,
        view.rank,
        view.reserved_above,
        view.priority,
    )
