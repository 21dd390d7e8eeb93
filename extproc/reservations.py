"""Capacity reservations: slots that less urgent tiers may not take from busy urgent ones.

Gates (``extproc.gates``) keep each engine from backing up; reservations split the fleet's
in-flight slots between tiers so a flood of batch work cannot occupy every slot the moment
interactive traffic needs one. A tier reserves a share of the fleet; the rule is
asymmetric and work-conserving:

- a tier may take any free slot that no *more urgent, active* tier still needs for its
  reservation; so urgent tiers borrow freely from less urgent ones (never the reverse);
- an idle tier (nothing queued, nothing in flight) reserves nothing, so with no interactive
  traffic batch may fill the whole fleet;
- the least urgent tier's share therefore protects nothing; it is accepted (a policy may
  name it for symmetry) but has no effect.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

# ``0.07 * 100`` is ``7.000000000000001``: without the tolerance a 7% share of 100 slots
# would reserve 8.
_EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class Reservation:
    """``share`` (0..1) of the fleet's in-flight slots kept for tier ``tier`` (rank ``rank``,
    lower = more urgent) against less urgent tiers."""

    tier: str
    rank: int
    share: float  # 0..1 of fleet capacity


def reserved_slots(share: float, capacity: int) -> int:
    """``ceil(share * capacity)``, ignoring floating-point dust."""
    return max(0, math.ceil(share * capacity - _EPSILON))


def may_admit(
    tier_rank: int,
    in_flight_by_rank: Mapping[int, int],
    capacity: int,
    reservations: Sequence[Reservation],
    active_ranks: Collection[int],
) -> bool:
    """Whether one more request of rank ``tier_rank`` may take a fleet slot now.

    Let ``used`` be the sum of ``in_flight_by_rank`` and, for each rank ``h``,
    ``reserved_h = ceil(share_h * capacity)`` (shares of one rank add up). The request may go
    only if, after it takes a slot, the free slots still cover what every more urgent active
    rank is owed::

        capacity - used - 1  >=  sum over active h < tier_rank of max(0, reserved_h - used_h)

    (which includes ``used < capacity``). Reservations of tiers less urgent than
    ``tier_rank`` are not consulted (borrowing), and inactive tiers owe nothing (work
    conserving). The shortfalls add up because shares are disjoint: two urgent tiers owed
    two slots each need four free slots, not two.

    Worked example: capacity 10; interactive (rank 0) reserves 0.3 -> 3 slots, api (rank 1)
    0.2 -> 2 slots. In flight: interactive 1, api 0, batch 5, so 4 slots are free.

    - batch (rank 2), interactive and api both active: after taking one, 3 free; owed
      (3 - 1) + (2 - 0) = 4 > 3 -> refused.
    - batch, the same but api idle (nothing queued or in flight): owed 2 <= 3 -> admitted.
    - api (rank 1), interactive active: owed only interactive's 2 <= 3 -> admitted; api may
      go on until just interactive's 2 slots are free, batch's unreserved room included.
    - interactive (rank 0): owed nothing -> admitted while any slot is free (4 here).
    """
    used = sum(in_flight_by_rank.values())
    free_after = capacity - used - 1
    if free_after < 0:
        return False
    reserved: defaultdict[int, float] = defaultdict(float)
    for reservation in reservations:
        reserved[reservation.rank] += reservation.share
    owed = 0
    for rank, share in reserved.items():
        if rank < tier_rank and rank in active_ranks:
            owed += max(0, reserved_slots(share, capacity) - in_flight_by_rank.get(rank, 0))
    return free_after >= owed


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
