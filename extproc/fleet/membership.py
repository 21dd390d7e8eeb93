"""Following the addresses DNS names resolve to: backends join, drain and leave.

Each resolution of a ``DnsBackendSpec`` is compared with the name's previous set
(``update``): a new address joins ``warming`` and gets requests only after its first good
scrape, so an engine still loading its model is never picked; a vanished address drains (no
new requests, those in flight run to their end) and is removed once none is left, and only
then forgotten, with ``removed`` telling the caller what to release (admission's records, the
engines' keys, Envoy's host set); an address that comes back after its removal is a new
backend, learned from scratch. A failed resolution changes nothing (``failed``): the last
known set is kept through a DNS outage, and the failure is counted per name. A static
backend's address is never taken over by a name that also resolves to it. Pure state, no I/O
and no clock of its own: the resolver loop (``extproc.fleet.resolver``) feeds it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from extproc.fleet.backend import Backend, BackendPool
from extproc.fleet.discovery import DnsBackendSpec

log = logging.getLogger("fairlane.fleet")

Change = Literal["joined", "draining", "returned", "removed"]
"""A membership change, as ``fairlane_fleet_changes_total{change}`` counts it."""
CHANGES: tuple[Change, ...] = ("joined", "draining", "returned", "removed")

DRAIN_TIMEOUT_S = 1800.0
"""The longest a departed backend waits for its requests in flight before it is removed
anyway: the service's completion timeout, after which those requests' slots are reclaimed
whether or not their completions came."""


@dataclass
class Changes:
    """What one update or sweep did, by address."""

    joined: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    returned: list[str] = field(default_factory=list)
    removed: list[Backend] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.joined or self.draining or self.returned or self.removed)


class Membership:
    """The DNS names' address sets and the pool that follows them.

    - **a new address joins** the pool ``warming``: it is scraped, but gets no request until its
      first good scrape (``Backend.record_scrape`` makes it ``serving``), so an engine still
      loading its model is never picked;
    - **a vanished address drains**: it is picked no more (``healthy`` is false), its requests
      in flight run to their end, and ``sweep`` removes it once none is left there (or after
      ``drain_timeout_s``, when a completion was lost). Only then is it forgotten: the pool
      drops it, and ``removed`` tells the caller to release what else refers to its address
      (admission's per-backend records, the engines' keys, Envoy's host set over EDS);
    - **an address that comes back** while still draining is ``warming`` again (it must show a
      good scrape); one that comes back after its removal is a new backend, learned from scratch
      (seats, prefix index). A new engine at an address that never left (a restart between two
      scrapes) is caught by the scrape itself: ``Seats`` and the prefix index forget what the
      old process showed (``extproc.fleet.seats.restarted``).
    """

    def __init__(
        self,
        pool: BackendPool,
        sources: Sequence[DnsBackendSpec],
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
    ) -> None:
        self.pool = pool
        self.sources = tuple(sources)
        self.drain_timeout_s = drain_timeout_s
        self._static = frozenset(pool.by_address)
        self._owner: dict[str, DnsBackendSpec] = {}
        """Address -> the name it came from (a member or draining)."""
        self._resolved: dict[DnsBackendSpec, frozenset[str]] = {s: frozenset() for s in sources}
        self._draining_since: dict[str, float] = {}
        self.resolved_once: set[DnsBackendSpec] = set()
        self.changes: Counter[Change] = Counter()
        """Every change so far, by kind (``fairlane_fleet_changes_total``)."""
        self.failures: Counter[str] = Counter()
        """Failed resolutions per name (``fairlane_dns_failures_total``)."""
        self.failing: set[str] = set()
        """Names whose latest resolution failed (their last known set is in use)."""

    def addresses(self, source: DnsBackendSpec) -> frozenset[str]:
        """The IPs ``source`` resolved to last (empty before its first resolution)."""
        return self._resolved[source]

    @property
    def draining(self) -> int:
        return len(self._draining_since)

    def update(self, source: DnsBackendSpec, ips: Iterable[str], now: float) -> Changes:
        """``source`` now resolves to ``ips``: add the new addresses, drain the vanished."""
        changes = Changes()
        ips = frozenset(ips)
        self.resolved_once.add(source)
        if source.url in self.failing:
            self.failing.discard(source.url)
            log.warning("dns %s resolves again (%d addresses)", source.url, len(ips))
        before = self._resolved[source]
        self._resolved[source] = ips
        wanted = {source.member(ip).address: ip for ip in ips}
        for address, ip in wanted.items():
            self._join(source, address, ip, changes)
        for ip in before - ips:
            address = source.member(ip).address
            backend = self.pool.by_address.get(address)
            if backend is None or self._owner.get(address) is not source:
                continue
            if backend.membership != "draining":
                backend.membership = "draining"
                self._draining_since[address] = now
                changes.draining.append(address)
                log.info(
                    "backend %s %s left %s: draining (%d in flight)",
                    backend.region,
                    address,
                    source.url,
                    backend.fleet_in_flight,
                )
        self._count(changes)
        return changes

    def _join(self, source: DnsBackendSpec, address: str, ip: str, changes: Changes) -> None:
        if address in self._static:
            return  # a fixed backend already: it stays one
        owner = self._owner.get(address)
        if owner is not None and owner is not source:
            return  # another name brought it first
        backend = self.pool.by_address.get(address)
        if backend is None:
            self.pool.add(source.member(ip))
            self._owner[address] = source
            changes.joined.append(address)
            log.info("backend %s %s joined from %s: warming", source.region, address, source.url)
        elif backend.membership == "draining":
            backend.membership = "warming"
            del self._draining_since[address]
            changes.returned.append(address)
            log.info("backend %s %s is back in %s: warming", source.region, address, source.url)

    def failed(self, source: DnsBackendSpec, reason: str) -> None:
        """A resolution of ``source`` failed: keep its last known set, count the failure."""
        self.failures[source.url] += 1
        if source.url not in self.failing:
            self.failing.add(source.url)
            log.warning(
                "dns %s: %s; keeping the last known %d addresses",
                source.url,
                reason,
                len(self._resolved[source]),
            )

    def sweep(self, now: float) -> Changes:
        """Remove the draining backends that have nothing in flight any more (or drained
        longer than ``drain_timeout_s``)."""
        changes = Changes()
        for address, since in list(self._draining_since.items()):
            backend = self.pool.by_address.get(address)
            if backend is None:
                del self._draining_since[address]
                continue
            in_flight = backend.fleet_in_flight
            if in_flight > 0 and now - since < self.drain_timeout_s:
                continue
            self.pool.remove(address)
            del self._draining_since[address]
            self._owner.pop(address, None)
            changes.removed.append(backend)
            log.info(
                "backend %s %s removed after %.1fs of draining%s",
                backend.region,
                address,
                now - since,
                f" ({in_flight} requests still in flight)" if in_flight else "",
            )
        self._count(changes)
        return changes

    def _count(self, changes: Changes) -> None:
        self.changes["joined"] += len(changes.joined)
        self.changes["draining"] += len(changes.draining)
        self.changes["returned"] += len(changes.returned)
        self.changes["removed"] += len(changes.removed)


ChangeListener = Callable[[Changes], None]
"""Called with every non-empty ``Changes`` (the server releases what removed backends held
and tells Envoy the new host set)."""
