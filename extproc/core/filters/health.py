"""Health: ``/health`` answered, the last scrape worked, not cooling off, serving."""

from __future__ import annotations

from extproc.core.filters.view import View
from extproc.fleet.backend import Backend


def admits(backend: Backend, view: View) -> bool:
    return backend.healthy
