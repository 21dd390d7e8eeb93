"""The policy's cap on requests in flight per backend, over every replica."""

from __future__ import annotations

from extproc.core.filters.view import View
from extproc.fleet.backend import Backend


def admits(backend: Backend, view: View) -> bool:
    return backend.fleet_in_flight < view.limit
