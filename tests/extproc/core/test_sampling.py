"""Placement on a large fleet (``extproc.core.sampling``), through admission: a sample of
candidates, a full band remembered until a completion frees a backend or a refresh passes,
alternates from a spread of the fleet. Small fleets stay exact (the other admission tests)."""

from __future__ import annotations

from extproc.core.sampling import ALTERNATES_SAMPLE, LARGE_FLEET, SAMPLE, FleetSample
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


def test_alternates_come_from_a_spread_that_covers_every_region() -> None:
    specs = [
        BackendSpec("127.0.0.1", 9000 + i, region="a" if i < BACKENDS // 2 else "b")
        for i in range(BACKENDS)
    ]
    pool = BackendPool(specs)
    spread = FleetSample().spread(pool.backends)
    assert len(spread) == ALTERNATES_SAMPLE
    assert {b.region for b in spread} == {"a", "b"}
