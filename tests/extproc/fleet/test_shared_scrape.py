"""One scraper per engine among the replicas: who it is, and when another takes over."""

from __future__ import annotations

from collections import Counter

from extproc.fleet.backend import Backend, BackendSpec
from extproc.fleet.shared_scrape import SharedScrape, scraper_of, takeover_s
from extproc.fleet.vllm_metrics import EngineMetrics

ENGINES = [f"10.0.0.{i}:8000" for i in range(1, 41)]


def test_every_replica_names_the_same_scraper_whatever_the_order() -> None:
    replicas = ["r1", "r2", "r3"]
    for engine in ENGINES:
        assert scraper_of(engine, replicas) == scraper_of(engine, list(reversed(replicas)))


def test_engines_spread_over_the_replicas() -> None:
    scrapers = [scraper_of(engine, ["r1", "r2", "r3"]) for engine in ENGINES]
    assert {scrapers.count(r) for r in ("r1", "r2", "r3")} <= set(range(6, 22))


def test_a_replica_leaving_moves_only_its_own_engines() -> None:
    before = {e: scraper_of(e, ["r1", "r2", "r3"]) for e in ENGINES}
    after = {e: scraper_of(e, ["r1", "r3"]) for e in ENGINES}
    moved = {e for e in ENGINES if before[e] != after[e]}
    assert moved == {e for e in ENGINES if before[e] == "r2"}
    assert moved  # r2 scraped some


def test_a_healthy_scraper_is_never_doubled() -> None:
    # A scrape reaches the others one interval plus a few exchange periods after it is sent.
    assert 0.3 <= takeover_s(0.1, 0.02) < 0.31
    assert takeover_s(0.1, 0.1) >= 0.1 + 5 * 0.1
    assert takeover_s(1.0, 0.02) == 3.0


def _scrape(running: float, waiting: float = 0.0, tokens: float = 0.0) -> SharedScrape:
    return SharedScrape(EngineMetrics(waiting, running, 0.3, tokens / 100, tokens, 0.0), 0.01)


def test_an_adopted_scrape_forgets_only_the_grants_made_before_it_was_taken() -> None:
    backend = Backend(BackendSpec("127.0.0.1", 1))
    for _ in range(2):
        backend.note_grant(kv_tokens=10)
    backend.mark(1.00)  # the engine can have seen these two by a scrape taken after now
    backend.note_grant(kv_tokens=10)
    backend.note_completion()
    backend.mark(1.02)
    backend.note_grant(kv_tokens=10)  # after every mark
    assert backend.adopt_scrape(_scrape(2), taken_at=1.01)
    assert backend.metrics is not None and backend.metrics.scraped_at == 1.01
    # The two marked by 1.00 are in the scrape; the one granted between 1.00 and 1.01 stays
    # counted as unseen (the mark says only "by 1.00"): conservative, never the reverse.
    assert (backend.granted_since_scrape, backend.completed_since_scrape) == (2, 1)
    assert backend.kv_tokens_since_scrape == 20
    assert backend.in_flight == 3


def test_an_adopted_scrape_counts_the_others_leases_from_its_mark() -> None:
    """The others' requests sent after the mark before the scrape was taken are not in it:
    they count as queued in the engine until the next scrape."""
    backend = Backend(BackendSpec("127.0.0.1", 1))
    backend.note_peers(Counter({10: 3}), kv_tokens_total=300)
    backend.mark(1.00)
    backend.note_peers(Counter({10: 5}), kv_tokens_total=500)
    backend.mark(1.02)
    assert backend.adopt_scrape(_scrape(3), taken_at=1.01)
    assert (backend.peer_in_flight_at_scrape, backend.peer_kv_tokens_at_scrape) == (3, 300)
    assert backend.effective_waiting() == 2


def test_a_scrape_older_than_every_mark_forgets_nothing() -> None:
    backend = Backend(BackendSpec("127.0.0.1", 1))
    backend.mark(5.0)
    backend.note_grant()
    assert backend.adopt_scrape(_scrape(1), taken_at=4.0)
    assert backend.granted_since_scrape == 1


def test_only_a_newer_scrape_is_adopted() -> None:
    backend = Backend(BackendSpec("127.0.0.1", 1))
    assert backend.adopt_scrape(_scrape(1, tokens=10), taken_at=2.0)
    assert not backend.adopt_scrape(_scrape(3, tokens=20), taken_at=2.0)
    assert not backend.adopt_scrape(_scrape(3, tokens=20), taken_at=1.5)
    assert backend.metrics is not None and backend.metrics.running == 1
    assert backend.adopt_scrape(_scrape(3, tokens=20), taken_at=2.1)
    assert backend.metrics.running == 3 and backend.itl_s is not None  # an interval of two


def test_the_scrapers_failure_makes_the_engine_unscrapable_here_until_it_reads_again() -> None:
    backend = Backend(BackendSpec("127.0.0.1", 1))
    assert backend.adopt_scrape(_scrape(1), taken_at=1.0)
    failed = SharedScrape(_scrape(1).metrics, 0.5, ok=False)
    assert not backend.adopt_scrape(failed, taken_at=1.0) and not backend.healthy
    assert backend.adopt_scrape(_scrape(2), taken_at=1.5) and backend.healthy


def test_a_seat_count_is_learned_from_adopted_scrapes_as_from_our_own() -> None:
    backend = Backend(BackendSpec("127.0.0.1", 1))
    for i, tokens in enumerate((100, 120, 140)):  # 4 running, 2 waiting, 5 steps apart
        backend.adopt_scrape(_scrape(4, waiting=2, tokens=tokens), taken_at=float(i))
    assert (backend.seats.count, backend.seats.source) == (4, "learned")
