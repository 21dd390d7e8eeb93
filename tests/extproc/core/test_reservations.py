import math

import pytest

from extproc.core.reservations import (
    Demand,
    Reservation,
    headroom,
    may_admit,
    reserved_seats,
    reserved_slots,
    seats_for,
    validate_shares,
)

INTERACTIVE, API, BATCH = 0, 1, 2
SHARES = [Reservation("interactive", INTERACTIVE, 0.3), Reservation("api", API, 0.2)]
RESERVED = {INTERACTIVE: 3, API: 2}  # seats held, as in the docstring's worked example


def admit(rank: int, in_flight: dict[int, int], active: set[int], capacity: int = 10) -> bool:
    return may_admit(rank, in_flight, capacity, RESERVED, active)


def fill(rank: int, in_flight: dict[int, int], active: set[int], capacity: int = 10) -> int:
    """Admit ``rank`` until refused; how many it got."""
    taken = 0
    while admit(rank, in_flight, active | {rank}, capacity):
        in_flight[rank] = in_flight.get(rank, 0) + 1
        taken += 1
        assert taken <= capacity
    return taken


def test_the_worked_example_of_the_docstring() -> None:
    in_flight = {INTERACTIVE: 1, API: 0, BATCH: 5}
    everyone = {INTERACTIVE, API, BATCH}
    assert not admit(BATCH, in_flight, everyone)  # owed (3-1) + (2-0) = 4 > 3 free after
    assert admit(BATCH, in_flight, {INTERACTIVE, BATCH})  # api idle: owed 2 <= 3
    assert admit(API, in_flight, everyone)  # owed interactive's 2 <= 3
    assert admit(INTERACTIVE, in_flight, everyone)


def test_work_conserving_batch_fills_the_fleet_when_higher_tiers_are_idle() -> None:
    assert fill(BATCH, {}, set()) == 10
    assert fill(API, {}, set()) == 10


def test_reservations_of_active_tiers_are_honoured() -> None:
    # interactive has one request in flight (active): batch may use all but its 3 - 1 = 2
    # still-owed slots and api's 2 (api queued: active).
    in_flight = {INTERACTIVE: 1}
    assert fill(BATCH, in_flight, {INTERACTIVE, API}) == 10 - 1 - 2 - 2
    assert fill(API, in_flight, {INTERACTIVE, API}) == 2  # its own reserved slots
    assert fill(INTERACTIVE, in_flight, {INTERACTIVE, API}) == 2  # the rest of the fleet
    assert sum(in_flight.values()) == 10


def test_higher_tiers_borrow_lower_tiers_unused_capacity_never_the_reverse() -> None:
    shares = {INTERACTIVE: 2, BATCH: 5}
    active = {INTERACTIVE, BATCH}
    in_flight = {BATCH: 1}  # batch is active but far below its 5 reserved slots
    taken = 0
    while may_admit(INTERACTIVE, in_flight, 10, shares, active):
        in_flight[INTERACTIVE] = in_flight.get(INTERACTIVE, 0) + 1
        taken += 1
    assert taken == 9  # every free slot, batch's reservation included
    in_flight = {INTERACTIVE: 0, BATCH: 0}
    assert [may_admit(BATCH, {BATCH: n}, 10, shares, active) for n in (7, 8)] == [True, False]
    assert not may_admit(BATCH, in_flight | {BATCH: 8}, 10, shares, active)


def test_a_full_fleet_admits_nobody() -> None:
    assert not admit(INTERACTIVE, {BATCH: 10}, {BATCH})
    assert not may_admit(INTERACTIVE, {}, 0, RESERVED, set())


def test_an_urgent_tier_using_more_than_its_share_is_owed_nothing_more() -> None:
    in_flight = {INTERACTIVE: 6}
    assert fill(BATCH, in_flight, {INTERACTIVE}) == 4


def test_shares_round_up_without_floating_point_dust() -> None:
    assert 0.07 * 100 > 7  # the dust the rounding must ignore
    assert reserved_slots(0.07, 100) == 7
    assert reserved_slots(0.3, 10) == 3
    assert reserved_slots(0.25, 10) == 3
    assert reserved_slots(0.0, 10) == 0
    assert reserved_slots(1.0, 7) == 7


def test_validate_shares_names_each_problem() -> None:
    assert validate_shares(SHARES) == []
    assert validate_shares([]) == []
    problems = validate_shares(
        [
            Reservation("interactive", 0, -0.1),
            Reservation("api", 1, 1.5),
            Reservation("batch", 2, float("nan")),
        ]
    )
    assert len(problems) == 4, problems
    assert "'interactive'" in problems[0] and "negative" in problems[0]
    assert "'api'" in problems[1] and "at most 1" in problems[1]
    assert "'batch'" in problems[2] and "number" in problems[2]
    assert "add up to 1.4" in problems[3]
    over = validate_shares([Reservation("a", 0, 0.6), Reservation("b", 1, 0.5)])
    assert len(over) == 1 and "add up to 1.1" in over[0]
    assert validate_shares([Reservation("a", 0, 0.7), Reservation("b", 1, 0.3)]) == []
    twice = validate_shares([Reservation("a", 0, 0.1), Reservation("a", 0, 0.1)])
    assert len(twice) == 1 and "more than once" in twice[0]


def poisson_tail(mean: float, k: int) -> float:
    """P(N >= k) for N ~ Poisson(mean), the slow way."""
    return 1.0 - sum(math.exp(-mean) * mean**i / math.factorial(i) for i in range(k))


@pytest.mark.parametrize("mean", [0.0, 0.05, 0.1, 0.25, 1.0, 4.0, 30.0, 120.0])
def test_seats_for_covers_the_90th_percentile_of_demand_and_no_more(mean: float) -> None:
    seats = seats_for(mean)
    assert seats >= 1
    assert poisson_tail(mean, seats) <= 0.1 + 1e-9  # at most 10% of arrivals find them taken
    if seats > 1:
        assert poisson_tail(mean, seats - 1) > 0.1  # one fewer would not do


def test_seats_for_grows_like_the_square_root_past_its_mean() -> None:
    assert [seats_for(m) for m in (0.1, 1, 4, 100)] == [1, 3, 8, 114]
    huge = seats_for(10_000)  # past exp's range: the normal approximation
    assert 10_100 <= huge <= 10_140


def test_demand_is_a_time_weighted_mean_of_the_count_in_flight() -> None:
    demand = Demand()
    assert demand.mean(INTERACTIVE, 0.0, 10.0) == 0.0
    demand.change(INTERACTIVE, +2, now=0.0, window_s=10.0)
    assert demand.mean(INTERACTIVE, 0.0, 10.0) == 0.0  # nothing held for any time yet
    assert demand.mean(INTERACTIVE, 10.0, 10.0) == pytest.approx(2 * (1 - math.exp(-1)))
    assert demand.mean(INTERACTIVE, 1_000.0, 10.0) == pytest.approx(2.0)
    demand.change(INTERACTIVE, -2, now=1_000.0, window_s=10.0)
    assert demand.mean(INTERACTIVE, 1_010.0, 10.0) == pytest.approx(2 * math.exp(-1))
    assert demand.mean(API, 1_010.0, 10.0) == 0.0  # ranks are apart


def test_the_reserve_follows_demand_up_to_the_tiers_share() -> None:
    demand = Demand()
    windows = {INTERACTIVE: 10.0, API: 10.0}
    assert reserved_seats(SHARES, 100, demand, 0.0, windows) == {INTERACTIVE: 1, API: 1}
    demand.change(INTERACTIVE, +4, now=0.0, window_s=10.0)  # four chats held for long
    assert reserved_seats(SHARES, 100, demand, 1e6, windows)[INTERACTIVE] == seats_for(4.0)
    # on a small fleet the share caps it: 30% of 10 seats
    assert reserved_seats(SHARES, 10, demand, 1e6, windows)[INTERACTIVE] == 3
    no_share = [Reservation("interactive", INTERACTIVE, 0.0)]
    assert reserved_seats(no_share, 100, demand, 1e6, windows) == {}


def test_seats_held_by_cancellable_requests_count_towards_a_reserve() -> None:
    # capacity 8; chat (rank 0) active and owed 2 seats, none in flight; batch holds 6.
    in_flight = {0: 0, 2: 6}
    assert headroom(2, in_flight, 8, {0: 2}, {0}) == 0  # the 2 free seats are chat's
    # 6 of batch's seats can be cancelled for chat: the reserve is covered without idling
    assert headroom(2, in_flight, 8, {0: 2}, {0}, spare=6) == 2
    assert headroom(2, in_flight, 8, {0: 2}, {0}, spare=1) == 1
    # never more than the free seats
    assert headroom(2, {0: 0, 2: 8}, 8, {0: 2}, {0}, spare=8) == 0
