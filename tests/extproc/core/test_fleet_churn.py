"""Engines that came and went leave nothing behind: admission's per-backend records, its
decision cost and its memory follow the engines in the fleet now, not every engine it ever
had (``Admission.forget_backend``, ``extproc.fleet.membership``)."""

from __future__ import annotations

import gc
import time
import tracemalloc

from extproc.core.admission import Admission
from extproc.fleet.backend import BackendPool, BackendSpec
from extproc.fleet.discovery import DnsBackendSpec
from extproc.fleet.membership import Membership
from tests.extproc.factories import BATCH, INTERACTIVE, FakeClock, Request, policy, scraped

NAME = DnsBackendSpec("vllm", 8000, "r", seats=4)
FLEET = 4
"""Engines in the fleet at any time."""


class Churn:
    """A fleet of ``FLEET`` DNS engines, replaced one by one while requests run on them."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.pool = BackendPool((), self.clock, regions=("r",), dynamic=True)
        self.members = Membership(self.pool, (NAME,))
        self.admission = Admission(self.pool, policy(limit=4))
        self.generation = 0
        self.requests = 0
        self.addresses = [self._address() for _ in range(FLEET)]
        self._resolve()

    def _address(self) -> str:
        self.generation += 1
        n = self.generation
        return f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"

    def _resolve(self) -> None:
        self.members.update(NAME, self.addresses, self.clock())
        for backend in self.pool.backends:  # fresh metrics; the new one starts serving
            scraped(backend, self.clock)
        for removed in self.members.sweep(self.clock()).removed:
            self.admission.forget_backend(removed.address)

    def serve(self, count: int) -> None:
        """``count`` requests granted and finished, some batch ones preemptible."""
        for _ in range(count):
            self.requests += 1
            request_id = f"r{self.requests}"
            tier = BATCH if self.requests % 2 else INTERACTIVE
            request = Request(tier, user=f"u{self.requests % 7}")
            grants = self.admission.submit(request_id, request)  # type: ignore[arg-type]
            assert [g.request_id for g in grants] == [request_id]  # granted at once
            self.admission.cancellable(request_id)
            self.admission.release(request_id, output_tokens=10)

    def replace_one(self) -> None:
        """One engine leaves DNS with a request in flight; a new one joins; the leaver is
        removed once its request finishes."""
        leaving = self.addresses.pop(0)
        backend = self.pool.by_address[f"{leaving}:8000"]
        self.requests += 1
        held = f"r{self.requests}"
        self.admission.submit(held, Request(BATCH))  # type: ignore[arg-type]
        self.addresses.append(self._address())
        self._resolve()
        self.serve(2)
        self.admission.release(held, output_tokens=5)
        self.clock.now += 0.1
        self._resolve()
        assert backend not in self.pool.backends or backend.in_flight


def per_backend_records(admission: Admission) -> set[str]:
    """Every backend address admission keeps something for."""
    addresses = {address for address, _ in admission.picks}
    addresses |= set(admission._preemptible_runs_s)
    return addresses


def decide_us(churn: Churn, rounds: int = 5, count: int = 200) -> float:
    """The cheapest of ``rounds`` runs of ``count`` grant-and-release decisions, per decision."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        churn.serve(count)
        best = min(best, (time.perf_counter() - started) / count)
    return best * 1e6


def test_departed_engines_leave_no_record_and_no_cost() -> None:
    churn = Churn()
    churn.serve(50)
    before_us = decide_us(churn)

    for _ in range(500):
        churn.replace_one()

    live = {b.address for b in churn.pool.backends}
    assert len(live) == FLEET and churn.members.draining == 0
    assert churn.members.changes["removed"] == 500
    assert per_backend_records(churn.admission) <= live
    assert len(churn.admission._in_flight) == 0
    after_us = decide_us(churn)
    print(
        f"\ndecision (grant + release) {before_us:.1f} us before, {after_us:.1f} us after 500 left"
    )
    # 500 departed engines against 4 live ones: anything that still walked them would cost
    # ~100 x; the bound leaves room for a noisy machine.
    assert after_us < 3 * before_us, (before_us, after_us)


def test_memory_does_not_grow_with_departed_engines() -> None:
    churn = Churn()
    for _ in range(200):  # warm up: every lazily grown structure at its steady size
        churn.replace_one()
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.take_snapshot()
        for _ in range(1000):
            churn.replace_one()
        gc.collect()
        grown = sum(
            stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(start, "filename")
        )
    finally:
        tracemalloc.stop()
    print(f"\nheap growth over 1,000 engines replaced: {grown} bytes")
    # A leak of one Backend (its prefix index, seats, counters: kilobytes) per departed
    # engine would be megabytes here.
    assert grown < 64 * 1024, grown


def test_a_static_fleet_is_unaffected() -> None:
    clock = FakeClock()
    pool = BackendPool([BackendSpec("127.0.0.1", 9000, "r", seats=2)], clock)
    scraped(pool.backends[0], clock)
    assert pool.backends[0].membership == "serving" and pool.backends[0].healthy
