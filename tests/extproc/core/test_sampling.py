"""Placement on a large fleet (``extproc.core.sampling``), through admission: a sample of
candidates, a full band remembered until a completion frees a backend or a refresh passes,
alternates from a spread of the fleet. Small fleets stay exact (the other admission tests)."""

from __future__ import annotations

from extproc.core.sampling import (
    ALTERNATES_SAMPLE,
    FREED_SHARE,
    LARGE_FLEET,
    SAMPLE,
    WINDOW,
    FleetSample,
)
from extproc.fleet.backend import BackendPool, BackendSpec
from tests.extproc.factories import API, BATCH, Request, make_admission

BACKENDS = LARGE_FLEET * 2


def test_a_large_fleet_spreads_grants_over_every_backend_round_robin() -> None:
    admission, _, _ = make_admission(limit=1, backends=BACKENDS)
    used = set()
    for i in range(BACKENDS):
        (grant,) = admission.submit(f"r{i}", Request(API))  # type: ignore[arg-type]
        used.add(grant.endpoints[0])
    assert len(used) == BACKENDS  # one each: the cursor moved on, nothing was refused


def test_a_full_band_waits_for_the_backend_a_completion_frees() -> None:
    admission, _, _ = make_admission(limit=1, backends=BACKENDS)
    for i in range(BACKENDS):
        admission.submit(f"r{i}", Request(BATCH))  # type: ignore[arg-type]
    assert admission.submit("late", Request(BATCH)) == []  # type: ignore[arg-type]
    first = admission.backend_of("r7")
    assert first is not None
    (grant,) = admission.release("r7")  # the freed backend is checked, not the fleet
    assert grant.request_id == "late" and grant.endpoints[0] == first.address


def test_the_sample_stops_at_its_size_and_a_walk_of_nothing_marks_the_band_full() -> None:
    pool = BackendPool([BackendSpec("127.0.0.1", 9000 + i) for i in range(BACKENDS)])
    sample = FleetSample()
    looked: list[int] = []

    def admits(backend: object) -> bool:
        looked.append(1)
        return True

    found = sample.candidates("api", pool.backends, admits, 0.0, 0.1)
    assert len(found) == SAMPLE and len(looked) == SAMPLE
    looked.clear()
    assert sample.candidates("batch", pool.backends, lambda b: False, 0.0, 0.1) == []
    assert sample.candidates("batch", pool.backends, admits, 0.05, 0.1) == []  # remembered
    sample.freed(pool.backends[5])
    assert sample.candidates("batch", pool.backends, admits, 0.06, 0.1) == [pool.backends[5]]
    assert len(sample.candidates("batch", pool.backends, admits, 0.2, 0.1)) == SAMPLE  # refreshed


def test_on_a_nearly_full_fleet_the_walk_settles_for_fewer_past_its_window() -> None:
    # Collecting SAMPLE candidates when a few backends have room would walk most of the
    # fleet on every placement: past WINDOW, the first one that passes is enough.
    pool = BackendPool([BackendSpec("127.0.0.1", 9000 + i) for i in range(BACKENDS)])
    free = {pool.backends[WINDOW + 3], pool.backends[WINDOW + 20]}
    looked: list[object] = []

    def admits(backend: object) -> bool:
        looked.append(backend)
        return backend in free

    found = FleetSample().candidates("batch", pool.backends, admits, 0.0, 1.0)
    assert found == [pool.backends[WINDOW + 3]] and len(looked) == WINDOW + 4
    # Within the window it keeps collecting.
    free = {pool.backends[1], pool.backends[5]}
    looked.clear()
    found = FleetSample().candidates("batch", pool.backends, admits, 0.0, 1.0)
    assert found == [pool.backends[1], pool.backends[5]] and len(looked) == WINDOW


def test_a_freed_backend_found_without_room_again_is_not_looked_at_again() -> None:
    # A deep backlog fills each freed seat at once: the freed backends must not pile up and
    # be checked on every placement until the refresh (O(fleet) per completion again).
    pool = BackendPool([BackendSpec("127.0.0.1", 9000 + i) for i in range(BACKENDS)])
    sample = FleetSample()
    assert sample.candidates("batch", pool.backends, lambda b: False, 0.0, 1.0) == []
    for backend in pool.backends[:40]:
        sample.freed(backend)
    looked: list[object] = []

    def no_room(backend: object) -> bool:
        looked.append(backend)
        return False

    assert sample.candidates("batch", pool.backends, no_room, 0.1, 1.0) == []
    assert len(looked) == 40
    looked.clear()
    sample.freed(pool.backends[3])  # its next completion brings it back
    assert sample.candidates("batch", pool.backends, no_room, 0.2, 1.0) == []
    assert looked == [pool.backends[3]]
    sample.freed(pool.backends[9])
    assert sample.candidates("batch", pool.backends, lambda b: True, 0.3, 1.0) == [pool.backends[9]]


def test_alternates_come_from_a_spread_that_covers_every_region() -> None:
    specs = [
        BackendSpec("127.0.0.1", 9000 + i, region="a" if i < BACKENDS // 2 else "b")
        for i in range(BACKENDS)
    ]
    pool = BackendPool(specs)
    spread = FleetSample().spread(pool.backends)
    assert len(spread) == ALTERNATES_SAMPLE
    assert {b.region for b in spread} == {"a", "b"}


def test_under_a_backlog_the_seat_a_completion_freed_is_found_without_walking_the_fleet() -> None:
    # The fleet is full but for one seat a completion just freed, far from the cursor: the
    # placement checks that backend first and walks no further than its window.
    pool = BackendPool([BackendSpec("127.0.0.1", 9000 + i) for i in range(BACKENDS)])
    sample = FleetSample()
    far = pool.backends[BACKENDS - 3]
    looked: list[object] = []

    def admits(backend: object) -> bool:
        looked.append(backend)
        return backend is far

    assert sample.candidates("batch", pool.backends, lambda b: True, 0.0, 1.0)  # band seen
    sample.freed(far)
    assert sample.candidates("batch", pool.backends, admits, 0.01, 1.0) == [far]
    assert looked[0] is far and len(looked) <= 1 + WINDOW


def test_freed_backends_fill_at_most_their_share_and_the_cursor_offers_the_rest() -> None:
    # Backends that finish nothing (idle ones) must still be offered, or a fleet with room
    # would keep sending to the ones that completed something last.
    pool = BackendPool([BackendSpec("127.0.0.1", 9000 + i) for i in range(BACKENDS)])
    sample = FleetSample()
    assert sample.candidates("api", pool.backends, lambda b: True, 0.0, 1.0)
    freed = pool.backends[-SAMPLE:]
    for backend in freed:
        sample.freed(backend)
    found = sample.candidates("api", pool.backends, lambda b: True, 0.01, 1.0)
    assert len(found) == SAMPLE
    assert found[:FREED_SHARE] == freed[:FREED_SHARE]
    assert not set(found[FREED_SHARE:]) & set(freed)
    # The freed backends offered rotate: the next placement starts with the others.
    again = sample.candidates("api", pool.backends, lambda b: True, 0.02, 1.0)
    assert again[:FREED_SHARE] == freed[FREED_SHARE:]
