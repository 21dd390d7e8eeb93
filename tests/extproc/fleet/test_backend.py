"""A backend's state without I/O: parsing specs, recording scrapes, grants and seats."""

import dataclasses
import logging
from collections import Counter

import pytest

from extproc.fleet.backend import (
    Backend,
    BackendPool,
    BackendSpec,
    KVEventPorts,
    backend_argument,
    parse_backend,
)
from extproc.fleet.prefix_cache import DEFAULT_BLOCK_SIZE, DEFAULT_CAPACITY_BLOCKS
from extproc.fleet.vllm_metrics import EngineMetrics


def test_parse_backend_with_and_without_region() -> None:
    assert parse_backend("eu=http://10.0.0.5:8000") == BackendSpec("10.0.0.5", 8000, "eu")
    assert parse_backend("127.0.0.1:8101") == BackendSpec("127.0.0.1", 8101, "default")
    assert parse_backend("us=127.0.0.1:1").address == "127.0.0.1:1"


@pytest.mark.parametrize("bad", ["http://vllm.local:8000", "eu=http://10.0.0.5", "ftp://1.2.3.4:5"])
def test_parse_backend_rejects_what_envoy_cannot_route(bad: str) -> None:
    with pytest.raises(ValueError, match="backend"):
        parse_backend(bad)


def test_parse_backend_declares_seats_after_a_hash() -> None:
    assert parse_backend("eu=http://10.0.0.5:8000#seats=16") == BackendSpec(
        "10.0.0.5", 8000, "eu", seats=16
    )
    # no region: the '=' of seats=N is not mistaken for the region's
    assert parse_backend("http://10.0.0.5:8000#seats=4") == BackendSpec(
        "10.0.0.5", 8000, "default", seats=4
    )
    assert parse_backend("10.0.0.5:8000# seats = 2").seats == 2
    assert parse_backend("[::1]:8000#seats=3").address == "[::1]:8000"
    assert parse_backend("eu=http://10.0.0.5:8000").seats is None  # learned from the engine


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("eu=http://10.0.0.5:8000#seats=0", "seats must be a whole number >= 1, got 0"),
        ("eu=http://10.0.0.5:8000#seats=-2", "seats must be a whole number >= 1, got -2"),
        ("eu=http://10.0.0.5:8000#seats=four", "seats must be a whole number >= 1, got 'four'"),
        ("eu=http://10.0.0.5:8000#seats=", "seats must be a whole number >= 1, got ''"),
        ("eu=http://10.0.0.5:8000#seats=2.5", "seats must be a whole number"),
        ("eu=http://10.0.0.5:8000#slots=4", "unknown option 'slots=4' after '#'"),
        ("eu=http://10.0.0.5:8000#", "unknown option '' after '#'"),
        ("eu=http://10.0.0.5:99999", r"expected \[REGION=\]http://IP:PORT\[#seats=N\]"),
        ("eu=http://10.0.0.5:port", "expected"),
    ],
)
def test_parse_backend_says_what_is_wrong_with_a_seat_count(bad: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        parse_backend(bad)
    assert bad in str(caught.value)  # the whole argument is named


def test_regions_keep_their_configured_order() -> None:
    pool = BackendPool([BackendSpec("127.0.0.1", p, r) for p, r in [(1, "b"), (2, "a"), (3, "b")]])
    assert pool.regions == ["b", "a"]


def _metrics(running: float, itl_sum: float, itl_count: float) -> EngineMetrics:
    return EngineMetrics(0.0, running, 0.5, itl_sum, itl_count, 0.0)


def test_a_scrape_forgets_only_the_grants_it_can_have_seen() -> None:
    backend = Backend(BackendSpec("127.0.0.1", 1))
    for _ in range(3):
        backend.note_grant()
    assert (backend.in_flight, backend.granted_since_scrape) == (3, 3)
    backend.record_scrape(_metrics(2, 1.0, 10), granted_before=2)  # 1 granted while in flight
    assert (backend.in_flight, backend.granted_since_scrape) == (3, 1)
    assert backend.effective_waiting() == 1


def test_the_other_replicas_grants_since_the_scrape_count_in_the_engines_queue() -> None:
    """Each replica counts its own grants since a scrape as they happen and the others' as
    their leases grow: without them, N replicas each queued up to the gate's bound in the
    engine between two scrapes."""
    backend = Backend(BackendSpec("127.0.0.1", 1))
    backend.note_peers(Counter({10: 4}))
    backend.record_scrape(EngineMetrics(1.0, 4.0, 0.5, 1.0, 10, 0.0), granted_before=0)
    assert backend.effective_waiting() == 1  # the scrape already shows the others' four
    backend.note_peers(Counter({10: 7}))  # they granted three more since
    backend.note_grant()
    assert backend.effective_waiting() == 5
    assert backend.busy_seats() == 9  # 4 running + 1 waiting + 4 sent since
    backend.note_peers(Counter({10: 2}))  # and five of theirs finished: seats freed
    assert backend.effective_waiting() == 0
    assert backend.busy_seats() == 4  # our 1 and their 2 in flight, but the engine's 4
    backend.record_scrape(EngineMetrics(0.0, 3.0, 0.5, 1.0, 12, 0.0), granted_before=1)
    assert backend.effective_waiting() == 0 and backend.busy_seats() == 3


def test_queue_room_counts_each_unseen_replica_as_granting_what_this_one_does() -> None:
    """Replicas whose demand no report shows yet (``PeerView.unseen``) are counted as
    sending what this one sends: two of them and an idle engine whose gate lets two wait
    leave this replica one, where alone it would take both."""
    backend = Backend(BackendSpec("127.0.0.1", 1))
    backend.record_scrape(EngineMetrics(0.0, 0.0, 0.1, 0.0, 0, 0.0), granted_before=0)
    assert backend.queue_room(2, rank=10, most=16) == 2
    assert backend.queue_room(2, rank=10, most=16, unseen=2) == 1
    assert backend.queue_room(2, rank=10, most=16, unseen=1) == 1  # 1 + 1 of theirs = 2
    backend.note_grant(rank=10)
    assert backend.queue_room(2, rank=10, most=16, unseen=2) == 0  # 1 + 2 x 1 guessed
    assert backend.queue_room(2, rank=10, most=16) == 1
    # net of completions: at a steady rate each grant finds the seat a completion freed
    backend.note_completion(rank=10)
    assert backend.queue_room(2, rank=10, most=16, unseen=2) == 1


def test_a_replica_alone_counts_only_its_own_grants() -> None:
    backend = Backend(BackendSpec("127.0.0.1", 1))
    backend.record_scrape(EngineMetrics(0.0, 1.0, 0.5, 1.0, 10, 0.0), granted_before=0)
    for _ in range(3):
        backend.note_grant()
    assert backend.effective_waiting() == 3  # fill_per_scrape is 1 on an unknown engine


def test_itl_is_the_interval_mean_kept_through_tokenless_intervals_while_busy() -> None:
    backend = Backend(BackendSpec("127.0.0.1", 1))
    backend.record_scrape(_metrics(4, 1.0, 10), 0)
    assert backend.itl_s is None  # one scrape: no interval yet
    backend.record_scrape(_metrics(4, 1.8, 14), 0)
    assert backend.itl_s == pytest.approx(0.2)
    backend.record_scrape(_metrics(4, 1.8, 14), 0)  # a step longer than the interval
    assert backend.itl_s == pytest.approx(0.2)
    backend.record_scrape(_metrics(0, 1.8, 14), 0)  # idle: nothing to protect
    assert backend.itl_s is None


def test_a_page_without_itl_is_logged_once_and_again_when_that_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="fairlane.backends")
    backend = Backend(BackendSpec("127.0.0.1", 8001))
    with_itl = dataclasses.replace(_metrics(4, 1.0, 10), block_size=16, num_gpu_blocks=20)
    without = dataclasses.replace(with_itl, itl_sum_s=None, itl_count=None)
    backend.record_scrape(with_itl, 0)
    assert caplog.messages == []
    for _ in range(5):  # ten scrapes a second: one line, not one per scrape
        backend.record_scrape(without, 0)
    assert caplog.messages == [
        "backend 127.0.0.1:8001: /metrics has no vllm:inter_token_latency_seconds; its "
        "tiers' ITL bounds are off for it, and its seat count is not learned"
    ]
    assert backend.itl_s is None and backend.healthy
    backend.scrape_ok = False  # a failed scrape in between is no change of the page
    backend.record_scrape(without, 0)
    assert len(caplog.messages) == 1
    backend.record_scrape(with_itl, 0)  # a restarted engine exports it again
    backend.record_scrape(with_itl, 0)
    assert caplog.messages[1:] == [
        "backend 127.0.0.1:8001: /metrics has vllm:inter_token_latency_seconds again"
    ]


def test_scrapes_size_the_prefix_model_from_cache_config_info() -> None:
    backend = Backend(BackendSpec("127.0.0.1", 1))
    assert (backend.block_size, backend.prefix_cache.capacity) == (
        DEFAULT_BLOCK_SIZE,
        DEFAULT_CAPACITY_BLOCKS,
    )
    backend.prefix_cache.record(list(range(50)))
    backend.record_scrape(_metrics(0, 0, 0), 0)  # no cache_config_info: defaults stay
    assert len(backend.prefix_cache) == 50
    sized = dataclasses.replace(_metrics(0, 0, 0), block_size=16, num_gpu_blocks=20)
    backend.record_scrape(sized, 0)
    assert backend.prefix_cache.capacity == 20 and len(backend.prefix_cache) == 20
    cpu = dataclasses.replace(sized, block_size=128)  # blocks cut differently: forget all
    backend.record_scrape(cpu, 0)
    assert backend.block_size == 128 and len(backend.prefix_cache) == 0


def test_final_kv_usage_counts_what_requests_in_flight_will_hold_at_their_end() -> None:
    backend = Backend(BackendSpec("127.0.0.1", 1))
    unsized = EngineMetrics(0.0, 2.0, 0.2, 0.0, 0.0, 0.0)
    backend.record_scrape(unsized, 0)
    backend.note_grant(kv_tokens=100, rank=2, committed_tokens=900)
    assert backend.final_kv_usage() == backend.projected_kv_usage() == 0.2  # size unknown
    sized = dataclasses.replace(unsized, block_size=16, num_gpu_blocks=100)
    backend.record_scrape(sized, granted_before=1, kv_tokens_before=100)
    assert backend.projected_kv_usage() == pytest.approx(0.2)  # the scrape saw the grant
    assert backend.final_kv_usage() == pytest.approx(900 / 1600)  # it will grow to 900
    backend.note_grant(kv_tokens=160, rank=0, committed_tokens=200)
    assert backend.final_kv_usage() == pytest.approx(1100 / 1600)
    backend.note_completion(2, committed_tokens=900)
    assert backend.kv_committed_tokens == 200
    # others' requests (another gateway) fill the cache beyond our own commitments
    assert backend.final_kv_usage() == pytest.approx(0.2 + 160 / 1600)


def test_the_other_replicas_kv_since_the_scrape_counts_in_the_projected_use() -> None:
    """Each of N replicas filling the KV gate's headroom between two scrapes would fill it
    N times over: the others' KV grown since the scrape counts as ours does."""
    backend = Backend(BackendSpec("127.0.0.1", 1))
    backend.note_peers(Counter({2: 3}), kv_tokens_total=1000)
    scrape = EngineMetrics(0.0, 3.0, 0.25, 0.0, 0.0, 0.0, block_size=16, num_gpu_blocks=100)
    backend.record_scrape(scrape, granted_before=0)
    assert backend.projected_kv_usage() == pytest.approx(0.25)  # the scrape shows their 1000
    backend.note_peers(Counter({2: 4}), kv_tokens_total=1400)  # one more of theirs since
    backend.note_grant(kv_tokens=160)
    assert backend.projected_kv_usage() == pytest.approx(0.25 + (400 + 160) / 1600)
    backend.note_peers(Counter({2: 4}), kv_tokens_total=0)  # they left: never below the scrape
    assert backend.projected_kv_usage() == pytest.approx(0.25 + 160 / 1600)


def test_parse_backend_names_where_its_key_is_read_from() -> None:
    spec = parse_backend("eu=http://10.0.0.5:8000#key=env:VLLM_API_KEY")
    assert spec == BackendSpec("10.0.0.5", 8000, "eu", credential="env:VLLM_API_KEY")
    both = parse_backend("eu=http://10.0.0.5:8000#seats=8,key=file:/run/secrets/vllm key")
    assert (both.seats, both.credential) == (8, "file:/run/secrets/vllm key")
    assert parse_backend("10.0.0.5:8000#key=env:K, seats=2").seats == 2  # any order
    assert parse_backend("eu=http://10.0.0.5:8000").credential is None


@pytest.mark.parametrize(
    "bad",
    [
        "eu=http://10.0.0.5:8000#key=sk-plaintext-key",  # a key itself, not where it lives
        "eu=http://10.0.0.5:8000#key=env:",
        "eu=http://10.0.0.5:8000#key=vault:secret/x",
        "eu=http://10.0.0.5:8000#key",
    ],
)
def test_parse_backend_refuses_a_key_that_is_not_a_reference(bad: str) -> None:
    with pytest.raises(ValueError, match=r"env:NAME or file:PATH|unknown option") as caught:
        parse_backend(bad)
    assert "sk-plaintext" not in str(caught.value).replace(bad, "")  # only inside the argument


def test_a_spec_refuses_a_plaintext_credential() -> None:
    with pytest.raises(ValueError, match="env:NAME or file:PATH"):
        BackendSpec("10.0.0.5", 8000, credential="sk-plaintext")


def test_kv_event_ports_are_backend_options_and_round_trip() -> None:
    spec = parse_backend("eu=http://10.0.0.1:8000#seats=4,kv-events=5557,kv-replay=5558")
    assert spec.kv_events == KVEventPorts(5557, 5558)
    assert parse_backend(backend_argument(spec)) == spec
    assert parse_backend("http://10.0.0.1:8000#kv-events=5557").kv_events == KVEventPorts(5557)
    assert parse_backend("http://10.0.0.1:8000").kv_events is None
    assert Backend(spec).kv_index is not None
    assert Backend(parse_backend("http://10.0.0.1:8000")).kv_index is None


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("http://10.0.0.1:8000#kv-events=0", "kv-events must be a port"),
        ("http://10.0.0.1:8000#kv-events=x", "kv-events must be a port"),
        ("http://10.0.0.1:8000#kv-replay=5558", "kv-replay needs kv-events"),
    ],
)
def test_bad_kv_event_ports_say_which(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_backend(text)
