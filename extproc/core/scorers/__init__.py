"""The picker's scorers: one small module per thing that makes a backend a worse choice.

Each module has ``WEIGHT``, the ``routing:`` field of the policy that weighs it, and
``score(backend, context)``, the unweighted cost of sending the request there (lower is
better). The picker adds them up, weighted, into a backend's load score
(``extproc.core.picker``); prefix affinity is scored there, as it decides with a margin
rather than by sum. A scorer whose weight is 0 is not called. The filters that come first,
deciding which backends may take the request at all (model served, health, gates, seats,
reservations), are admission's (``extproc.core.admission``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from extproc.core.scorers import kv_cache, lora, queue, region
from extproc.core.scorers.context import Context
from extproc.fleet.backend import Backend
from extproc.policy import Routing

Score = Callable[[Backend, Context], float]

LOAD_SCORERS: tuple[tuple[str, Score], ...] = (
    (queue.WEIGHT, queue.score),
    (kv_cache.WEIGHT, kv_cache.score),
    (region.WEIGHT, region.score),
    (lora.WEIGHT, lora.score),
)
"""(the weight's ``routing:`` field, the scorer), in the order they are added."""


@dataclass(frozen=True, slots=True)
class Weighted:
    """The scorers a policy weighs, with their weights (those weighed 0 left out)."""

    scorers: tuple[tuple[float, Score], ...]

    def score(self, backend: Backend, context: Context) -> float:
        return sum(weight * score(backend, context) for weight, score in self.scorers)


@cache
def weighted(routing: Routing) -> Weighted:
    """The load scorers as ``routing`` weighs them (one per policy: ``Routing`` is frozen)."""
    return Weighted(
        tuple(
            (getattr(routing, field), score)
            for field, score in LOAD_SCORERS
            if getattr(routing, field)
        )
    )


__all__ = ["LOAD_SCORERS", "Context", "Weighted", "weighted"]
