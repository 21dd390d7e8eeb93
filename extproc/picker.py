"""Endpoint picking: the least-loaded backend that may take the request, plus alternates.

The first endpoint serves the first attempt; the alternates (healthy only, another region
first) serve Envoy's retries and hedges through override_host, which uses a listed host even
when Envoy's own health check fails it. Scoring by KV-cache use, queue depth and prefix
affinity comes in a later version.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.backends import Backend

MAX_ALTERNATES = 2


def pick(candidates: Sequence[Backend], fleet: Sequence[Backend]) -> list[Backend] | None:
    """The best of ``candidates`` then alternates from the healthy ``fleet``; None if none.

    ``candidates`` are the backends that may take the request now (gates passed, room left).
    """
    if not candidates:
        return None
    # min() keeps configured order on ties, so the local (first) region wins a tie.
    best = min(candidates, key=lambda b: b.in_flight)
    others = sorted(
        (b for b in fleet if b.healthy and b is not best),
        key=lambda b: (b.region == best.region, b.in_flight),
    )
    return [best, *others[:MAX_ALTERNATES]]
