"""Placement on a large fleet: look at a sample of the backends, remember a full fleet.

On a few backends admission checks every one for every decision (gates, seats, the cap),
and the picker scores every candidate; that is exact and cheap. On a thousand it is not:
measured in the discrete-event simulation (``loadtests.des``), one request cost 434 µs of
the core's CPU at 10 engines and 10,650 µs at 1,000, most of it in scans of the whole
fleet: every placement filtering every backend, every grant sorting the fleet for
alternates, and every dispatch after a scrape doing both per band.

Above ``LARGE_FLEET`` backends, placement changes in two ways:

- **A sample, not the fleet.** Candidates are collected from a cursor that walks the
  fleet round-robin, stopping at ``SAMPLE`` (8) that pass, or at the first that passes
  after ``WINDOW`` (32) looked at; the picker chooses among those by
  load and prefix (d-choice style: among 8 with room, the least loaded is near the
  best, and the cursor spreads grants over the fleet). Prefix affinity is then only
  found inside the sample: a backend holding the prompt outside it is not seen.
- **A full fleet is remembered.** When a whole walk finds no candidate for a band, that
  band is marked full. Until the next refresh (``refresh_s``, the policy's scrape
  interval: scrapes, health and cool-offs change room only that often), its placements
  look only at the backends a completion freed since, and forget each one found without
  room again (the backlog took the seat; its next completion brings it back). Without
  this, a saturated fleet with a batch backlog would walk every backend on every
  completion; without the forgetting, every backend freed since the band filled
  (measured in ``scale-day``: up to the whole fleet within one refresh, a dispatch 1.8 ms
  of CPU at 1,000 engines).

The fleet's seat total (``capacity``, what reservations are shares of) is recomputed at
most once per refresh on a large fleet, so a backend lost shows in the reserve one scrape
interval later. Below ``LARGE_FLEET`` nothing here applies and every decision is exact.
"""

from __future__ import annotations

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
ALTERNATES_SAMPLE = 8
"""Backends a large fleet's alternates (retries, hedges) are chosen from, spread evenly
over the fleet's configured order so every region is in it."""


@dataclass
class _Full:
    """A band found no room anywhere at ``at``; ``freed``: backends that gained room since."""

    at: float
    freed: dict[Backend, None] = field(default_factory=dict)


def _still_free(full: _Full, admits: Callable[[Backend], bool]) -> list[Backend]:
    """Up to ``SAMPLE`` of the backends freed since the band filled that still admit it;
    those that do not are forgotten until a completion frees them again."""
    found: list[Backend] = []
    for backend in list(full.freed):
        if admits(backend):
            found.append(backend)
            if len(found) == SAMPLE:
                break
        else:
            del full.freed[backend]
    return found


class FleetSample:
    """The cursor, the full-band memory and the seat total of one large fleet."""

    def __init__(self) -> None:
        self._cursor = 0
        self._alternates_cursor = 0
        self._full: dict[str, _Full] = {}
        self._capacity: tuple[float, int] | None = None

    def candidates(
        self,
        band: str,
        backends: Sequence[Backend],
        admits: Callable[[Backend], bool],
        now: float,
        refresh_s: float,
    ) -> list[Backend]:
        """Up to ``SAMPLE`` backends that ``admits``, from the cursor on; [] when full."""
        full = self._full.get(band)
        if full is not None and now - full.at < refresh_s:
            return _still_free(full, admits)
        count = len(backends)
        found: list[Backend] = []
        start = self._cursor
        looked = 0
        while looked < count and len(found) < SAMPLE and not (found and looked >= WINDOW):
            backend = backends[(start + looked) % count]
            looked += 1
            if admits(backend):
                found.append(backend)
        self._cursor = (start + looked) % count if count else 0
        if found:
            self._full.pop(band, None)
        else:
            self._full[band] = _Full(now)
        return found

    def freed(self, backend: Backend) -> None:
        """A completion freed a slot on ``backend``: a full band may place there now."""
        for full in self._full.values():
            full.freed[backend] = None

    def forget(self) -> None:
        """Limits changed (a policy, the other replicas): every band looks afresh."""
        self._full.clear()
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
