"""What ``fairlane up`` tells the user about each backend's seats, and when.

The children's output goes to log files, so what the user must see is printed by ``up``
itself, among it each backend's seats (how many requests its engine runs at once, which
admission plans with). Those are learned by the service after start and change when an
engine restarts with other flags, so ``up`` reads them from the service's own
``fairlane_backend_seats`` gauge every few seconds and prints a line when one changes
(:class:`SeatWatch`).
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass

SEATS_POLL_S = 2.0
"""How often ``fairlane up`` reads the service's seat gauges (a scrape costs it ~1 ms)."""
FALLBACK_REPORT_S = 30.0
"""A fallback estimate grows with every request more an engine is seen running: a change of
it alone is printed at most this often per backend, so a load test does not flood the
terminal. A learned or declared count, or a change of source, is printed at once."""
SOURCE_TEXT = {
    "declared": "declared",
    "learned": "learned from the engine",
    "fallback": "fallback: not learned yet",
}

_SEATS_SAMPLE = re.compile(r"^fairlane_backend_seats\{([^}]*)\}[ \t]+(\S+)", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class SeatCount:
    """One backend's seats as the service reports them (``fairlane_backend_seats``)."""

    region: str
    count: int
    source: str

    def line(self, address: str) -> str:
        return f"backend {self.region} {address}: seats {self.count} ({self.describe()})"

    def describe(self) -> str:
        return SOURCE_TEXT.get(self.source, self.source)


def parse_seats(text: str) -> dict[str, SeatCount]:
    """Backend address -> its seats, from the service's ``/metrics`` text."""
    found: dict[str, SeatCount] = {}
    for match in _SEATS_SAMPLE.finditer(text):
        labels = {key: _unescape(value) for key, value in _LABEL.findall(match[1])}
        try:
            count = round(float(match[2]))
        except ValueError:
            continue
        if "backend" in labels:
            found[labels["backend"]] = SeatCount(
                labels.get("region", ""), count, labels.get("source", "")
            )
    return found


def _unescape(value: str) -> str:
    """A label value as written before the exposition escaped ``\\``, ``"`` and newlines."""
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], value)


class SeatWatch:
    """What ``fairlane up`` has told the user about each backend's seats, and what changed.

    ``poll`` reads the service's ``/metrics`` at most every ``SEATS_POLL_S``; ``changes``
    (pure, tested without sockets) decides which differences are worth a line. A failed
    read is skipped quietly: the service may be busy, and a dead one is reported anyway.
    """

    def __init__(self, metrics_url: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics_url = metrics_url
        self.clock = clock
        self.shown: dict[str, SeatCount] = {}
        self.shown_at: dict[str, float] = {}
        self._polled_at = -float("inf")

    def read(self, timeout: float = 1.0) -> dict[str, SeatCount] | None:
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=timeout) as response:
                return parse_seats(response.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def first(self, timeout: float = 5.0) -> dict[str, SeatCount]:
        """The seats at start (the metrics endpoint may open just after the gRPC port);
        empty if the service does not answer in ``timeout``."""
        deadline = self.clock() + timeout
        while True:
            seen = self.read()
            if seen is not None or self.clock() >= deadline:
                break
            time.sleep(0.1)
        now = self.clock()
        self.shown = dict(seen or {})
        self.shown_at = dict.fromkeys(self.shown, now)
        self._polled_at = now
        return self.shown

    def poll(self) -> list[str]:
        """Lines to print now (none between polls or when the service does not answer)."""
        now = self.clock()
        if now - self._polled_at < SEATS_POLL_S:
            return []
        self._polled_at = now
        seen = self.read()
        return [] if seen is None else self.changes(seen, now)

    def changes(self, seen: Mapping[str, SeatCount], now: float) -> list[str]:
        """One line per backend whose seats changed since they were last shown."""
        lines = []
        for address, seat in seen.items():
            shown = self.shown.get(address)
            if shown is not None and (shown.count, shown.source) == (seat.count, seat.source):
                continue
            growing_estimate = shown is not None and shown.source == seat.source == "fallback"
            if growing_estimate and now - self.shown_at.get(address, now) < FALLBACK_REPORT_S:
                continue  # shown later, with the estimate it has grown to by then
            self.shown[address] = seat
            self.shown_at[address] = now
            lines.append(seat.line(address))
        return lines
