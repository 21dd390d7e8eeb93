"""The virtual clock: an event heap and the time every simulated part reads.

Events are ``(time, sequence, callback, argument)``: the sequence keeps same-time events in
the order they were scheduled, so a run is deterministic for a given seed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventLoop:
    """Run callbacks in virtual-time order; ``now`` is the time of the one running."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = itertools.count()
        self.events = 0
        self._stopped = False
        """Events run so far (the simulation's own work, reported with its wall time)."""

    def __call__(self) -> float:
        """The clock the core's objects are given (``BackendPool(clock=loop)``)."""
        return self.now

    def at(self, when: float, callback: Callable[[Any], None], argument: Any = None) -> None:
        """Run ``callback(argument)`` at virtual time ``when`` (never before now)."""
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), callback, argument))

    def run_until(self, end: float) -> None:
        """Run every event due up to ``end``; the clock then reads ``end``."""
        heap = self._heap
        pop = heapq.heappop
        self._stopped = False
        while heap and heap[0][0] <= end and not self._stopped:
            when, _, callback, argument = pop(heap)
            self.now = when
            callback(argument)
            self.events += 1
        if not self._stopped:
            self.now = max(self.now, end)

    def stop(self) -> None:
        """End ``run_until`` after the running event (the clock stays where it is)."""
        self._stopped = True

    def pending(self) -> int:
        return len(self._heap)
