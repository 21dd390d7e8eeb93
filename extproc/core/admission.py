"""When may a held request go, and where: the gate between the queues and the backends.

``submit`` queues a request in the fair scheduler (one band per tier, aging between bands,
VTC between flows inside a band) and immediately dispatches whatever may go, so a request
granted on the spot never needs a hold message. ``dispatch`` runs again whenever a backend
may have gained room: a completion, a scrape showing an engine draining, a recovery, a new
policy. A request leaves its queue for a backend only when the backend passes the tier's
gate (``extproc.core.gates``), the tier's reservation check allows it
(``extproc.core.reservations``: less urgent tiers never take the seats an active more urgent
tier holds), and the backend has a seat for it under the policy's per-backend cap. Which of
the backends that may take it serves it is decided when it is granted
(``extproc.core.picker.choose``). Each grant is in flight until its completion (or
``expire``), carries the vLLM priority and charges its flow; ``Admission`` has the rules.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from extproc.core.affinity import Prompts, most_reused
from extproc.core.bands import band_name, tier_of
from extproc.core.bands import pool_of as band_pool
from extproc.core.budgets import Budgets
from extproc.core.errors import Rejection
from extproc.core.filters import View
from extproc.core.filters import admits as all_filters_admit
from extproc.core.gates import passes
from extproc.core.peers import (
    Deferrals,
    PeerBand,
    PeerView,
    PreemptAsks,
    ReplicaReport,
    most_urgent_elsewhere,
    owed_elsewhere,
    turn,
)
from extproc.core.picker import PickReason, choose
from extproc.core.preemption import LEND_MAX_SEATS, Cancellable
from extproc.core.prefix import EngineHashing, PromptBlocks
from extproc.core.priority import UserOffsets, vllm_priority
from extproc.core.reservations import Demand, Reservation, headroom, reserved_seats
from extproc.core.sampling import LARGE_FLEET, FleetSample
from extproc.core.scheduler import (
    BandConfig,
    Entry,
    FairnessConfig,
    FairScheduler,
    Lookahead,
    QueueFull,
)
from extproc.fleet.backend import Backend, BackendPool

if TYPE_CHECKING:
    from extproc.core.classify import RequestClass
    from extproc.policy import Policy, Tier

log = logging.getLogger("fairlane.admission")

DEMAND_WINDOW_SHARE = 0.25
"""A tier's demand (its mean requests in flight) is averaged over this share of its
``reserved_idle_s``: long enough to smooth Poisson arrivals, short enough that the reserve
follows a change of load within a fraction of the time it is kept."""


@dataclass(frozen=True, slots=True)
class Grant:
    """Permission to send one request upstream."""

    request_id: str
    endpoints: tuple[str, ...]
    priority: int
    queued_s: float
    flow: str
    """The fairness unit charged for it (``Entry.flow``)."""


@dataclass(slots=True)
class InFlight:
    """A granted request until its completion: what to release and what to settle."""

    backend: Backend
    user: tuple[str, str]
    entry: Entry
    rank: int
    admitted_at: float
    grant: Grant
    kv_tokens: int = 0
    """What it was granted to hold in its backend's KV cache at its end
    (``Backend.note_grant``'s ``committed_tokens``)."""
    offset: int = 0
    """Its user's offset from the tier's base priority (``extproc.core.priority``)."""


OUTPUT_SHARE_SMOOTHING = 16
"""A band's share of its output estimate actually generated is a moving average over
about this many completions."""

ROOM_UNBOUNDED = 1 << 30
"""``Placement.room`` of a band that seats do not bound (its gates and the cap do)."""


@dataclass(slots=True)
class Memo:
    """What one dispatch remembers between placements. A grant changes the fleet-wide
    counts (requests in flight, reserves, active tiers) and its own pool's engines only,
    so on a fleet of many pools the other pools' engines are not filtered again."""

    fleet: tuple[Counter[int], dict[int, int], set[int]] | None = None
    """Requests in flight by rank, the reserves and the active ranks; None: to compute."""
    scans: dict[str, dict[tuple[str, View], tuple[Backend, ...]]] = field(default_factory=dict)
    """Per pool, the engines that passed the filters, per band and what they were asked."""

    def changed(self, pool: str) -> None:
        """A grant (or a cancellation) on ``pool``'s engines."""
        self.fleet = None
        self.scans.pop(pool, None)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a band's next request may go now, and as which tier (after aging).

    ``backends`` are the candidates (healthy, gates passed, room left), in configured order;
    the one that serves is chosen per request at the grant.
    """

    backends: list[Backend]
    tier: Tier | None
    rank: int
    room: int = ROOM_UNBOUNDED
    """How many requests of the band could go one after the other: bounded when seats bound
    it (free seats, less the more urgent tiers' reserves) or, with replicas, by the engines'
    queue gates and the cap, for taking turns with the other replicas
    (``extproc.core.peers.turn``)."""


class Admission:
    """The fair scheduler in front of gated, reserved backend slots.

    Synchronous and free of I/O: every call that may let queued requests go (``submit``,
    ``dispatch``, ``release``, ``abandon``, ``configure``, ``expire``) returns the grants it
    made, and the caller (the transport) wakes whoever waits for them. Time is the pool's
    clock, the one that stamps scraped metrics, so gates and queues never disagree on now.

    A request may leave its queue for a backend only when, together:

    - the backend passes the tier's **gate** (``extproc.core.gates``): fresh scraped vLLM
      metrics show a short enough waiting queue (plus our grants it has not yet counted), KV
      cache and inter-token latency within bounds, the gateway's own in-flight count under the
      cap;
    - the tier's **reservation** check passes (``extproc.core.reservations``): less urgent tiers
      never take the seats an active more urgent tier holds, a reserve sized to that tier's
      recent demand, out of the fleet's seats (``extproc.fleet.seats``: learned from the
      engines);
    - the backend has a seat for it: a free one, or for a tier allowed to queue inside vLLM
      (``max_waiting``), a place in its short queue; and it is under the policy's safety cap
      ``max_in_flight_per_backend``. For a tier that keeps seats, a backend with a free seat
      wins over one without, because vLLM never preempts a running request to seat a waiting
      one.

    Which of the backends that may take it serves it is decided per request, when it is granted
    (``extproc.core.picker.choose``): queue depth, KV-cache use, region and the prompt's prefix
    affinity; the chosen backend then records the prompt's block hashes as held there.

    Each grant records the request as in flight until its completion arrives (or, if that event
    is lost, until ``expire`` reclaims it), carries the continuous vLLM priority, and charges
    the flow's virtual counter; the completion corrects the output-token estimate.
    """

    def __init__(self, pool: BackendPool, policy: Policy, rng: random.Random | None = None) -> None:
        self.pool = pool
        self._clock = pool.clock
        self.scheduler = FairScheduler(clock=pool.clock)
        self._rng = rng or random.Random()
        self._in_flight: dict[str, InFlight] = {}
        self._users = UserOffsets()
        self._in_flight_by_rank: Counter[int] = Counter()
        self._demand = Demand()
        self._last_arrival: dict[str, float] = {}
        self.picks: Counter[tuple[str, PickReason]] = Counter()
        self.prefix_index: Counter[tuple[str, str]] = Counter()
        """Grants per backend by which index matched their prefix: ``precise`` (the
        engine's KV events) or ``approximate`` (what was sent there)."""
        self.prefix_tokens: Counter[tuple[str, str]] = Counter()
        """Prompt tokens per backend and index that the index said the chosen engine holds,
        at grant: set against the engine's own ``vllm:prefix_cache_hits_total`` it shows
        whether the index is right (a tokenizer that hashes differently from the engine's
        predicts nearly nothing while the engine still finds the prompts cached)."""
        self.engine: EngineHashing | None = None
        """The engines' tokenizer and hash chain (``fairlane serve --tokenizer``): set, the
        picker matches prompts against what engines with KV events report holding."""
        """Grants per (backend address, reason it was chosen): ``fairlane_picks_total``."""
        self.peers = PeerView()
        """The other replicas' state (``extproc.core.peers``); empty when alone."""
        self._deferrals = Deferrals()
        self.budgets = Budgets()
        """Tenants' and users' token budgets (``extproc.core.budgets``): checked and charged
        at submission, settled at release."""
        self._sample = FleetSample()
        """Placement above ``LARGE_FLEET`` backends (``extproc.core.sampling``)."""
        self._cancellable = Cancellable()
        """In-flight requests the transport can cancel for a more urgent one
        (``extproc.core.preemption``)."""
        self._preempted: list[str] = []
        """Requests cancelled by the latest grants, for the transport to answer."""
        self._asks = PreemptAsks()
        """Cancellations asked of other replicas, and theirs answered (``peers``)."""
        self._preemptible_runs_s: dict[str, float] = {}
        """Per backend, a moving average of how long its preemptible tiers' requests run
        (grant to finish): with its seats, how soon such a seat frees by itself
        (``_worth_preempting``)."""
        self._kv_preempting: dict[str, float] = {}
        """Per band, when a request was cancelled to free KV blocks for it: one at a time,
        until the band's next grant (or ``stale_after_s``: the blocks went elsewhere)."""
        self._pool_bands: set[str] = set()
        """Bands of a tier for one model pool (``extproc.core.bands``), made as requests
        for each pool arrive; kept across reloads."""
        self._prompts = Prompts()
        """Block hashes of queued requests a dispatch scored for a freed engine
        (``extproc.core.affinity``), reused at their grant."""
        self._output_share: dict[str, float] = {}
        """Per band, the share of their output estimate its requests generated, a moving
        average (``_expected_output``): 1 until a completion says otherwise."""
        self.configure(policy)

    def configure(self, policy: Policy) -> list[Grant]:
        """Apply a (re)loaded policy; queued and in-flight requests are kept. Returns the
        grants the new limits allowed at once."""
        self.policy = policy
        self.budgets.configure(policy)
        self.pool.set_loadable({n: a.base for n, a in policy.runtime_adapters.items()})
        self._bands = {
            t.name: BandConfig(t.name, t.rank, t.queue_limit, t.aging_rate, t.aging_cap, t.name)
            for t in policy.tiers
        }
        # Each tier's bands for the model pools seen so far take its new settings too.
        for band in self._pool_bands:
            tier_config = self._bands.get(tier_of(band))
            if tier_config is not None:
                self._bands[band] = dataclasses.replace(tier_config, name=band)
        self._bands_of_pool: dict[str, list[str]] = {}
        """Each model pool's bands (``extproc.core.bands``), most urgent tier first."""
        for band in sorted(self._bands, key=lambda b: self._bands[b].rank):
            self._bands_of_pool.setdefault(band_pool(band), []).append(band)
        self.scheduler.configure(
            self._bands.values(),
            FairnessConfig(policy.fairness.input_weight, policy.fairness.output_weight),
        )
        self._tiers = {t.name: t for t in policy.tiers}
        self._tiers_by_rank = {t.rank: t for t in policy.tiers}
        self._reservations = [
            Reservation(t.name, t.rank, t.reserved_share) for t in policy.tiers if t.reserved_share
        ]
        self._windows = {t.rank: t.reserved_idle_s * DEMAND_WINDOW_SHARE for t in policy.tiers}
        self._refresh_s = policy.backpressure.scrape_interval_s
        self._sample.forget()
        return self.dispatch()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def capacity(self) -> int:
        """The fleet's seats (each healthy backend's learned or declared count, at most
        ``max_in_flight_per_backend``): what reservations are kept out of. A replica cut
        off from the others counts only its share of them."""
        limit = self.policy.max_in_flight_per_backend
        backends = self.pool.backends

        def total() -> int:
            # A count not learned yet is a guess being probed: plan with one seat more, or
            # a reserve could take the whole guessed fleet and stop the probing that would
            # learn the real count (an engine caught idle at every scrape stays at 1).
            return sum(
                min(b.seats.count + (b.seats.source == "fallback"), limit)
                for b in backends
                if b.healthy
            )

        if len(backends) > LARGE_FLEET:
            seats = self._sample.capacity(total, self._clock(), self._refresh_s)
        else:
            seats = total()
        share = self.peers.share
        return seats if share >= 1.0 else max(1, math.floor(seats * share))

    @property
    def backend_limit(self) -> int:
        """The per-backend cap, ``max_in_flight_per_backend``: over all replicas while they
        share state, this replica's share of it while cut off."""
        limit = self.policy.max_in_flight_per_backend
        share = self.peers.share
        return limit if share >= 1.0 else max(1, math.floor(limit * share))

    def fleet_in_flight_by_rank(self) -> Counter[int]:
        """Requests in flight per rank, this replica's and the other replicas' leases."""
        if not self.peers.in_flight_by_rank:
            return self._in_flight_by_rank
        return self._in_flight_by_rank + self.peers.in_flight_by_rank

    def reserved(self, in_flight: Counter[int] | None = None) -> dict[int, int]:
        """Seats each reserving tier (by rank) holds now, sized to its recent demand."""
        if in_flight is None:
            in_flight = self.fleet_in_flight_by_rank()
        present = {
            t.rank: in_flight[t.rank] + self._tier_depth(t.name) + self._peers_waiting(t.name)
            for t in self._tiers.values()
            if t.reserved_share
        }
        return reserved_seats(
            self._reservations, self.capacity, self._demand, self._clock(), self._windows, present
        )

    def in_flight_by_tier(self) -> dict[str, int]:
        counts: Counter[str] = Counter(tier_of(f.entry.band) for f in self._in_flight.values())
        return dict(counts)

    def knows(self, request_id: str) -> bool:
        """Whether ``request_id`` is queued or in flight (ids must be unique to release)."""
        return request_id in self._in_flight or self.scheduler.contains(request_id)

    def grant_of(self, request_id: str) -> Grant | None:
        """The grant of an in-flight request (None while it is queued, or once released)."""
        record = self._in_flight.get(request_id)
        return None if record is None else record.grant

    # ----------------------------------------------------------------- submit

    def submit(self, request_id: str, request: RequestClass) -> list[Grant]:
        """Queue ``request`` and dispatch; 429 (with ``retry-after``) when its tier sheds it.

        Returns every grant the dispatch made: this request's own when it may go at once,
        and any other that time (aging, a reservation lapsing) let go meanwhile.
        """
        tier = request.tier
        now = self._clock()
        fairness = self.policy.fairness
        estimate = request.max_tokens or fairness.default_output_tokens
        # Over its budget, a request is refused before it counts as an arrival or a slot.
        claim = self.budgets.check(request, request.prompt_tokens + estimate, now, self.peers.share)
        self._last_arrival[tier.name] = now
        self._maybe_shed_early(tier)
        flow = request.tenant.name
        if fairness.flow == "user":
            flow = f"{request.tenant.name}/{request.user}"
        band = self._band_for(tier, self.pool.pool_of(request.model))
        entry = Entry(
            request_id=request_id,
            band=band,
            flow=flow,
            weight=request.tenant.weight,
            input_tokens=request.prompt_tokens,
            output_tokens_estimate=estimate,
            enqueued_at=now,
            payload=request,
        )
        peer = self.peers.waiting.get(band)
        if peer is not None and peer.head_counter is not None:
            self.scheduler.raise_floor(band, peer.head_counter)
        try:
            self._check_fleet_queue(tier)
            self.scheduler.push(entry)
        except QueueFull as full:
            raise Rejection(
                429,
                f"the {tier.name!r} queue is full ({full.limit} requests waiting); retry later",
                code="queue_full",
                headers={"retry-after": str(full.retry_after_s)},
                tier=tier.name,
            ) from None
        except KeyError:  # classified under a policy that a reload just replaced
            raise Rejection(
                503,
                f"tier {tier.name!r} was just removed from the policy; retry",
                code="tier_removed",
                headers={"retry-after": "1"},
                tier=tier.name,
            ) from None
        if claim is not None:
            self.budgets.charge(request_id, claim, request.prompt_tokens, estimate, now)
        # A new request frees no room: only its own pool's bands may have news.
        return self.dispatch(pool=band_pool(band))

    def _band_for(self, tier: Tier, pool: str) -> str:
        """The band of ``tier`` for the model pool ``pool``, made on its first request."""
        band = band_name(tier.name, pool)
        if band not in self._bands and tier.name in self._bands:  # else: a tier just removed
            config = dataclasses.replace(self._bands[tier.name], name=band)
            self._bands[band] = config
            self._pool_bands.add(band)
            pool_bands = self._bands_of_pool.setdefault(pool, [])
            pool_bands.append(band)
            pool_bands.sort(key=lambda b: self._bands[b].rank)
            self.scheduler.add_band(config)
        return band

    def _tier_depth(self, tier: str) -> int:
        """Requests of ``tier`` waiting here, in all its bands."""
        return self.scheduler.group_depth(tier)

    def _peers_waiting(self, tier: str) -> int:
        """Requests of ``tier`` waiting on the other replicas, in all its bands."""
        peers = self.peers
        if not peers.waiting:
            return 0
        return sum(peers.waiting_in(band) for band in peers.waiting if tier_of(band) == tier)

    def _fleet_depth(self, tier: Tier) -> int:
        """The tier's waiting requests here and, as of their last report, on every other
        replica: what its ``queue_limit`` and early shedding are about."""
        return self._tier_depth(tier.name) + self._peers_waiting(tier.name)

    def _check_fleet_queue(self, tier: Tier) -> None:
        """``QueueFull`` when the whole fleet's queue of the tier is full (the scheduler's
        own check on push counts this replica alone)."""
        if self._peers_waiting(tier.name) and self._fleet_depth(tier) >= tier.queue_limit:
            raise QueueFull(tier.name, tier.queue_limit, self.scheduler.retry_after_s(tier.name))

    def _maybe_shed_early(self, tier: Tier) -> None:
        """RED-style: past ``early_shed_from`` of a full queue, shed with rising probability."""
        start = tier.early_shed_from
        if start is None or tier.queue_limit == 0:
            return
        fill = self._fleet_depth(tier) / tier.queue_limit
        if fill < start:
            return
        chance = 1.0 if start >= 1.0 else (fill - start) / (1.0 - start)
        if self._rng.random() < chance:
            raise Rejection(
                429,
                f"the {tier.name!r} queue is {fill:.0%} full; shedding early, retry later",
                code="early_shed",
                headers={"retry-after": str(self.scheduler.retry_after_s(tier.name))},
                tier=tier.name,
            )

    # ----------------------------------------------------------------- dispatch

    def dispatch(self, own_seats: int = 0, pool: str | None = None) -> list[Grant]:
        """Grant queued requests, in the scheduler's order, while some backend may take them.

        Run whenever a backend may have gained room: a completion released a slot, a scrape
        showed an engine draining, a backend recovered, the policy changed.

        ``own_seats``: seats this replica's own completion just freed. Only this replica
        knows of them yet, so it refills them without taking turns with the others
        (``extproc.core.peers.turn``), which would leave them idle for a few exchanges;
        room that every replica sees at once (a scrape, a lease that left) is taken in
        turns. Deferring to a replica owed more (more urgent, or owed by VTC or by its
        wait) still applies.

        ``pool``: only that model pool's bands may go (the event touched no other pool's
        engines); on a fleet of many pools that spares a placement per band of every
        other. A full dispatch follows every scrape round, for what time alone changed;
        it lets each pool go in turn, the most urgent first.
        """
        if pool is not None or len(self._bands_of_pool) < 2:
            return self._dispatch(own_seats, pool, Memo())
        # Pools share no engine: each goes in turn, the one with the most urgent waiting
        # band first, so a grant re-places only its own pool's bands, not every pool's.
        memo, grants = Memo(), []
        waiting = [(self._pool_urgency(name), name) for name in self._bands_of_pool]
        for urgency, name in sorted(waiting):
            if urgency[0] < math.inf:
                grants += self._dispatch(own_seats, name, memo)
        removed = [b for b, n in self.scheduler.depths().items() if n and b not in self._bands]
        if removed:  # bands a reload took out, served until they drain
            grants += self._dispatch(own_seats, None, memo, removed)
        return grants

    def _pool_urgency(self, pool: str) -> tuple[float, int]:
        """The most urgent key of the pool's bands that hold requests (``_band_key``)."""
        depth = self.scheduler.depth
        keys = [self._band_key(b) for b in self._bands_of_pool[pool] if depth(b)]
        return min(keys, default=(math.inf, 0))

    def _dispatch(
        self, own_seats: int, pool: str | None, memo: Memo, bands: list[str] | None = None
    ) -> list[Grant]:
        """``dispatch`` over every band, or over ``pool``'s bands, or over ``bands``."""
        placements: dict[str, Placement | None] = {}
        grants: list[Grant] = []
        now = self._clock()
        ahead = most_urgent_elsewhere(self.peers, self._bands, now)
        own = own_seats

        def placement(band: str) -> Placement | None:
            if band not in placements:
                cancelled = len(self._preempted)
                placements[band] = self._place(band, memo)
                if len(self._preempted) != cancelled:  # it freed a seat of its pool
                    memo.changed(band_pool(band))
            return placements[band]

        def eligible(band: str) -> bool:
            where = placement(band)
            if where is None:
                self._deferrals.stop(band)  # no room: a deferral starts afresh with the next
                return False
            elsewhere = (
                (ahead is not None and self._band_key(band) > ahead)
                or owed_elsewhere(self.peers, self.scheduler, band, now)
                or (not own and where.room <= self._turn(band, now))
            )
            if not elsewhere:
                self._deferrals.stop(band)
                return True
            # Leave the room to that replica, for a few exchanges at most (Deferrals).
            return not self._deferrals.still(band, now, self.peers.defer_s)

        def reusing_most(band: str, window: list[Entry]) -> Entry:
            where = placements.get(band)
            model = window[0].payload.model
            same = [e for e in window if e.payload.model == model]  # the engines serve it
            return most_reused(same, where.backends, self._prompt) if where else window[0]

        size = self.policy.routing.prefix_lookahead
        lookahead = Lookahead(size, reusing_most) if size > 1 else None
        among = bands if pool is None else self._bands_of_pool.get(pool, [])
        while len(self.scheduler):
            entry = self.scheduler.pop(eligible=eligible, among=among, lookahead=lookahead)
            if entry is None:
                break
            where = placement(entry.band)
            assert where is not None  # pop only offers eligible bands
            grants.append(self._grant(entry, where))
            own = max(0, own - 1)
            placements.clear()  # the grant changed loads and gates
            memo.changed(band_pool(entry.band))
        return grants

    def _turn(self, band: str, now: float) -> int:
        """Requests on other replicas ahead of this one's for the band's room
        (``peers.turn``)."""
        scheduler = self.scheduler
        return turn(self.peers, band, scheduler.oldest_wait_s(band), now, scheduler.head(band))

    def _band_key(self, band: str) -> tuple[float, int]:
        """A local band's urgency (effective rank after aging, then base rank)."""
        config = self._bands.get(band)
        rank = config.rank if config is not None else len(self._bands)
        return (self.scheduler.effective_rank(band), rank)

    def _acting_tier(self, band: str) -> Tier | None:
        """The tier a band's requests are treated as now: their own, or the more urgent one
        that aging has lifted the band to. An aged batch request then passes api's gate,
        counts against api's reservation and gets api's vLLM priority; otherwise it would
        still wait for an empty engine queue however long it had aged, and starve inside
        vLLM behind every more urgent request."""
        tier = self._tiers.get(tier_of(band))
        if tier is None:
            return None  # a band a reload removed: served with no gate, least urgent
        reached = max(0, math.ceil(self.scheduler.effective_rank(band) - 1e-9))
        if reached >= tier.rank:
            return tier
        return self._tiers_by_rank.get(reached, tier)

    def _active_ranks(self, in_flight: Counter[int]) -> set[int]:
        """Tiers that hold their reservation: requests queued or in flight, or one lately."""
        now, peers = self._clock(), self.peers
        active = {r for r, n in in_flight.items() if n}
        for tier in self._tiers.values():
            recent = now - self._last_arrival.get(tier.name, -math.inf) <= tier.reserved_idle_s
            recent = recent or peers.idle_for_s(tier.name, now) <= tier.reserved_idle_s
            if recent or self._tier_depth(tier.name) or self._peers_waiting(tier.name):
                active.add(tier.rank)
        return active

    def _place(self, band: str, memo: Memo | None = None) -> Placement | None:
        """The backends a request of ``band`` could go to now, or None: whether it may go,
        not where (the grant chooses among them for the request's own prompt). ``memo``:
        what the dispatch it is part of already worked out."""
        tier = self._acting_tier(band)
        rank = tier.rank if tier is not None else len(self._tiers)
        # A tier may queue inside vLLM as deep as its gate lets it wait (batch: not at all,
        # it needs a free seat); beyond that it waits here, where priority is decided. A
        # short queue in the engine keeps its seats busy across the round trip a grant
        # takes (completion to Envoy's access log to the next grant). Only a tier that no
        # more urgent active tier reserves seats against may queue: it would otherwise
        # take the seats that free up before the urgent tier's next request arrives.
        queue = tier.gate.max_waiting if tier is not None else 0
        # Every replica's requests in flight, and the reserves and active tiers they make.
        memo = memo or Memo()
        if memo.fleet is None:
            in_flight = self.fleet_in_flight_by_rank()
            memo.fleet = (in_flight, self.reserved(in_flight), self._active_ranks(in_flight))
        in_flight, reserved, active = memo.fleet
        limit = self.backend_limit
        # Whether seats bound this tier here: it needs a free one (batch), or a more urgent
        # active tier holds a reserve it must leave. Otherwise its gates (the engine's own
        # queue) and the policy's cap bound it, as they would without seats.
        reserved_above = any(r < rank and r in active for r in reserved)
        seat_bound = queue == 0 or reserved_above
        capacity = self.capacity if seat_bound else len(self.pool.backends) * limit
        spare = self._cancellable.spare(rank) if self._cancellable else 0
        admissible = headroom(rank, in_flight, capacity, reserved, active, spare)
        if not admissible:
            return None
        stale = self.policy.backpressure.stale_after_s
        now = self._clock()
        # A queue gate counts the engine's waiting requests this one would wait behind there:
        # those sent with a smaller (or equal) vLLM priority than the band's next request's.
        head = self.scheduler.head_entry(band)
        priority = None
        if tier is not None and tier.gate.max_waiting is not None and head is not None:
            priority = self._vllm_priority(head.payload, tier)
        view = View(
            tier,
            rank,
            limit,
            head.payload.model if head is not None else None,
            seat_bound,
            queue,
            reserved_above,
            priority,
            now,
            stale,
            self.pool.loadable,
        )

        def admits(b: Backend) -> bool:  # every filter (``extproc.core.filters``)
            return all_filters_admit(b, view)

        # Only the engines of the request's model (remembered per model): on a fleet of many
        # pools the others would be scanned, or sampled, for nothing.
        key = (band, view)
        scans = memo.scans.setdefault(band_pool(band), {})
        scanned = scans.get(key)
        if scanned is not None:
            candidates = list(scanned)
        else:
            backends = self.pool.serving(view.model)
            if len(backends) > LARGE_FLEET:  # a sample, and a full fleet remembered
                candidates = self._sample.candidates(band, backends, admits, now, self._refresh_s)
            else:
                candidates = [b for b in backends if admits(b)]
            scans[key] = tuple(candidates)
        # vLLM never preempts a running request to seat a waiting one: a request sent to a
        # full engine waits for someone else's request to finish. For a tier that keeps
        # seats (chat), a free seat anywhere beats a better score on a full engine, the
        # prefix it holds included; other tiers keep their prefix affinity (measured: on
        # shared-prefix, free seats first for every tier cut throughput to 0.8 x
        # least-request's, from 1.5 x).
        if tier is not None and tier.reserved_share:
            seated = [b for b in candidates if b.free_seats() >= 1] or [
                b
                for b in candidates
                if self._can_cancel(b, rank) and self._worth_preempting(b, tier)
            ]
            candidates = seated or candidates
            if not candidates and self._cancellable:
                self._preempt_for_kv(band, tier, rank, now, stale)
        if not candidates:
            return None
        room = ROOM_UNBOUNDED
        if seat_bound and queue is not None:
            # Grants each candidate takes before its seats and the queue allowed are full.
            seats = sum(max(0, math.ceil(b.free_seats() + queue)) for b in candidates)
            room = min(admissible, seats)
        elif queue is not None and self.peers.reports:
            # Bound by the engines' queues (the gate) and the cap: room that every replica
            # sees at once after a scrape, taken in turns like seats (``peers.turn``) while
            # another replica waits in the band, and shared with the replicas whose demand
            # no report shows yet (``peers.unseen``); unbounded when neither binds.
            unseen = self.peers.unseen(self.scheduler.oldest_wait_s(band), now)
            if unseen or self.peers.waiting_in(band):
                room = sum(
                    b.queue_room(queue, rank, limit - b.fleet_in_flight, unseen) for b in candidates
                )
        return Placement(candidates, tier, rank, room)

    def _grant(self, entry: Entry, where: Placement) -> Grant:
        request: RequestClass = entry.payload
        user = (request.tenant.name, request.user)
        offset = self._users.next(user)
        priority = vllm_priority(self._tier_base(request, where.tier), offset)
        prompt = self._prompts.pop(entry.request_id) or self._new_prompt(entry)
        fleet = self.pool.serving(request.model)  # retries and hedges stay with its model
        pick = choose(
            where.backends,
            fleet,
            prompt,
            self.policy.routing,
            self.backend_limit,
            self._sample.spread(fleet) if len(fleet) > LARGE_FLEET else None,
            request.model,
        )
        assert pick is not None  # _place lists healthy candidates only
        backend = pick.chosen
        self._kv_preempting.pop(entry.band, None)
        if backend.free_seats() < 1 and self._worth_preempting(backend, where.tier):
            self._preempt_for(backend, where.rank)
        blocks = prompt.blocks(backend.block_size)
        keys = prompt.keys(backend.block_size) if backend.kv_index is not None else None
        held = backend.precise_prefix(keys) if keys is not None else None
        index = "precise"
        if held is None:
            held, index = backend.prefix_cache.match(blocks), "approximate"
        shared_tokens = held * backend.block_size
        self.prefix_index[(backend.address, index)] += 1
        self.prefix_tokens[(backend.address, index)] += shared_tokens
        if keys is not None and keys.known:
            backend.expect_blocks(keys.known)  # as far as matching read them: see BlockKeys
        backend.prefix_cache.record(blocks)  # kept warm: the fallback when events stop
        self.picks[(backend.address, pick.reason)] += 1
        kv_tokens = max(0, entry.input_tokens - shared_tokens) + self._expected_output(entry)
        backend.note_grant(
            entry.input_tokens + entry.output_tokens_estimate, where.rank, kv_tokens, priority
        )
        self._users.granted(user, offset)
        self._in_flight_by_rank[where.rank] += 1
        now = self._clock()
        self._demand.change(where.rank, +1, now, self._windows.get(where.rank, 0.0))
        grant = Grant(
            entry.request_id,
            tuple(b.address for b in pick.backends),
            priority,
            now - entry.enqueued_at,
            entry.flow,
        )
        self._in_flight[entry.request_id] = InFlight(
            backend, user, entry, where.rank, now, grant, kv_tokens, offset
        )
        return grant

    def _prompt(self, entry: Entry) -> PromptBlocks:
        """``entry``'s prompt blocks, kept until its grant (``extproc.core.affinity``)."""
        return self._prompts.of(entry, self._new_prompt)

    def _new_prompt(self, entry: Entry) -> PromptBlocks:
        request: RequestClass = entry.payload
        return PromptBlocks(request.prompt_text, request.model or "", request.body, self.engine)

    def _vllm_priority(self, request: RequestClass, tier: Tier | None) -> int:
        """The vLLM priority ``request`` would go with now, acting as ``tier`` (its own when
        None): the tier's base plus its user's offset (``extproc.core.priority``)."""
        user = (request.tenant.name, request.user)
        return vllm_priority(self._tier_base(request, tier), self._users.next(user))

    @staticmethod
    def _tier_base(request: RequestClass, tier: Tier | None) -> int:
        """The base vLLM priority of ``tier``, or of ``request``'s own tier when None."""
        return tier.priority if tier is not None else request.tier.priority

    def _expected_output(self, entry: Entry) -> int:
        """The output a request of ``entry``'s band will generate, for the KV it commits:
        its estimate (``max_tokens``, or the policy's default) times the share of their
        estimate the band's requests have been generating. Clients ask for far more
        ``max_tokens`` than they use; summed over the requests on an engine, the average
        share is what their caches grow to."""
        share = self._output_share.get(entry.band, 1.0)
        return math.ceil(entry.output_tokens_estimate * share)

    def _note_output(self, entry: Entry, output_tokens: int) -> None:
        """A request of ``entry``'s band generated ``output_tokens`` of its estimate."""
        estimate = max(1, entry.output_tokens_estimate)
        share = min(1.0, output_tokens / estimate)
        before = self._output_share.get(entry.band, 1.0)
        self._output_share[entry.band] = before + (share - before) / OUTPUT_SHARE_SMOOTHING

    # ----------------------------------------------------------------- preemption

    def cancellable(self, request_id: str) -> None:
        """The transport can cancel this in-flight request (it holds its stream open):
        a more urgent request may take its seat (``extproc.core.preemption``)."""
        record = self._in_flight.get(request_id)
        if record is not None:
            backend = record.backend
            lends = backend.seats.count <= LEND_MAX_SEATS
            self._cancellable.add(backend.address, request_id, record.rank, lends)

    def cancellable_on(self, address: str) -> int:
        """How many requests running on ``address`` can be cancelled now."""
        return self._cancellable.on(address)

    def not_cancellable(self, request_id: str) -> None:
        """Its answer has started (or its stream ended): it runs to the end."""
        self._cancellable.discard(request_id)

    def take_preempted(self) -> list[str]:
        """The requests cancelled since the last call: the transport answers each with
        ``Gateway.preempted``. Their seats are already free here."""
        preempted, self._preempted = self._preempted, []
        return preempted

    def _preempt_for_kv(self, band: str, tier: Tier, rank: int, now: float, stale: float) -> None:
        """No backend passes the gate of ``tier`` (one that keeps seats: chat). Where the
        KV cache is the only bound it fails, cancel a less urgent request: vLLM admits a
        waiting request only into free KV blocks (it evicts running requests for running
        ones only), and batch requests grow into the headroom the KV gate left when they
        went. The next scrape shows the blocks free, and the dispatch that follows it seats
        chat first. One cancellation at a time per band, until the band's next grant: each
        costs a long prompt's prefill again."""
        since = self._kv_preempting.get(band)
        if since is not None and now - since < stale:
            return
        without_kv = dataclasses.replace(tier.gate, max_kv_cache_usage=None)
        limit = self.backend_limit
        for backend in self.pool.backends:
            full = backend.fleet_in_flight >= limit
            if full or not passes(without_kv, backend, now, stale, rank):
                continue
            victim = self._cancellable.victim(backend.address, rank)
            if victim is not None:
                self._kv_preempting[band] = now
                self._cancel(victim)
                return

    def _worth_preempting(self, backend: Backend, tier: Tier | None) -> bool:
        """Whether a request of ``tier`` sent to the full ``backend`` should take a seat by
        cancelling, rather than wait for one to free. On a big engine a batch request
        finishes every step or two, so cancelling would only add a re-sent prefill to every
        step (measured on 256 seats, cancelling always: chat's p90 2.3 x of no flood
        without, 3.0 x with); on 4 seats of long batch requests the next seat is seconds
        away. A full engine of S seats whose preemptible requests run T seconds frees one
        every T / S on average (an average over requests, not the gaps between two
        completions: requests sent together finish together). Cancel when that exceeds
        half the tier's TTFT target (or the tier has none)."""
        if tier is None or tier.slo_ttft_ms is None:
            return True
        runs_s = self._preemptible_runs_s.get(backend.address)
        if runs_s is None:
            return True  # none finished there yet: assume the wait is long
        return runs_s / max(1, backend.seats.count) > tier.slo_ttft_ms / 2000

    def _note_run(self, address: str, ran_s: float) -> None:
        """A preemptible request ran ``ran_s`` on ``address``, to its end."""
        before = self._preemptible_runs_s.get(address)
        average = ran_s if before is None else before + (ran_s - before) / 8
        self._preemptible_runs_s[address] = average

    def _can_cancel(self, backend: Backend, rank: int) -> bool:
        cancellable = self._cancellable
        if cancellable and cancellable.victim(backend.address, rank) is not None:
            return True
        return self._peer_to_ask(backend.address, rank) is not None

    def _peer_to_ask(self, address: str, rank: int) -> str | None:
        """The other replica to ask for a seat on ``address`` (``peers.PreemptAsk``)."""
        if not self.peers.reports:
            return None
        pending = self._asks.pending(address, self._clock(), self.peers.defer_s)
        return self.peers.can_cancel(address, rank, pending)

    def _preempt_for(self, backend: Backend, rank: int) -> None:
        """A request of ``rank`` goes to ``backend``, which has no free seat: cancel the
        newest less urgent request there that can be, so vLLM seats this one at once; if
        only another replica's can be, ask it to (it cancels within an exchange or two)."""
        victim = self._cancellable.victim(backend.address, rank) if self._cancellable else None
        if victim is not None:
            self._cancel(victim)
            return
        replica = self._peer_to_ask(backend.address, rank)
        if replica is not None:
            self._asks.ask(replica, backend.address, rank, self._clock())

    def _cancel(self, victim: str) -> None:
        """Free ``victim``'s seat now; the transport answers it (``take_preempted``)."""
        record = self._free(victim, 0)  # its client got nothing: its flow is charged nothing more
        if record is not None:
            log.debug("preempting %s (%s) on %s", victim, record.entry.band, record.backend.address)
            self._preempted.append(victim)

    # ----------------------------------------------------------------- fleet changes

    def forget_backend(self, address: str) -> list[Grant]:
        """A backend left the fleet (``extproc.fleet.membership``): drop what is kept per
        address, so nothing grows with the engines that came and went; returns the grants
        the smaller fleet allows (none, usually: its capacity is gone)."""
        self._preemptible_runs_s.pop(address, None)
        for key in [k for k in self.picks if k[0] == address]:
            del self.picks[key]
        for counts in (self.prefix_index, self.prefix_tokens):
            for index_key in [k for k in counts if k[0] == address]:
                del counts[index_key]
        self._sample.forget()
        return self.dispatch()

    # ----------------------------------------------------------------- replicas

    def apply_peers(self, view: PeerView) -> list[Grant]:
        """Decide from now on over the other replicas' state too (``extproc.core.peers``);
        returns the grants it allowed (a more urgent band elsewhere went, a lease expired)."""
        now = self._clock()
        before = self.peers.in_flight_by_rank
        for rank in set(before) | set(view.in_flight_by_rank):
            delta = view.in_flight_by_rank[rank] - before[rank]
            if delta:
                self._demand.change(rank, delta, now, self._windows.get(rank, 0.0))
        for backend in self.pool.backends:
            backend.note_peers(
                view.in_flight_by_backend.get(backend.address, Counter()),
                view.kv_tokens.get(backend.address, 0),
            )
        self.peers = view
        self._sample.forget()
        for ask in self._asks.to_answer(view.asks):  # another replica's urgent request
            victim = self._cancellable.victim(ask.backend, ask.rank)
            if victim is not None:
                self._cancel(victim)
        return self.dispatch()

    def report(self, replica: str) -> ReplicaReport:
        """This replica's state for the others: leases, waiting bands, tiers' last arrivals."""
        now = self._clock()
        in_flight = {
            b.address: {r: n for r, n in b.in_flight_by_rank.items() if n}
            for b in self.pool.backends
            if b.in_flight
        }
        scheduler = self.scheduler
        waiting = {}
        for band, depth in scheduler.depths().items():
            head = scheduler.head(band) if depth else None
            if head is not None:
                oldest = scheduler.oldest_wait_s(band)
                waiting[band] = PeerBand(depth, oldest, head.counter, head.flow, head.fresh)
        idle = {tier: now - at for tier, at in self._last_arrival.items()}
        return ReplicaReport(
            replica,
            in_flight,
            waiting,
            idle,
            cancellable=self._cancellable.counts(),
            asks=self._asks.recent(now, self.peers.defer_s),
            kv_tokens={
                b.address: b.kv_tokens_total for b in self.pool.backends if b.kv_tokens_total
            },
        )

    def charge_elsewhere(self, charges: Iterable[tuple[str, str, float]]) -> None:
        """Service that flows received on other replicas: ``(band, flow, cost)`` each."""
        for band, flow, cost in charges:
            self.scheduler.charge_elsewhere(flow, band, cost)

    # ----------------------------------------------------------------- the end of a request

    def abandon(self, request_id: str) -> list[Grant]:
        """The request's client is gone or its deadline passed: take it out of its queue, or
        give its slot back if it was granted in the same instant. Returns the grants that
        freed slot allowed."""
        entry = self.scheduler.find(request_id)
        if entry is not None:
            self.scheduler.remove(entry)
            self.budgets.finish(request_id, self._clock(), served=False)
            return []
        return self.release(request_id)

    def turn_away_waiting(self) -> list[Entry]:
        """Take every queued request out (the service is shutting down) and return them, so
        the transport can answer each with a 503 and ``retry-after``: a client told that by
        a JSON error beats one whose stream is cut when the process exits (Envoy's bare
        500)."""
        entries = self.scheduler.entries()
        now = self._clock()
        for entry in entries:
            self.scheduler.remove(entry)
            self.budgets.finish(entry.request_id, now, served=False)
        return entries

    def release(self, request_id: str, output_tokens: int | None = None) -> list[Grant]:
        """The request finished (or will never reach a backend): free its slot, and return
        the grants the freed slot allowed (none when the request was not in flight).

        ``output_tokens``, when known, settles the flow's charge for the estimate, and the
        budgets' (``extproc.core.budgets``).
        """
        record = self._free(request_id, output_tokens)
        if record is None:
            return []
        if output_tokens is not None:  # it ran to its end
            tier = self._tiers.get(tier_of(record.entry.band))
            if tier is not None and tier.preemptible:
                self._note_run(record.backend.address, self._clock() - record.admitted_at)
        return self.dispatch(own_seats=1, pool=band_pool(record.entry.band))

    def _free(self, request_id: str, output_tokens: int | None) -> InFlight | None:
        """``release`` without the dispatch: what was freed (None when the request was not
        in flight)."""
        self.budgets.finish(request_id, self._clock(), output_tokens)
        record = self._in_flight.pop(request_id, None)
        if record is None:
            return None
        self._cancellable.discard(request_id)
        record.backend.note_completion(record.rank, record.kv_tokens, record.grant.priority)
        self._sample.freed(record.backend)
        self._users.finished(record.user, record.offset)
        self._in_flight_by_rank[record.rank] -= 1
        self._demand.change(record.rank, -1, self._clock(), self._windows.get(record.rank, 0.0))
        if output_tokens is not None:
            entry = record.entry
            self._note_output(entry, output_tokens)
            self.scheduler.correct(
                entry.flow, entry.band, entry.output_tokens_estimate, output_tokens, entry.weight
            )
        return record

    def backend_of(self, request_id: str) -> Backend | None:
        """The backend an in-flight request was sent to first (None when not in flight)."""
        record = self._in_flight.get(request_id)
        return None if record is None else record.backend

    def request_of(self, request_id: str) -> RequestClass | None:
        """The class of an in-flight request (None when it is not in flight)."""
        entry = self.entry_of(request_id)
        if entry is None:
            return None
        request: RequestClass = entry.payload
        return request

    def entry_of(self, request_id: str) -> Entry | None:
        """The queue entry (tier band, flow) of an in-flight request."""
        record = self._in_flight.get(request_id)
        return None if record is None else record.entry

    def expire(self, max_age_s: float) -> list[Grant]:
        """Reclaim slots whose completion never arrived (a lost access-log event); returns
        the grants the reclaimed slots allowed."""
        self.budgets.prune(self._clock())  # periodic: forget users gone quiet
        cutoff = self._clock() - max_age_s
        stale = [rid for rid, f in self._in_flight.items() if f.admitted_at < cutoff]
        grants: list[Grant] = []
        for request_id in stale:
            log.warning(
                "no completion seen for %s after %.0fs; releasing its slot", request_id, max_age_s
            )
            grants.extend(self.release(request_id))
        return grants
