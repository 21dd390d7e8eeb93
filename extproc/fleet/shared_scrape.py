"""One scrape of each engine for the whole fleet of replicas, not one per replica.

Rendering vLLM's ``/metrics`` costs the engine's API server milliseconds, on the same event
loop that streams its tokens, and every replica scraping every engine ten times a second
multiplies that by the replicas (docs/benchmarks/internals.md). So when replicas share state,
each engine is scraped by one replica, its **scraper**, chosen by rendezvous hashing over the
live replicas (``scraper_of``: every replica computes the same answer, and when a replica
leaves only its engines move). The scraper puts what it read in its report; the others adopt
it (``Backend.adopt_scrape``) at the time it was taken on their own clock (the reader's now,
minus the report's age, minus the scrape's age when written): no two clocks are compared. A
replica that sees no fresh scrape of an engine for ``takeover_s`` scrapes it itself: a hung
scraper costs an extra scrape, never a blind gateway. Cut off from Redis, every replica
scrapes every engine. Pure data and arithmetic, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from extproc.fleet.vllm_metrics import EngineMetrics


@dataclass(frozen=True, slots=True)
class SharedScrape:
    """One engine's last good scrape as its scraper reports it."""

    metrics: EngineMetrics
    """What was read. Its ``scraped_at`` is on the scraper's clock: elsewhere it only tells
    one scrape from the next (the same scrape comes again in every report until the next);
    ``age_s`` says when it was taken."""
    age_s: float
    """How old the scrape was when the scraper wrote its report."""
    ok: bool = True
    """Whether the scraper's latest scrape succeeded. When not, ``metrics`` is the last good
    one and the readers mark the engine unscrapable, as the scraper did."""


def scraper_of(address: str, replicas: Iterable[str]) -> str:
    """The replica that scrapes ``address``: the highest rendezvous hash of (replica,
    address). Stable across processes and versions (blake2b, not Python's salted ``hash``);
    a replica joining or leaving moves only the engines it wins or held."""
    return max(replicas, key=lambda replica: _weight(replica, address))


def _weight(replica: str, address: str) -> bytes:
    return hashlib.blake2b(f"{replica}\n{address}".encode(), digest_size=8).digest()


def takeover_s(scrape_interval_s: float, period_s: float) -> float:
    """How old an engine's newest scrape may get before a replica that is not its scraper
    scrapes it too: three scrape intervals, and never less than the scrape's way through
    the exchange (one interval plus a few exchange periods), so a healthy scraper is never
    doubled."""
    return max(3 * scrape_interval_s, scrape_interval_s + 5 * period_s)
