"""What the filters know of the request and of the moment, built once per placement."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from extproc.fleet.models import NOTHING_LOADABLE, Loadable

if TYPE_CHECKING:
    from extproc.policy import Tier


@dataclass(frozen=True, slots=True)
class View:
    tier: Tier | None
    """The tier the band's requests act as now (after aging); None for a removed tier."""
    rank: int
    limit: int
    """The per-backend cap on requests in flight (``max_in_flight_per_backend``)."""
    model: str | None
    """The model of the band's next request."""
    seat_bound: bool
    """It needs a free seat (or one within its queue gate): seats bound the tier here."""
    queue: int | None
    """How deep the tier may queue inside an engine (its gate's ``max_waiting``)."""
    reserved_above: bool
    """A more urgent active tier holds a reserve this one must leave."""
    priority: int | None
    """The vLLM priority the band's next request would go with (the queue gate's input)."""
    now: float
    stale_after_s: float
    loadable: Loadable = field(default_factory=lambda: NOTHING_LOADABLE, hash=False)
    """The policy's runtime adapters (adapter -> base): loaded where their base is served."""
