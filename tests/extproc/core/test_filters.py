"""Admission's filters, one at a time, on one backend."""

from __future__ import annotations

import dataclasses

from extproc.core.filters import FILTERS, View, admits, cap, model, seats
from extproc.fleet.backend import Backend, BackendPool, BackendSpec
from extproc.fleet.models import ServedModels
from tests.extproc.factories import FakeClock, scraped

VIEW = View(None, 2, 4, None, False, None, False, None, 1000.0, 1.0)


def backend_with(seats_count: int = 2) -> tuple[BackendPool, Backend]:
    clock = FakeClock()
    pool = BackendPool([BackendSpec("127.0.0.1", 8101, seats=seats_count)], clock=clock)
    (backend,) = pool.backends
    scraped(backend, clock)
    return pool, backend


def test_a_backend_passes_when_every_filter_admits_it() -> None:
    _, backend = backend_with()
    assert admits(backend, VIEW) and all(f(backend, VIEW) for f in FILTERS)


def test_the_cap_the_model_and_the_seats_each_refuse_on_their_own() -> None:
    pool, backend = backend_with(seats_count=1)
    backend.in_flight = 4
    assert not cap.admits(backend, VIEW) and not admits(backend, VIEW)
    backend.in_flight = 1  # its one seat taken
    pool.set_models(backend, ServedModels(frozenset({"llama"})))
    assert not model.admits(backend, dataclasses.replace(VIEW, model="qwen"))
    assert model.admits(backend, dataclasses.replace(VIEW, model="llama"))
    batch = dataclasses.replace(VIEW, seat_bound=True, queue=0)
    assert not seats.admits(backend, batch)  # batch needs a free seat
    assert seats.admits(backend, dataclasses.replace(batch, queue=3))  # may queue 3 deep
