"""Endpoint picking, first version: least-loaded healthy backend with room, plus alternates.

The first endpoint serves the first attempt; the alternates (healthy only, another region
first) serve Envoy's retries and hedges through override_host. Scoring by KV-cache use,
queue depth and prefix affinity comes in a later version.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.backends import Backend

MAX_ALTERNATES = 2


def pick(backends: Sequence[Backend], limit: int) -> list[Backend] | None:
    """The chosen backend then alternates, or None when no healthy backend has room."""
    healthy = [b for b in backends if b.healthy]
    with_room = [b for b in healthy if b.in_flight < limit]
    if not with_room:
        return None
    # min() keeps configured order on ties, so the local (first) region wins a tie.
    best = min(with_room, key=lambda b: b.in_flight)
    others = sorted(
        (b for b in healthy if b is not best),
        key=lambda b: (b.region == best.region, b.in_flight),
    )
    return [best, *others[:MAX_ALTERNATES]]
