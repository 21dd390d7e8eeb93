"""Following DNS answers: joins warm up, departures drain and are removed, failures keep
the last known set. Pure state: driven directly, no DNS server needed."""

from __future__ import annotations

from extproc.fleet.backend import BackendPool, BackendSpec
from extproc.fleet.discovery import DnsBackendSpec
from extproc.fleet.membership import Membership
from extproc.fleet.vllm_metrics import EngineMetrics

VLLM = DnsBackendSpec("vllm", 8000, "a")
OTHER = DnsBackendSpec("other", 8000, "b")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scrape(
    at: float, running: float = 0, block_size: int = 16, blocks: int = 1000
) -> EngineMetrics:
    return EngineMetrics(0, running, 0.1, 0.0, 0.0, at, block_size, blocks)


def fleet(*static: BackendSpec) -> tuple[BackendPool, Membership, Clock]:
    clock = Clock()
    pool = BackendPool(static, clock, regions=("a", "b"), dynamic=True)
    return pool, Membership(pool, (VLLM, OTHER)), clock


def test_a_new_address_warms_until_its_first_good_scrape() -> None:
    pool, members, clock = fleet()
    changes = members.update(VLLM, {"10.0.0.1", "10.0.0.2"}, clock())
    assert sorted(changes.joined) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    backend = pool.by_address["10.0.0.1:8000"]
    assert backend.membership == "warming" and not backend.healthy
    assert pool.healthy() == []
    backend.record_scrape(scrape(clock()), 0)
    assert backend.membership == "serving" and backend.healthy
    assert pool.healthy() == [backend]
    assert members.changes["joined"] == 2


def test_backends_stay_in_region_order_whenever_they_join() -> None:
    static = BackendSpec("10.9.9.9", 1, "b")
    pool, members, clock = fleet(static)
    members.update(OTHER, {"10.1.0.1"}, clock())
    members.update(VLLM, {"10.0.0.1"}, clock())
    # region a (the local one, named first) leads, though its backend came last
    assert [b.address for b in pool.backends] == ["10.0.0.1:8000", "10.9.9.9:1", "10.1.0.1:8000"]


def test_a_vanished_address_drains_until_its_requests_finish_then_is_removed() -> None:
    pool, members, clock = fleet()
    members.update(VLLM, {"10.0.0.1", "10.0.0.2"}, clock())
    leaving = pool.by_address["10.0.0.2:8000"]
    leaving.record_scrape(scrape(clock()), 0)
    leaving.note_grant(100)
    changes = members.update(VLLM, {"10.0.0.1"}, clock())
    assert changes.draining == ["10.0.0.2:8000"]
    assert leaving.membership == "draining" and not leaving.healthy
    assert leaving in pool.backends  # still there: its request runs
    clock.now += 60
    assert not members.sweep(clock())
    leaving.note_completion()
    changes = members.sweep(clock())
    assert changes.removed == [leaving]
    assert "10.0.0.2:8000" not in pool.by_address and leaving not in pool.backends
    assert members.draining == 0
    assert dict(members.changes) == {"joined": 2, "draining": 1, "returned": 0, "removed": 1}


def test_a_drain_whose_completion_was_lost_ends_at_the_timeout() -> None:
    clock = Clock()
    pool = BackendPool((), clock, regions=("a",), dynamic=True)
    members = Membership(pool, (VLLM,), drain_timeout_s=30)
    members.update(VLLM, {"10.0.0.1"}, clock())
    pool.by_address["10.0.0.1:8000"].note_grant(1)
    members.update(VLLM, set(), clock())
    clock.now += 29
    assert not members.sweep(clock())
    clock.now += 1
    assert [b.address for b in members.sweep(clock()).removed] == ["10.0.0.1:8000"]


def test_an_address_back_while_draining_warms_again_and_after_removal_starts_afresh() -> None:
    pool, members, clock = fleet()
    members.update(VLLM, {"10.0.0.1"}, clock())
    first = pool.by_address["10.0.0.1:8000"]
    first.record_scrape(scrape(clock(), running=3), 0)
    first.prefix_cache.record([1, 2, 3])
    first.note_grant(1)
    members.update(VLLM, set(), clock())
    changes = members.update(VLLM, {"10.0.0.1"}, clock())
    assert changes.returned == ["10.0.0.1:8000"]
    assert first.membership == "warming" and pool.by_address["10.0.0.1:8000"] is first
    first.record_scrape(scrape(clock()), 0)
    assert first.healthy
    # Gone for good this time: removed once drained; when it comes back, it is a new backend.
    first.note_completion()
    members.update(VLLM, set(), clock())
    members.sweep(clock())
    members.update(VLLM, {"10.0.0.1"}, clock())
    again = pool.by_address["10.0.0.1:8000"]
    assert again is not first
    assert again.seats.peak_running == 0 and again.prefix_cache.match([1, 2, 3]) == 0


def test_a_new_engine_at_an_address_that_never_left_forgets_its_prefix_index() -> None:
    pool, members, clock = fleet()
    members.update(VLLM, {"10.0.0.1"}, clock())
    backend = pool.by_address["10.0.0.1:8000"]
    backend.record_scrape(scrape(clock(), blocks=1000), 0)
    backend.prefix_cache.record([1, 2, 3])
    assert backend.prefix_cache.match([1, 2, 3]) == 3
    backend.record_scrape(scrape(clock() + 1, blocks=1000), 0)  # same engine
    assert backend.prefix_cache.match([1, 2, 3]) == 3
    backend.record_scrape(scrape(clock() + 2, blocks=800), 0)  # another KV config: restarted
    assert backend.prefix_cache.match([1, 2, 3]) == 0


def test_a_failed_resolution_keeps_the_last_known_set_and_is_counted() -> None:
    pool, members, clock = fleet()
    members.update(VLLM, {"10.0.0.1", "10.0.0.2"}, clock())
    members.failed(VLLM, "no answer in time")
    members.failed(VLLM, "no answer in time")
    assert members.failures[VLLM.url] == 2 and VLLM.url in members.failing
    assert {b.address for b in pool.backends} == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert all(b.membership == "warming" for b in pool.backends)  # nothing drained
    members.update(VLLM, {"10.0.0.1", "10.0.0.2"}, clock())
    assert VLLM.url not in members.failing and members.failures[VLLM.url] == 2


def test_an_empty_answer_drains_every_address_of_the_name() -> None:
    pool, members, clock = fleet()
    members.update(VLLM, {"10.0.0.1"}, clock())
    members.update(OTHER, {"10.1.0.1"}, clock())
    changes = members.update(VLLM, set(), clock())
    assert changes.draining == ["10.0.0.1:8000"]
    assert pool.by_address["10.1.0.1:8000"].membership == "warming"  # the other name's


def test_a_fixed_backend_or_another_names_address_is_not_taken_over() -> None:
    static = BackendSpec("10.0.0.1", 8000, "a")
    pool, members, clock = fleet(static)
    fixed = pool.by_address[static.address]
    members.update(VLLM, {"10.0.0.1", "10.0.0.2"}, clock())
    members.update(OTHER, {"10.0.0.2"}, clock())  # port 8000 too: the same address
    assert members.changes["joined"] == 1
    members.update(VLLM, set(), clock())
    assert fixed.membership == "serving"  # a fixed backend never drains
    assert pool.by_address["10.0.0.2:8000"].membership == "draining"
