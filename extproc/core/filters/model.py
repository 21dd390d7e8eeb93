"""The model: only an engine that answers to the request's model (its ``/v1/models``), or
that serves the base of a runtime adapter it may load now (its last load did not fail)."""

from __future__ import annotations

from extproc.core.filters.view import View
from extproc.fleet.backend import Backend
from extproc.fleet.models import may_serve, needs_load


def admits(backend: Backend, view: View) -> bool:
    if not may_serve(backend, view.model, view.loadable):
        return False
    return view.now >= backend.no_loads_until or not needs_load(
        backend.models, view.model, view.loadable
    )
