"""Capacity reservations: seats that less urgent tiers may not take from busy urgent ones.

Gates (``extproc.core.gates``) keep each engine from backing up; reservations split the
fleet's seats (``extproc.fleet.seats``: learned from the engines) between tiers, so a flood of
batch work cannot occupy every seat the moment chat needs one: vLLM never preempts a running
request to seat a waiting one, so chat would wait seconds for a batch request to finish. The
rule is asymmetric and work-conserving: a tier may take any free seat that no more urgent,
active tier still needs (urgent tiers borrow freely from less urgent ones, never the
reverse), and an idle tier reserves nothing. An active tier reserves what its own recent
demand needs (``reserved_seats``): the fewest seats that at most ``MISS`` of its arrivals find
all taken, its requests in flight being about Poisson (M/G/infinity), capped by the tier's
``reserved_share``. A fixed share would idle seats on a big fleet and starve a small one; this
reserve's idle part grows only like the square root of the demand.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

# ``0.07 * 100`` is ``7.000000000000001``: without the tolerance a 7% share of 100 seats
# would reserve 8.
_EPSILON = 1e-9

MISS = 0.1
"""The share of an active tier's arrivals allowed to find every reserved seat taken: the
reserve covers the 90th percentile of the tier's concurrency (p90 TTFT is the target)."""


@dataclass(frozen=True, slots=True)
class Reservation:
    """At most ``share`` (0..1) of the fleet's seats kept for tier ``tier`` (rank ``rank``,
    lower = more urgent) against less urgent tiers, while it is active."""

    tier: str
    rank: int
    share: float  # 0..1 of fleet capacity: the ceiling of the adaptive reserve


def reserved_slots(share: float, capacity: int) -> int:
    """``ceil(share * capacity)``, ignoring floating-point dust."""
    return max(0, math.ceil(share * capacity - _EPSILON))


def seats_for(mean_in_flight: float, miss: float = MISS) -> int:
    """The fewest seats ``r >= 1`` with ``P(N >= r) <= miss`` for ``N ~ Poisson(mean)``.

    Summed term by term (the terms are tiny and exact enough up to a mean of a few hundred;
    beyond ``700`` ``exp(-mean)`` underflows, so a normal approximation takes over).
    """
    mean = max(0.0, mean_in_flight)
    if mean > 700:
        return math.ceil(mean + 1.2816 * math.sqrt(mean) + 0.5)
    term = math.exp(-mean)  # P(N = 0)
    below = 0.0  # P(N < r)
    r = 0
    while True:
        below += term
        r += 1
        if 1.0 - below <= miss + _EPSILON:
            return max(1, r)
        term *= mean / r


class Demand:
    """Each rank's requests in flight, as a time-weighted mean over about ``window_s``.

    The signal is piecewise constant between grants and releases, so the exponential
    average is exact at every change: the old mean decays towards the count held since the
    last change by ``exp(-dt / window)``. O(1) per grant or release, no timers.
    """

    __slots__ = ("_count", "_mean", "_since")

    def __init__(self) -> None:
        self._count: dict[int, int] = {}
        self._mean: dict[int, float] = {}
        self._since: dict[int, float] = {}

    def mean(self, rank: int, now: float, window_s: float) -> float:
        """The rank's time-weighted mean in flight up to ``now``."""
        count = self._count.get(rank, 0)
        mean = self._mean.get(rank, 0.0)
        if window_s <= 0:
            return float(count)
        elapsed = now - self._since.get(rank, now)
        return count + (mean - count) * math.exp(-max(0.0, elapsed) / window_s)

    def change(self, rank: int, delta: int, now: float, window_s: float) -> None:
        """The rank's in-flight count moved by ``delta`` at ``now``."""
        self._mean[rank] = self.mean(rank, now, window_s)
        self._since[rank] = now
        self._count[rank] = self._count.get(rank, 0) + delta


def reserved_seats(
    reservations: Sequence[Reservation],
    capacity: int,
    demand: Demand,
    now: float,
    windows: Mapping[int, float],
    current: Mapping[int, int] | None = None,
) -> dict[int, int]:
    """Seats each reserving rank holds now: its adaptive reserve, capped by its share.

    ``windows`` gives each rank's averaging window; ``current`` each rank's requests in
    flight or queued right now. The reserve follows whichever is larger, the average or
    now: a surge of chat must not wait a whole window for its seats, and a lull keeps them
    for a while.

    How many seats an active tier reserves follows its own recent demand, not a fixed share:
    ``Demand`` keeps the time-weighted mean of the tier's requests in flight; ``a`` is that
    mean, or the tier's requests in flight and queued right now if more (a surge must not wait a
    whole averaging window for its seats), and the reserve is the smallest ``r`` with ``P(N >=
    r) <= MISS`` for ``N ~ Poisson(a)``: the number of the tier's requests in flight that an
    arrival finds is about Poisson for many independent users (M/G/infinity), so at most
    ``MISS`` of arrivals find all reserved seats taken. At least one seat is kept while the tier
    is active, and never more than the tier's ``reserved_share`` of the fleet (the policy's
    ceiling).
    """
    reserved: dict[int, int] = {}
    present = current or {}
    for reservation in reservations:
        cap = reserved_slots(reservation.share, capacity)
        if cap <= 0:
            continue
        mean = demand.mean(reservation.rank, now, windows.get(reservation.rank, 0.0))
        mean = max(mean, float(present.get(reservation.rank, 0)))
        seats = min(cap, seats_for(mean))
        reserved[reservation.rank] = reserved.get(reservation.rank, 0) + seats
    return reserved


def may_admit(
    tier_rank: int,
    in_flight_by_rank: Mapping[int, int],
    capacity: int,
    reserved: Mapping[int, int],
    active_ranks: Collection[int],
) -> bool:
    """Whether one more request of rank ``tier_rank`` may take a fleet seat now.

    Let ``used`` be the sum of ``in_flight_by_rank`` and ``reserved[h]`` the seats rank ``h``
    holds (``reserved_seats``). The request may go only if, after it takes a seat, the free
    seats still cover what every more urgent active rank is owed::

        capacity - used - 1  >=  sum over active h < tier_rank of max(0, reserved_h - used_h)

    (which includes ``used < capacity``). Reservations of tiers less urgent than
    ``tier_rank`` are not consulted (borrowing), and inactive tiers owe nothing (work
    conserving). The shortfalls add up because reserves are disjoint: two urgent tiers owed
    two seats each need four free seats, not two.

    Worked example: capacity 10; interactive (rank 0) holds 3 seats, api (rank 1) 2. In
    flight: interactive 1, api 0, batch 5, so 4 seats are free.

    - batch (rank 2), interactive and api both active: after taking one, 3 free; owed
      (3 - 1) + (2 - 0) = 4 > 3 -> refused.
    - batch, the same but api idle (nothing queued or in flight): owed 2 <= 3 -> admitted.
    - api (rank 1), interactive active: owed only interactive's 2 <= 3 -> admitted; api may
      go on until just interactive's 2 seats are free, batch's unreserved room included.
    - interactive (rank 0): owed nothing -> admitted while any seat is free (4 here).
    """
    return headroom(tier_rank, in_flight_by_rank, capacity, reserved, active_ranks) >= 1


def headroom(
    tier_rank: int,
    in_flight_by_rank: Mapping[int, int],
    capacity: int,
    reserved: Mapping[int, int],
    active_ranks: Collection[int],
    spare: int = 0,
) -> int:
    """How many more requests of rank ``tier_rank`` may take fleet seats now, one after the
    other (``may_admit`` is ``headroom >= 1``): the free seats less what every more urgent
    active rank is still owed.

    ``spare``: seats held by requests of ``tier_rank`` or less urgent that the gateway can
    cancel for a more urgent one (``extproc.core.preemption``). They count towards what is
    owed, as free seats would: an urgent request gets such a seat at once. So a flood of
    cancellable batch fills the seats chat's reserve would otherwise keep idle, and batch
    that cannot be cancelled (streamed) still leaves them."""
    free = capacity - sum(in_flight_by_rank.values())
    owed = 0
    for rank, seats in reserved.items():
        if rank < tier_rank and rank in active_ranks:
            owed += max(0, seats - in_flight_by_rank.get(rank, 0))
    return max(0, min(free, free + spare - owed))


def validate_shares(reservations: Sequence[Reservation]) -> list[str]:
    """What is wrong with these shares, one message each (empty when they are usable)."""
    problems: list[str] = []
    seen: set[str] = set()
    for reservation in reservations:
        name, share = reservation.tier, reservation.share
        if name in seen:
            problems.append(f"tier {name!r}: reserved share given more than once")
        seen.add(name)
        if not math.isfinite(share):
            problems.append(f"tier {name!r}: reserved share must be a number, got {share}")
        elif share < 0:
            problems.append(f"tier {name!r}: reserved share must not be negative, got {share}")
        elif share > 1:
            problems.append(
                f"tier {name!r}: reserved share must be at most 1 (the whole fleet), got {share}"
            )
    total = sum(r.share for r in reservations if math.isfinite(r.share))
    if total > 1 + _EPSILON:
        problems.append(
            f"reserved shares add up to {total:g}, more than the whole fleet (at most 1)"
        )
    return problems
