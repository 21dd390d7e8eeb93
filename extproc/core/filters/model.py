"""The model: only an engine that answers to the request's model (its ``/v1/models``)."""

from __future__ import annotations

from extproc.core.filters.view import View
from extproc.fleet.backend import Backend
from extproc.fleet.models import may_serve


def admits(backend: Backend, view: View) -> bool:
    return may_serve(backend, view.model)
