"""The fair scheduler: strict priority bands with aging, and VTC fairness between flows in a band.

A **band** is one tier's queue (admission maps tiers to bands when a policy is applied).
Bands go in strict rank order, except that a band's rank improves while its oldest entry
waits, up to a cap (batch may climb to api's rank, never past it). Within a band, flows (a
tenant, or tenant/user) are served by the Virtual Token Counter of Sheng et al., "Fairness in
Serving Large Language Models" (OSDI '24): the backlogged flow with the lowest counter goes
next, and each pop charges it the request's weighted tokens. No counter may fall below the
band's virtual time, so a flow cannot save service up while idle or through a late refund;
and a flow with no debt is forgotten, so memory is bounded by the flows of the current busy
period. Replicas add each other's charges: flows compare by fleet-wide service.

``FairScheduler`` states the rules in full. Plain data, no I/O, time from an injected clock.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BandConfig",
    "DrainMeter",
    "Entry",
    "FairScheduler",
    "FairnessConfig",
    "Head",
    "Lookahead",
    "QueueFull",
]

_COMPACT_SLACK = 64
"""Stale heap items tolerated beyond the live ones before a heap is rebuilt."""


class QueueFull(Exception):
    def __init__(self, tier: str, limit: int, retry_after_s: int) -> None:
        super().__init__(f"queue for tier {tier!r} is full ({limit} waiting)")
        self.tier = tier
        self.limit = limit
        self.retry_after_s = retry_after_s


@dataclass
class DrainMeter:
    """How fast a queue empties: dequeues over a sliding window, for ``retry-after``."""

    window_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _times: deque[float] = field(default_factory=deque)

    def record(self) -> None:
        now = self.clock()
        self._times.append(now)
        self._trim(now)

    def rate(self) -> float:
        """Dequeues per second over the window (0 when nothing left lately)."""
        self._trim(self.clock())
        return len(self._times) / self.window_s

    def _trim(self, now: float) -> None:
        while self._times and self._times[0] < now - self.window_s:
            self._times.popleft()


def _check_non_negative(what: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} must be a finite number >= 0, not {value!r}")


@dataclass(frozen=True, slots=True)
class BandConfig:
    """One tier's band, as the policy configures it."""

    name: str
    rank: int
    """0 = most urgent."""
    queue_limit: int
    aging_rate: float = 0.0
    """Ranks gained per second the band's oldest entry has waited (0 = no aging)."""
    aging_cap: float = 0.0
    """At most this many ranks gained; 0 disables aging whatever the rate."""
    group: str = ""
    """Bands counted together by ``group_depth`` (one tier's bands for several model
    pools); "" : the band's own name."""

    def __post_init__(self) -> None:
        if self.queue_limit < 0:
            raise ValueError(f"band {self.name!r}: queue_limit must be >= 0")
        _check_non_negative(f"band {self.name!r}: aging_rate", self.aging_rate)
        _check_non_negative(f"band {self.name!r}: aging_cap", self.aging_cap)

    def effective_rank(self, waited_s: float) -> float:
        """The band's rank once its oldest entry has waited ``waited_s``."""
        return self.rank - min(self.aging_cap, self.aging_rate * max(0.0, waited_s))


@dataclass(frozen=True, slots=True)
class FairnessConfig:
    """Token weights of the VTC service measure (the paper's 1 and 2)."""

    input_weight: float = 1.0
    output_weight: float = 2.0

    def __post_init__(self) -> None:
        _check_non_negative("input_weight", self.input_weight)
        _check_non_negative("output_weight", self.output_weight)

    def cost(self, input_tokens: int, output_tokens: int, weight: float) -> float:
        """Virtual service of one request to a flow of ``weight``."""
        return (self.input_weight * input_tokens + self.output_weight * output_tokens) / weight


@dataclass(eq=False, slots=True)
class Entry:
    """One waiting request. Compared by identity; ``request_id`` must be unique while queued."""

    request_id: str
    band: str
    flow: str
    """The fairness unit, e.g. ``"tenant"`` or ``"tenant/user"``."""
    weight: float
    """The flow's weight (the tenant's), > 0; a flow with weight 2 gets twice the tokens."""
    input_tokens: int
    output_tokens_estimate: int
    enqueued_at: float
    """On the scheduler's clock. Entries are assumed to be pushed in ``enqueued_at`` order."""
    payload: Any = None
    """The admission layer's own data (future, request class); never looked at here."""
    passed_over: int = 0
    """Later requests of its own flow that ``pop`` took before it (``Lookahead``)."""


@dataclass(frozen=True, slots=True)
class Lookahead:
    """Let ``pop`` take a later request of the chosen flow than its oldest.

    Which of a flow's requests goes first changes nothing between flows: the flow is charged
    whichever it sends. So the admission layer may pick, among the flow's ``size`` oldest,
    the one that suits the room it has (a freed engine that already holds that request's
    prompt prefix). No request is passed over more than ``size`` times: after that it is
    the only choice, so reordering delays a request by at most ``size`` of its flow's
    grants.
    """

    size: int
    choose: Callable[[str, list[Entry]], Entry]
    """(band, the flow's oldest entries, oldest first) -> the one to take."""


@dataclass(frozen=True, slots=True)
class Head:
    """A band's next flow: ``FairScheduler.head``."""

    flow: str
    counter: float
    next_cost: float
    """The charge of the flow's oldest request, the one that would go next."""
    fresh: bool = False
    """The flow arrived (or came back from idle) and has not been served since: its counter
    is the floor the lift rule gave it, not service it received. Replicas let it win ties
    (``extproc.core.peers``)."""


@dataclass(slots=True)
class _Flow:
    counter: float
    queue: OrderedDict[str, int] = field(default_factory=OrderedDict)
    """Request id -> arrival sequence number, oldest first; empty when the flow is idle."""
    version: int = 0
    """Re-stamped on every key change; heap items carrying another stamp are stale. Stamps
    come from the band, never restart per flow: a flow forgotten and re-created must not
    revive the heap items of its former self."""
    fresh: bool = True
    """Not served since it arrived or came back from idle (``Head.fresh``)."""


class _Band:
    """One band's entries, flows and heaps."""

    __slots__ = (
        "backlogged",
        "config",
        "configured",
        "entries",
        "flows",
        "idle",
        "meter",
        "ready",
        "stamp",
        "vtime",
    )

    def __init__(self, config: BandConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.configured = True
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        """Every queued entry in arrival order: the first is the oldest (for aging)."""
        self.flows: dict[str, _Flow] = {}
        self.ready: list[tuple[float, int, int, str]] = []
        """Backlogged flows: (counter, head's sequence number, version, flow); lazy."""
        self.idle: list[tuple[float, int, str]] = []
        """Idle flows still in debt (counter > vtime): (counter, version, flow); lazy."""
        self.backlogged = 0
        self.stamp = 0
        self.vtime = 0.0
        self.meter = DrainMeter(clock=clock)

    def restamp(self, flow: _Flow) -> None:
        self.stamp += 1
        flow.version = self.stamp

    def mark_ready(self, name: str, flow: _Flow) -> None:
        self.restamp(flow)
        head_seq = next(iter(flow.queue.values()))
        heapq.heappush(self.ready, (flow.counter, head_seq, flow.version, name))

    def mark_idle(self, name: str, flow: _Flow) -> None:
        self.restamp(flow)
        heapq.heappush(self.idle, (flow.counter, flow.version, name))

    def peek(self) -> tuple[str, _Flow] | None:
        """The backlogged flow with the lowest counter (earliest head on ties)."""
        ready = self.ready
        while ready:
            _, _, version, name = ready[0]
            flow = self.flows.get(name)
            if flow is not None and flow.queue and flow.version == version:
                return name, flow
            heapq.heappop(ready)
        return None

    def advance(self) -> None:
        """Advance ``vtime``, forget idle flows it has passed, compact the heaps."""
        top = self.peek()
        if top is None:  # drained: the busy period is over, start the next one afresh
            self.flows.clear()
            self.ready.clear()
            self.idle.clear()
            self.backlogged = 0
            self.vtime = 0.0
            return
        self.vtime = max(self.vtime, top[1].counter)
        idle = self.idle
        while idle and idle[0][0] <= self.vtime:
            _, version, name = heapq.heappop(idle)
            flow = self.flows.get(name)
            if flow is not None and not flow.queue and flow.version == version:
                del self.flows[name]
        if len(self.ready) > 2 * self.backlogged + _COMPACT_SLACK:
            self.ready = [
                (f.counter, next(iter(f.queue.values())), f.version, n)
                for n, f in self.flows.items()
                if f.queue
            ]
            heapq.heapify(self.ready)
        if len(idle) > 2 * (len(self.flows) - self.backlogged) + _COMPACT_SLACK:
            self.idle = [(f.counter, f.version, n) for n, f in self.flows.items() if not f.queue]
            heapq.heapify(self.idle)


class FairScheduler:
    """Held requests in priority bands with aging, served fairly by token counters per flow.

    Plain data structure: no I/O, no awaiting, time only from the injected ``clock``.

    Which held request goes next is decided in two steps:

    1. **Band** (one per tier). Bands are served in strict rank order, except that a band's
       *effective* rank improves while its oldest entry waits: ``rank - min(aging_cap, aging_rate *
       age)``. The cap bounds how far a band can climb (e.g. batch up to api's rank), and ties go
       to the lower base rank, so an aged band only overtakes a more urgent one once it is strictly
       better. Aging is judged on the band's oldest entry, which is O(1) to find, so nothing is
       re-sorted as time passes.
    2. **Flow** within the band (a tenant, or tenant/user): each flow has a virtual counter. The
       backlogged flow with the lowest counter is served, ties going to the earliest head, FIFO
       within a flow. On pop the counter is charged ``(input_weight * input + output_weight *
       estimated output) / flow weight``, and ``correct`` settles the output estimate once the real
       count is known.

    Counters are per band: flows in different bands never compete.

    **Virtual time, lift rule, memory.** Each band keeps a virtual time ``vtime``: the lowest
    counter among its backlogged flows. It never decreases during a busy period, because no
    operation may push a backlogged counter below it.

    - A flow with nothing queued that pushes is lifted to ``max(own counter, vtime)``. A flow that
      was idle while others were served therefore cannot claim that time back as a burst of
      consecutive pops. A flow that overspent before going idle keeps its debt.
    - Because of the lift rule, an idle flow whose counter is at or below ``vtime`` carries no
      information, so its state is dropped as soon as ``vtime`` passes it. An idle-flow heap makes
      that amortised O(log n).
    - When a band drains completely, its busy period is over: no one was waiting, so nobody was
      treated unfairly. All its flow state is forgotten and ``vtime`` restarts at 0.
    - The result: per-flow state is bounded by the flows active during the current busy period.
      ``tracked_flows()`` reports it.

    **Replicas.** With replicas sharing state, each replica's scheduler also learns the service its
    flows received elsewhere (``take_ledger`` hands out what this one charged, ``charge_elsewhere``
    adds what the others did), so a tenant spread over three replicas is compared by its fleet-wide
    service.

    **Corrections.** ``correct`` may lower a counter (the request produced less output than
    estimated), but never below ``vtime``. Without that floor, a late refund would put a backlogged
    flow below its peers and give it the burst the lift rule exists to prevent. With it, all
    backlogged counters stay within one charge of each other, which is where VTC's fairness bound
    comes from. A correction arriving while the band is empty is dropped: the busy period whose
    ordering it would have changed is over.

    **Complexity.** ``push``, ``remove`` and ``correct`` are O(log n). ``pop`` is O(bands + log n).
    Lazy deletion keeps stale heap items, and each heap is rebuilt when stale items outnumber live
    ones, so the cost stays amortised O(log n) and the memory bounded; depth counts are always
    exact. (Its cost per operation: docs/benchmarks/internals.md.)
    """

    def __init__(
        self,
        fairness: FairnessConfig = FairnessConfig(),  # frozen: one shared default is safe
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fairness = fairness
        self._clock = clock
        self._bands: dict[str, _Band] = {}
        self._band_of: dict[str, str] = {}
        """Queued request id -> its band: finding one, and counting them, costs no walk of
        the bands (a fleet of many model pools has a band per tier and pool)."""
        self._group_depth: dict[str, int] = {}
        """Queued requests per ``BandConfig.group``, kept as they come and go."""
        self._seq = 0
        self._ledger: dict[tuple[str, str], float] | None = None
        """Charges since ``take_ledger`` (None until a replica first asks: alone, no cost)."""

    # ----------------------------------------------------------------- configuration

    def configure(self, bands: Iterable[BandConfig], fairness: FairnessConfig) -> None:
        """Apply a (re)loaded policy without dropping anything queued.

        Known bands take their new rank, limit and aging. A band that is no longer
        configured keeps its entries, served at the rank it had, refuses new pushes, and
        disappears once it drains. New fairness weights apply to charges from now on.
        """
        configs: dict[str, BandConfig] = {}
        for config in bands:
            if config.name in configs:
                raise ValueError(f"band {config.name!r} configured twice")
            configs[config.name] = config
        for name, band in list(self._bands.items()):
            if name in configs:
                self._count(band, -len(band.entries))  # the group may be another now
                band.config = configs[name]
                self._count(band, len(band.entries))
                band.configured = True
            elif band.entries:
                band.configured = False
            else:
                del self._bands[name]
        for name, config in configs.items():
            if name not in self._bands:
                self._bands[name] = _Band(config, self._clock)
        self._fairness = fairness

    def add_band(self, config: BandConfig) -> None:
        """One more band, the others as they are (a tier's band for another model pool)."""
        if config.name in self._bands:
            raise ValueError(f"band {config.name!r} configured twice")
        self._bands[config.name] = _Band(config, self._clock)

    # ----------------------------------------------------------------- queue operations

    def push(self, entry: Entry) -> None:
        """Queue ``entry``; ``QueueFull`` when its band already holds ``queue_limit``.

        ``KeyError`` for a band that is not configured (the caller classified with a
        policy other than the one this scheduler was configured with); ``ValueError`` for
        a non-positive weight or a request id that is already queued.
        """
        band = self._bands.get(entry.band)
        if band is None or not band.configured:
            raise KeyError(f"no band {entry.band!r} is configured")
        if not (math.isfinite(entry.weight) and entry.weight > 0):
            raise ValueError(f"flow weight must be > 0, not {entry.weight!r}")
        if self.contains(entry.request_id):
            raise ValueError(f"request {entry.request_id!r} is already queued")
        limit = band.config.queue_limit
        if len(band.entries) >= limit:
            raise QueueFull(entry.band, limit, self.retry_after_s(entry.band))
        seq = self._seq
        self._seq += 1
        band.entries[entry.request_id] = entry
        self._count(band, +1)
        self._band_of[entry.request_id] = entry.band
        flow = band.flows.get(entry.flow)
        if flow is None:
            flow = band.flows[entry.flow] = _Flow(band.vtime)
        elif flow.queue:
            flow.queue[entry.request_id] = seq  # head unchanged: its heap key still holds
            return
        else:  # back from idle: lift, so the idle time buys no burst
            flow.counter = max(flow.counter, band.vtime)
            flow.fresh = True
        flow.queue[entry.request_id] = seq
        band.backlogged += 1
        band.mark_ready(entry.flow, flow)
        if band.backlogged == 1:
            band.advance()

    def pop(
        self,
        eligible: Callable[[str], bool] = lambda band: True,
        among: Iterable[str] | None = None,
        lookahead: Lookahead | None = None,
    ) -> Entry | None:
        """The next entry to admit among bands for which ``eligible(name)`` holds (and, when
        given, that are ``among`` these names).

        The band with the best effective rank (ties: lower base rank), then that band's
        backlogged flow with the lowest counter, then that flow's oldest entry, or the one
        ``lookahead`` chooses among its oldest. The flow is charged the entry's estimated
        cost.
        """
        now = self._clock()
        best: _Band | None = None
        best_key: tuple[float, int, str] | None = None
        bands = self._bands
        named = bands.items() if among is None else ((n, bands[n]) for n in among if n in bands)
        for name, band in named:
            if not band.entries:
                continue
            oldest = next(iter(band.entries.values()))
            config = band.config
            key = (config.effective_rank(now - oldest.enqueued_at), config.rank, name)
            if (best_key is None or key < best_key) and eligible(name):
                best, best_key = band, key
        if best is None:
            return None
        top = best.peek()
        assert top is not None, "a band with entries has a backlogged flow"
        name, flow = top
        heapq.heappop(best.ready)
        request_id = self._take(best, flow, lookahead)
        entry = best.entries.pop(request_id)
        self._count(best, -1)
        del self._band_of[request_id]
        cost = self._fairness.cost(entry.input_tokens, entry.output_tokens_estimate, entry.weight)
        flow.counter += cost
        flow.fresh = False
        if self._ledger is not None:
            self._record(entry.band, name, cost)
        if flow.queue:
            best.mark_ready(name, flow)
        else:
            best.backlogged -= 1
            best.mark_idle(name, flow)
        best.meter.record()
        self._advance(entry.band, best)
        return entry

    def _take(self, band: _Band, flow: _Flow, lookahead: Lookahead | None) -> str:
        """The id of the entry ``pop`` takes from ``flow``, out of its queue: the oldest,
        unless ``lookahead`` chooses a later one without passing over a request that was
        passed over ``size`` times already."""
        queue = flow.queue
        if lookahead is None or lookahead.size < 2 or len(queue) < 2:
            return queue.popitem(last=False)[0]
        entries = band.entries
        window: list[Entry] = []
        for request_id in queue:
            entry = entries[request_id]
            window.append(entry)
            if len(window) == lookahead.size or entry.passed_over >= lookahead.size:
                break  # nothing may pass over a request that was passed over enough
        chosen = lookahead.choose(window[0].band, window) if len(window) > 1 else window[0]
        if chosen is window[0]:
            return queue.popitem(last=False)[0]
        for entry in window:
            if entry is chosen:
                break
            entry.passed_over += 1
        del queue[chosen.request_id]
        return chosen.request_id

    def remove(self, entry: Entry) -> bool:
        """Take ``entry`` out (client gone, deadline passed); False if it was not queued."""
        band = self._bands.get(entry.band)
        if band is None or band.entries.get(entry.request_id) is not entry:
            return False
        del band.entries[entry.request_id]
        self._count(band, -1)
        del self._band_of[entry.request_id]
        flow = band.flows[entry.flow]
        was_head = next(iter(flow.queue)) == entry.request_id
        del flow.queue[entry.request_id]
        if not flow.queue:
            band.backlogged -= 1
            band.mark_idle(entry.flow, flow)
        elif was_head:
            band.mark_ready(entry.flow, flow)
        self._advance(entry.band, band)
        return True

    def correct(
        self, flow: str, band: str, estimated_output: int, actual_output: int, weight: float
    ) -> None:
        """Settle a finished request's output estimate on its flow's counter.

        Adds ``output_weight * (actual - estimated) / weight``. A refund never takes the
        counter below the band's ``vtime`` (see the class docstring). A flow that is no
        longer tracked counts as being at ``vtime``. Ignored while the band is empty.
        """
        if not (math.isfinite(weight) and weight > 0):
            return
        delta = self._fairness.output_weight * (actual_output - estimated_output) / weight
        self._adjust(flow, band, delta)
        if delta:
            self._record(band, flow, delta)  # the other replicas may hold the flow's band

    def charge_elsewhere(self, flow: str, band: str, cost: float) -> None:
        """Add service the flow received from another replica (its counter units, already
        divided by the flow's weight), so VTC compares flows over the whole fleet's service.

        The same rules as ``correct``: ignored while the band is empty here (no one here
        waits to be treated unfairly), never below ``vtime``; an untracked flow is tracked
        at ``vtime`` plus the charge, so a tenant served on other replicas meets its debt
        when it arrives here too.
        """
        self._adjust(flow, band, cost)

    def take_ledger(self) -> dict[tuple[str, str], float]:
        """What this scheduler charged each (band, flow) since the last call, for the other
        replicas' ``charge_elsewhere``; starts recording on the first call."""
        ledger, self._ledger = self._ledger or {}, {}
        return ledger

    def _record(self, band: str, flow: str, cost: float) -> None:
        ledger = self._ledger
        if ledger is not None:
            key = (band, flow)
            ledger[key] = ledger.get(key, 0.0) + cost

    def _adjust(self, flow: str, band: str, delta: float) -> bool:
        """Move ``flow``'s counter by ``delta`` (floored at ``vtime``); False when ignored."""
        state = self._bands.get(band)
        if state is None or not state.entries or delta == 0 or not math.isfinite(delta):
            return False
        tracked = state.flows.get(flow)
        if tracked is None:
            if delta < 0:
                return False
            tracked = state.flows[flow] = _Flow(state.vtime)
        tracked.counter = max(tracked.counter + delta, state.vtime)
        if tracked.queue:
            state.mark_ready(flow, tracked)
        elif tracked.counter <= state.vtime:
            del state.flows[flow]
        else:
            state.mark_idle(flow, tracked)
        state.advance()
        return True

    # ----------------------------------------------------------------- reading

    def __len__(self) -> int:
        return len(self._band_of)

    def contains(self, request_id: str) -> bool:
        return self.find(request_id) is not None

    def find(self, request_id: str) -> Entry | None:
        """The queued entry for ``request_id``, or None when it is not queued."""
        name = self._band_of.get(request_id)
        return None if name is None else self._bands[name].entries.get(request_id)

    def entries(self) -> list[Entry]:
        """Every queued entry, band by band, oldest first within a band."""
        return [entry for band in self._bands.values() for entry in band.entries.values()]

    def depth(self, band: str) -> int:
        state = self._bands.get(band)
        return len(state.entries) if state else 0

    def group_depth(self, group: str) -> int:
        """Entries in every band of ``group`` (``BandConfig.group``)."""
        return self._group_depth.get(group, 0)

    def _count(self, band: _Band, change: int) -> None:
        group = band.config.group or band.config.name
        self._group_depth[group] = self._group_depth.get(group, 0) + change

    def depths(self) -> dict[str, int]:
        """Entries per band, configured bands included when empty."""
        return {name: len(band.entries) for name, band in self._bands.items()}

    def oldest_wait_s(self, band: str) -> float:
        """How long the band's oldest entry has waited (0 when empty): the starvation gauge."""
        state = self._bands.get(band)
        if state is None or not state.entries:
            return 0.0
        oldest = next(iter(state.entries.values()))
        return max(0.0, self._clock() - oldest.enqueued_at)

    def effective_rank(self, band: str) -> float:
        """The band's rank after aging (its oldest entry's wait); its base rank when empty."""
        state = self._bands.get(band)
        if state is None:
            raise KeyError(band)
        return state.config.effective_rank(self.oldest_wait_s(band))

    def retry_after_s(self, band: str) -> int:
        """Seconds until a full band has likely drained enough to take one more request.

        Depth over the recent drain rate, clamped to 1..300; 30 when nothing left lately.
        """
        state = self._bands.get(band)
        rate = state.meter.rate() if state is not None else 0.0
        if rate <= 0:
            return 30
        return max(1, min(300, math.ceil(self.depth(band) / rate)))

    def head(self, band: str) -> Head | None:
        """Whose turn it is in the band: the backlogged flow with the lowest counter, its
        counter, and what popping it now would charge it (None when nothing waits).
        Replicas compare theirs."""
        top = self._top(band)
        if top is None:
            return None
        name, flow, entry = top
        cost = self._fairness.cost(entry.input_tokens, entry.output_tokens_estimate, entry.weight)
        return Head(name, flow.counter, cost, flow.fresh)

    def head_entry(self, band: str) -> Entry | None:
        """The request ``pop`` would take from ``band`` next (None when nothing waits)."""
        top = self._top(band)
        return top[2] if top is not None else None

    def _top(self, band: str) -> tuple[str, _Flow, Entry] | None:
        state = self._bands.get(band)
        top = state.peek() if state is not None else None
        if top is None or state is None:
            return None
        name, flow = top
        return name, flow, state.entries[next(iter(flow.queue))]

    def raise_floor(self, band: str, floor: float) -> None:
        """Start the band's next busy period at ``floor`` rather than 0, so flows that arrive
        here count from where the other replicas' queues of the band stand (a replica whose
        band drained would otherwise restart every flow at 0, ahead of them all). Only while
        the band is empty here: a busy band's ``vtime`` is its own."""
        state = self._bands.get(band)
        if state is not None and not state.entries and math.isfinite(floor):
            state.vtime = max(state.vtime, floor)

    def counters(self, band: str) -> dict[str, float]:
        """Flow -> virtual counter of every flow the band still tracks."""
        state = self._bands.get(band)
        return {name: flow.counter for name, flow in state.flows.items()} if state else {}

    def tracked_flows(self) -> int:
        """Flow states held over all bands: backlogged flows plus idle flows still in debt."""
        return sum(len(band.flows) for band in self._bands.values())

    # ----------------------------------------------------------------- internals

    def _advance(self, name: str, band: _Band) -> None:
        band.advance()
        if not band.entries and not band.configured:
            del self._bands[name]  # an unconfigured band lives only until it drains
