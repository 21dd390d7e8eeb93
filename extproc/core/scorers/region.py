"""Region: outside the local region a request pays the distance both ways."""

from __future__ import annotations

from extproc.core.scorers.context import Context
from extproc.fleet.backend import Backend

WEIGHT = "region_weight"


def score(backend: Backend, context: Context) -> float:
    return 1.0 if backend.region != context.local_region else 0.0
