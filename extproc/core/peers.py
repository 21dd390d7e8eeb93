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
- **VTC across replicas.** Each report also carries, per band, the lowest counter among
  its waiting flows (whose turn it is there). Within a band, a replica does not grant while
  another holds a flow with a lower counter, or an equal one that has waited longer: the
  flow the whole fleet owes most goes first, wherever it waits. Without this, a freed seat
  went to the replica whose request had finished, and a replica with nothing in flight
  never saw one: measured, a light tenant's request waited 6.4 s behind a heavy tenant's
  backlog, as under FIFO. Counters are comparable across replicas because every replica
  adds the others' charges (below), and a band that drained on one replica restarts at the
  others' lowest counter (``FairScheduler.raise_floor``), not at 0.
- **Reservation activity.** A tier active on any replica (requests waiting or in flight,
  or one arrived within its ``reserved_idle_s``) keeps its reserve on every replica.
- **Fairness charges.** VTC charges travel separately, as a log of charges
  (``FairScheduler.take_ledger`` / ``charge_elsewhere``).

**Cut off.** A replica that cannot reach Redis schedules alone with a conservative share of
each backend: ``1 / replicas`` of the per-backend cap and of the fleet's seats, replicas
being the number it last saw alive (``PeerView.cut_off``). The engines' own metrics still
show the others' traffic, so gates keep working; the share keeps N replicas from each
filling the fleet's free seats at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["PeerBand", "PeerView", "ReplicaReport"]


@dataclass(frozen=True, slots=True)
class PeerBand:
    """A band's requests waiting on one replica (or summed over several)."""

    waiting: int
    oldest_wait_s: float
    """How long its oldest request had waited when the report was written."""
    head_counter: float | None = None
    """The lowest VTC counter among its waiting flows (``FairScheduler.head_counter``);
    summed over replicas, the lowest of them."""


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
    in_flight_by_backend: Mapping[str, Counter[int]] = field(default_factory=dict)
    in_flight_by_rank: Counter[int] = field(default_factory=Counter)
    waiting: Mapping[str, PeerBand] = field(default_factory=dict)
    idle_s: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def merge(cls, reports: Iterable[ReplicaReport], read_at: float) -> PeerView:
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
                    heads = [h for h in (seen.head_counter, peer.head_counter) if h is not None]
                    peer = PeerBand(
                        seen.waiting + peer.waiting,
                        max(seen.oldest_wait_s, oldest),
                        min(heads) if heads else None,
                    )
                else:
                    peer = PeerBand(peer.waiting, oldest, peer.head_counter)
                waiting[band] = peer
            for tier, seconds in report.idle_s.items():
                idle[tier] = min(idle.get(tier, seconds + report.age_s), seconds + report.age_s)
        return cls(reports, read_at, 1.0, by_backend, by_rank, waiting, idle)

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
