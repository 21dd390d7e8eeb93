"""Placement on a large fleet: look at a sample of the backends, remember a full fleet.

On a few backends admission checks every one for every decision (gates, seats, the cap) and
the picker scores every candidate: exact and cheap. On a thousand, those scans of the whole
fleet are most of a decision's cost (docs/benchmarks/internals.md, the scale benchmarks).
Above ``LARGE_FLEET`` backends placement therefore looks at a sample: candidates from a
round-robin cursor, stopping at ``SAMPLE`` that pass (d-choice style: among 8 with room the
least loaded is near the best); the backends completions just freed are offered first, since
under a deep backlog they are the only ones with room; and a band that found the whole fleet
full looks only at freed backends until the next refresh. Prefix affinity is then found only
inside the sample, and the seat total is recomputed once per refresh. Below ``LARGE_FLEET``
nothing here applies and every decision is exact. ``FleetSample`` has the details.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from extproc.fleet.backend import Backend

LARGE_FLEET = 64
"""More backends than this: sample (below, every decision scans the fleet exactly)."""
SAMPLE = 8
"""Candidates a placement collects on a large fleet before it stops looking."""
WINDOW = 4 * SAMPLE
"""Backends a placement looks at before it settles for fewer than ``SAMPLE`` candidates
(but at least one): on a nearly full fleet, collecting ``SAMPLE`` would walk most of it."""
FREED_SHARE = SAMPLE // 2
"""Of a placement's candidates, at most this many come from the backends completions freed;
the rest from the cursor, so backends that finish nothing (idle ones) are still offered and
the picker's choice by load still spreads the fleet."""
ALTERNATES_SAMPLE = 8
"""Backends a large fleet's alternates (retries, hedges) are chosen from, spread evenly
over the fleet's configured order so every region is in it."""


@dataclass
class _Band:
    """What one band remembers between placements: ``freed``, backends a completion freed
    a slot on that have not been found without room since (oldest first); ``full_at``,
    when a whole walk of the fleet last found no room for it (None: not known full)."""

    freed: OrderedDict[Backend, None] = field(default_factory=OrderedDict)
    full_at: float | None = None

    def still_free(self, admits: Callable[[Backend], bool], wanted: int) -> list[Backend]:
        """Up to ``wanted`` freed backends that still admit the band, each moved to the end
        so the next placement offers others first; those that do not admit are forgotten
        until a completion frees them again. Each one looked at costs O(1), however many
        are held (an ordered dict: no copy of the set, no scan past removed entries)."""
        found: list[Backend] = []
        freed = self.freed
        for _ in range(len(freed)):
            backend = freed.popitem(last=False)[0]
            if admits(backend):
                freed[backend] = None
                found.append(backend)
                if len(found) == wanted:
                    break
        return found


class FleetSample:
    """The cursor, the bands' freed backends and full marks, and the seat total of one
    large fleet.

    Above ``LARGE_FLEET`` backends, placement changes in three ways:

    - **A sample, not the fleet.** Candidates are collected from a cursor that walks the fleet
      round-robin, stopping at ``SAMPLE`` (8) that pass, or at the first that passes after
      ``WINDOW`` (32) looked at; the picker chooses among those by load and prefix (d-choice
      style: among 8 with room, the least loaded is near the best, and the cursor spreads grants
      over the fleet). Prefix affinity is then only found inside the sample: a backend holding
      the prompt outside it is not seen.
    - **Freed backends first.** Every completion marks its backend as freed for each band; a
      placement offers up to ``FREED_SHARE`` of those that still admit it before walking the
      cursor, and forgets each one it finds without room (the backlog took the seat; its next
      completion brings it back). Under a deep backlog the fleet is full but for the seats
      completions just freed, a handful of a thousand: without this a placement walked hundreds
      of backends to find one.
    - **A full fleet is remembered.** When a whole walk finds no candidate for a band, that band
      is marked full. Until the next refresh (``refresh_s``, the policy's scrape interval:
      scrapes, health and cool-offs change room only that often), its placements look only at
      the backends completions freed since.

    The fleet's seat total (``capacity``, what reservations are shares of) is recomputed at most
    once per refresh on a large fleet, so a backend lost shows in the reserve one scrape
    interval later.
    """

    def __init__(self) -> None:
        self._cursor = 0
        self._alternates_cursor = 0
        self._bands: dict[str, _Band] = {}
        self._capacity: tuple[float, int] | None = None

    def candidates(
        self,
        band: str,
        backends: Sequence[Backend],
        admits: Callable[[Backend], bool],
        now: float,
        refresh_s: float,
    ) -> list[Backend]:
        """Up to ``SAMPLE`` backends that ``admits``: first up to ``FREED_SHARE`` of the
        backends completions freed, then from the cursor on; [] when full."""
        state = self._bands.get(band)
        if state is None:
            state = self._bands[band] = _Band()
        if state.full_at is not None and now - state.full_at < refresh_s:
            return state.still_free(admits, SAMPLE)
        state.full_at = None
        found = state.still_free(admits, FREED_SHARE) if state.freed else []
        count = len(backends)
        start = self._cursor
        looked = 0
        while looked < count and len(found) < SAMPLE and not (found and looked >= WINDOW):
            backend = backends[(start + looked) % count]
            looked += 1
            if admits(backend) and backend not in found:
                found.append(backend)
        self._cursor = (start + looked) % count if count else 0
        if not found:
            state.full_at = now
        return found

    def freed(self, backend: Backend) -> None:
        """A completion freed a slot on ``backend``: every band may place there now."""
        for state in self._bands.values():
            state.freed[backend] = None

    def forget(self) -> None:
        """Limits changed (a policy, the other replicas, the fleet): every band looks afresh."""
        self._bands.clear()
        self._capacity = None

    def capacity(self, compute: Callable[[], int], now: float, refresh_s: float) -> int:
        """``compute()``'s seat total, reused for ``refresh_s``."""
        if self._capacity is None or now - self._capacity[0] >= refresh_s:
            self._capacity = (now, compute())
        return self._capacity[1]

    def spread(self, fleet: Sequence[Backend]) -> list[Backend]:
        """``ALTERNATES_SAMPLE`` backends evenly spaced over ``fleet`` from a moving offset."""
        count = len(fleet)
        step = max(1, count // ALTERNATES_SAMPLE)
        offset = self._alternates_cursor % step
        self._alternates_cursor += 1
        return [fleet[i] for i in range(offset, count, step)][:ALTERNATES_SAMPLE]
