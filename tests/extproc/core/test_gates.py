from collections import Counter

import pytest

from extproc.core.gates import LISTED, passes, unusable_metrics, unusable_since
from extproc.fleet.backend import Backend, BackendSpec
from extproc.fleet.vllm_metrics import EngineMetrics
from extproc.policy.model import DEFAULT_GATES, DEFAULT_STALE_AFTER_S, Gate

NOW = 100.0
STALE = 1.0


def backend(
    waiting: float = 0,
    running: float = 4,
    kv: float = 0.2,
    itl_s: float | None = 0.03,
    age_s: float = 0.05,
    granted: int = 0,
    in_flight: int = 0,
) -> Backend:
    b = Backend(BackendSpec("127.0.0.1", 9000))
    b.metrics = EngineMetrics(waiting, running, kv, 10.0, 100.0, scraped_at=NOW - age_s)
    b.itl_s = itl_s
    b.granted_since_scrape = granted
    b.in_flight = in_flight
    return b


def test_a_quiet_fresh_backend_passes_every_default_gate() -> None:
    for gate in DEFAULT_GATES.values():
        assert passes(gate, backend(), NOW, STALE)


def test_max_waiting_is_a_strict_bound_tng_below_three() -> None:
    gate = Gate(max_waiting=3, max_kv_cache_usage=None)
    assert passes(gate, backend(waiting=2), NOW, STALE)
    assert not passes(gate, backend(waiting=3), NOW, STALE)


def test_max_waiting_zero_means_only_an_empty_queue() -> None:
    gate = Gate(max_waiting=0)
    assert passes(gate, backend(waiting=0), NOW, STALE)
    assert not passes(gate, backend(waiting=1), NOW, STALE)
    assert passes(Gate(max_waiting=None), backend(waiting=50), NOW, STALE)


def test_grants_since_the_scrape_count_as_waiting() -> None:
    gate = Gate(max_waiting=3)
    b = backend(waiting=1)
    assert b.effective_waiting() == 1 and passes(gate, b, NOW, STALE)
    b.note_grant()
    assert (b.in_flight, b.granted_since_scrape, b.effective_waiting()) == (1, 1, 2)
    assert passes(gate, b, NOW, STALE)
    b.note_grant()
    assert not passes(gate, b, NOW, STALE)  # 1 scraped + 2 unscraped grants = 3
    assert not passes(DEFAULT_GATES["batch"], backend(granted=1), NOW, STALE)


def test_kv_cache_usage_bound_is_inclusive() -> None:
    gate = Gate(max_waiting=None, max_kv_cache_usage=0.85)
    assert passes(gate, backend(kv=0.85), NOW, STALE)
    assert not passes(gate, backend(kv=0.86), NOW, STALE)


def test_itl_bound_applies_only_when_itl_is_known() -> None:
    gate = Gate(max_itl_s=0.15)
    assert passes(gate, backend(itl_s=0.15), NOW, STALE)
    assert not passes(gate, backend(itl_s=0.2), NOW, STALE)
    assert passes(gate, backend(itl_s=None), NOW, STALE)
    assert passes(Gate(max_itl_s=None), backend(itl_s=5.0), NOW, STALE)


def test_a_backend_without_the_itl_histogram_is_usable_with_its_itl_bound_off() -> None:
    """Another vLLM version, or a metrics filter, drops the ITL histogram: the backend is
    gated on everything else, and an ITL measured before is not kept as if it still held."""
    gate = Gate(max_waiting=3, max_kv_cache_usage=0.9, max_itl_s=0.1)
    slow = backend(itl_s=0.5)  # 0.5 s a token: the bound holds the tier back
    assert not passes(gate, slow, NOW, STALE)
    slow.record_scrape(EngineMetrics(1, 4, 0.2, None, None, scraped_at=NOW), granted_before=0)
    assert slow.itl_s is None and slow.healthy
    assert passes(gate, slow, NOW, STALE)
    full = Backend(BackendSpec("127.0.0.1", 9001))  # the other bounds still bind
    full.record_scrape(EngineMetrics(3, 4, 0.2, None, None, scraped_at=NOW), granted_before=0)
    assert not passes(gate, full, NOW, STALE)


def test_max_in_flight_caps_the_gateways_own_count() -> None:
    gate = Gate(max_in_flight=2)
    assert passes(gate, backend(in_flight=1), NOW, STALE)
    assert not passes(gate, backend(in_flight=2), NOW, STALE)
    assert not passes(Gate(max_in_flight=0), backend(), NOW, STALE)


def test_stale_unscraped_and_unhealthy_backends_count_as_saturated() -> None:
    gate = Gate(max_waiting=None, max_kv_cache_usage=None)
    assert passes(gate, backend(age_s=STALE), NOW, STALE)
    assert not passes(gate, backend(age_s=STALE + 0.01), NOW, STALE)
    never = Backend(BackendSpec("127.0.0.1", 9001))
    assert never.metrics is None and not passes(gate, never, NOW, STALE)
    down = backend()
    down.healthy = False
    assert not passes(gate, down, NOW, STALE)
    unreadable = backend()
    unreadable.scrape_ok = False  # /health fine, /metrics failing
    assert unreadable.health_ok and not unreadable.healthy
    assert not passes(gate, unreadable, NOW, STALE)
    assert DEFAULT_STALE_AFTER_S >= 0.5  # several missed 100 ms scrapes before saturation


def test_default_tiers_step_down_so_a_lower_tier_never_locks_out_a_higher_one() -> None:
    interactive, api, batch = (DEFAULT_GATES[t] for t in ("interactive", "api", "batch"))
    for lower, higher in ((batch, api), (api, interactive), (batch, interactive)):
        b = backend()
        while passes(lower, b, NOW, STALE):  # the lower tier takes all it may
            b.note_grant()
        assert passes(higher, b, NOW, STALE)
    # no tier is gated on an absolute ITL by default: a normal ITL depends on the engine
    assert all(passes(g, backend(itl_s=0.2), NOW, STALE) for g in (interactive, api, batch))
    assert not passes(batch, backend(kv=0.9), NOW, STALE)
    assert passes(api, backend(kv=0.9), NOW, STALE)
    assert not passes(interactive, backend(kv=0.96), NOW, STALE)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_waiting": -1},
        {"max_kv_cache_usage": 1.5},
        {"max_kv_cache_usage": -0.1},
        {"max_itl_s": 0.0},
        {"max_itl_s": float("nan")},
        {"max_in_flight": -2},
    ],
)
def test_nonsense_bounds_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Gate(**kwargs)  # type: ignore[arg-type]


def test_chat_waits_behind_no_batch_request_in_a_priority_queue() -> None:
    """Three batch requests wait inside vLLM for the step's token budget: with priority
    scheduling chat passes them, so chat's gate does not count them; batch's does."""
    b = backend(waiting=3)
    for _ in range(3):
        b.note_grant(rank=2)
    b.granted_since_scrape = 0  # the scrape (waiting=3) came after those grants
    chat = Gate(max_waiting=3, max_kv_cache_usage=None)
    assert passes(chat, b, NOW, STALE, rank=0)
    assert not passes(chat, b, NOW, STALE)  # without a rank: every waiting request counts
    assert not passes(Gate(max_waiting=0, max_kv_cache_usage=None), b, NOW, STALE, rank=2)
    assert b.waiting_ahead_of(0) == 0 and b.waiting_ahead_of(2) == b.effective_waiting()


def test_a_light_users_first_request_passes_a_power_users_queued_ones() -> None:
    """Same tier: a power user's requests went with priorities 10-15 (its pending count
    added to the tier's base), two of them wait in vLLM. A light user's first request
    (priority 10) runs before them there, so the api gate (at most 2 waiting) lets it
    through; the power user's next (priority 16) waits behind all of them, and so does
    another user's request of priority 10: it arrives after the one already sent with 10."""
    b = backend(waiting=2)
    for priority in range(10, 16):
        b.note_grant(rank=1, priority=priority)
    b.granted_since_scrape = 0
    api = Gate(max_waiting=2, max_kv_cache_usage=None)
    assert passes(api, b, NOW, STALE, rank=1, priority=10)
    assert not passes(api, b, NOW, STALE, rank=1, priority=16)
    assert not passes(api, b, NOW, STALE, rank=1)  # by rank alone: all six are api's
    assert b.waiting_ahead_of(1, 10) == 0 and b.waiting_ahead_of(1, 16) == 2
    assert b.waiting_ahead_of(1, 14) == 1


def test_a_finished_request_leaves_the_priority_count() -> None:
    b = backend(waiting=2)
    b.note_grant(rank=1, priority=12)
    b.note_grant(rank=1, priority=12)
    b.granted_since_scrape = 0
    assert b.waiting_ahead_of(1, 10) == 0
    b.note_completion(1, priority=12)
    assert b.waiting_ahead_of(1, 10) == b.effective_waiting() - 1
    b.note_completion(1, priority=12)
    assert b.in_flight_by_priority == {}  # no key left per priority once unused
    assert b.waiting_ahead_of(1, 10) == b.effective_waiting()


def test_another_replicas_requests_count_by_rank() -> None:
    """Other replicas report their requests in flight by rank only: the same tier's count
    as ahead whatever this request's priority, less urgent tiers' as behind."""
    b = backend(waiting=3)
    b.note_peers(Counter({1: 2, 2: 1}))
    b.peer_in_flight_at_scrape = 3  # the scrape (waiting=3) came after their grants
    assert b.waiting_ahead_of(1, 10) == 2


def test_no_usable_metrics_names_each_backend_and_why() -> None:
    failing = backend()
    failing.scrape_ok, failing.scrape_error = False, "HTTP 404"
    never = Backend(BackendSpec("127.0.0.1", 9001))
    stale = backend(age_s=7.0)
    assert unusable_metrics([failing, never, stale], NOW, STALE) == [
        "127.0.0.1:9000 (scrape failed: HTTP 404)",
        "127.0.0.1:9001 (not scraped yet)",
        "127.0.0.1:9000 (last good scrape 7.0s ago)",
    ]
    failing.scrape_error = None  # unreadable as another replica reports it
    assert unusable_metrics([failing], NOW, STALE) == [
        "127.0.0.1:9000 (scrape failed: metrics unreadable)"
    ]


def test_one_usable_backend_is_enough_whatever_its_load_or_health() -> None:
    never = Backend(BackendSpec("127.0.0.1", 9001))
    busy = backend(waiting=50, kv=1.0)
    busy.healthy = False  # /health failing is another problem, with its own answer
    assert unusable_metrics([never, busy], NOW, STALE) is None


def test_a_large_dead_fleet_is_summed_up_not_listed() -> None:
    fleet = [Backend(BackendSpec("127.0.0.1", 9000 + i)) for i in range(LISTED + 5)]
    problems = unusable_metrics(fleet, NOW, STALE)
    assert problems is not None and len(problems) == LISTED + 1
    assert problems[-1] == "5 more"
    assert unusable_metrics([], NOW, STALE) == [
        "the fleet has no backend (none configured or discovered yet)"
    ]


def test_unusable_since_the_newest_good_scrape_or_the_start() -> None:
    never = Backend(BackendSpec("127.0.0.1", 9001))
    assert unusable_since([never], started_at=50.0) == 50.0
    old, newer = backend(age_s=30.0), backend(age_s=20.0)
    old.scrape_ok = False
    assert unusable_since([old, newer, never], started_at=50.0) == NOW - 20.0
    assert unusable_since([old], started_at=90.0) == 90.0  # scraped before this start
