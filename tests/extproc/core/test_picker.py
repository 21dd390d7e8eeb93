"""Endpoint picking: each scorer moves the choice; alternates; sticky-until-saturated."""

from extproc.core.picker import Pick, choose, pick
from extproc.core.prefix import PromptBlocks
from extproc.fleet.backend import COOL_OFF_S, FAILURES_TO_COOL_OFF, Backend, BackendSpec
from extproc.policy import Routing
from tests.extproc.factories import FakeClock, scraped

ROUTING = Routing(sticky_margin=0.25)  # queue 1, kv 1, prefix 2, region 0.5
SLOTS = 4
SYSTEM = "You are the support assistant of ACME. Answer briefly and politely. " * 30


def fleet(*loads: tuple[str, int, bool]) -> list[Backend]:
    backends = []
    for i, (region, in_flight, healthy) in enumerate(loads):
        backend = Backend(BackendSpec("127.0.0.1", 9000 + i, region, seats=SLOTS))
        backend.in_flight = in_flight
        backend.healthy = healthy
        scraped(backend, FakeClock())
        backends.append(backend)
    return backends


def test_a_backend_never_scraped_is_no_alternate() -> None:
    backends = fleet(("a", 0, True), ("b", 0, True))
    unscraped = Backend(BackendSpec("127.0.0.1", 9100, "c"))
    chosen = pick(backends[:1], [*backends, unscraped])
    assert chosen is not None and unscraped not in chosen


def scraped_fleet(*regions: str, clock: FakeClock | None = None) -> list[Backend]:
    """Idle, freshly scraped backends (KV 10%), one per region named."""
    clock = clock or FakeClock()
    backends = []
    for i, region in enumerate(regions):
        backend = Backend(BackendSpec("127.0.0.1", 9000 + i, region, seats=SLOTS), clock)
        scraped(backend, clock)
        backends.append(backend)
    return backends


def ports(chosen: list[Backend] | Pick | None) -> list[int]:
    assert chosen is not None
    backends = chosen.backends if isinstance(chosen, Pick) else chosen
    return [b.spec.port for b in backends]


def first(candidates: list[Backend], prompt: PromptBlocks | None = None) -> int:
    return ports(choose(candidates, candidates, prompt, ROUTING, SLOTS))[0]


# ---------------------------------------------------------------- pick(): load only


def test_least_loaded_first_then_alternates_from_another_region_first() -> None:
    backends = fleet(("a", 3, True), ("a", 1, True), ("b", 5, True))
    assert ports(pick(backends, backends)) == [9001, 9002, 9000]


def test_unhealthy_backends_are_never_alternates() -> None:
    backends = fleet(("a", 0, False), ("b", 2, True), ("b", 1, True))
    assert ports(pick(backends[1:], backends)) == [9002, 9001]


def test_backends_that_may_not_take_it_can_be_alternates_but_not_first() -> None:
    backends = fleet(("a", 0, True), ("b", 2, True))
    assert ports(pick(backends[1:], backends)) == [9001, 9000]


def test_none_without_candidates() -> None:
    backends = fleet(("a", 4, True))
    assert pick([], backends) is None


def test_tie_goes_to_the_first_configured_region() -> None:
    backends = fleet(("local", 1, True), ("remote", 1, True))
    assert ports(pick(backends, backends))[0] == 9000


# ---------------------------------------------------------------- each scorer


def test_shorter_engine_queue_wins() -> None:
    clock = FakeClock()
    a, b = scraped_fleet("r", "r", clock=clock)
    scraped(a, clock, waiting=2)
    assert first([a, b]) == 9001
    scraped(a, clock, waiting=0)
    b.in_flight = 1  # the gateway's own in-flight count is queue depth too
    assert first([a, b]) == 9000


def test_lower_kv_cache_use_wins() -> None:
    clock = FakeClock()
    a, b = scraped_fleet("r", "r", clock=clock)
    scraped(a, clock, kv=0.8)
    scraped(b, clock, kv=0.3)
    assert first([a, b]) == 9001


def test_a_never_scraped_backend_counts_as_saturated() -> None:
    clock = FakeClock()
    blind = Backend(BackendSpec("127.0.0.1", 9000, "r"), clock)
    seen = scraped_fleet("r", clock=clock)[0]
    seen.spec = BackendSpec("127.0.0.1", 9001, "r")
    scraped(seen, clock, kv=0.9)
    assert first([blind, seen]) == 9001


def test_local_region_wins_a_tie_and_loses_to_a_much_lighter_remote() -> None:
    clock = FakeClock()
    local, remote = scraped_fleet("here", "there", clock=clock)
    assert first([local, remote]) == 9000
    scraped(local, clock, waiting=2)  # +0.5 queue: level with the region penalty
    assert first([local, remote]) == 9000
    scraped(local, clock, waiting=3)
    assert first([local, remote]) == 9001


def test_unhealthy_candidates_are_never_chosen_nor_listed() -> None:
    a, b, c = scraped_fleet("r", "r", "s")
    a.healthy = False
    b.in_flight = 3
    chosen = choose([a, b], [a, b, c], None, ROUTING, SLOTS)
    assert ports(chosen) == [9001, 9002]
    b.healthy = False
    assert choose([a, b], [a, b, c], None, ROUTING, SLOTS) is None


def test_alternates_come_from_another_region_first_then_by_load() -> None:
    a1, a2, a3, b1 = scraped_fleet("a", "a", "a", "b")
    a2.in_flight = 2
    b1.in_flight = 3
    assert ports(choose([a1], [a1, a2, a3, b1], None, ROUTING, SLOTS)) == [9000, 9003, 9002]


# ---------------------------------------------------------------- prefix affinity


def conversation(turn: str) -> PromptBlocks:
    return PromptBlocks(SYSTEM + turn, "model")


def test_the_backend_holding_the_prefix_wins_a_load_tie() -> None:
    a, b = scraped_fleet("r", "r")
    assert first([a, b], conversation("Hi")) == 9000  # nobody holds it: configured order
    b.prefix_cache.record(conversation("Hi").blocks(b.block_size))
    chosen = choose([a, b], [a, b], conversation("Where is my parcel?"), ROUTING, SLOTS)
    assert chosen is not None and ports(chosen)[0] == 9001 and chosen.reason == "prefix"


def test_the_longest_prefix_wins() -> None:
    a, b = scraped_fleet("r", "r")
    a.prefix_cache.record(PromptBlocks(SYSTEM[:1000], "model").blocks(16))
    b.prefix_cache.record(conversation("Hi").blocks(16))
    assert first([a, b], conversation("Hi again")) == 9001


def test_sticky_within_the_margin_and_not_beyond() -> None:
    a, b = scraped_fleet("r", "r")
    prompt = conversation("Second question")
    b.prefix_cache.record(prompt.blocks(16))
    b.in_flight = 1  # load +0.25 against a: exactly the margin, still sticky
    assert first([a, b], prompt) == 9001
    b.in_flight = 2  # +0.5: saturated for this request, though its prefix term would win
    chosen = choose([a, b], [a, b], prompt, ROUTING, SLOTS)
    assert chosen is not None and ports(chosen)[0] == 9000 and chosen.reason == "load"


def test_a_wider_margin_keeps_the_prefix_longer() -> None:
    a, b = scraped_fleet("r", "r")
    prompt = conversation("Q")
    b.prefix_cache.record(prompt.blocks(16))
    b.in_flight = 2
    wide = Routing(sticky_margin=1.0)
    assert ports(choose([a, b], [a, b], prompt, wide, SLOTS))[0] == 9001


def test_prefix_of_other_block_sizes_is_matched_in_that_size() -> None:
    a, b = scraped_fleet("r", "r")
    b.block_size = 128  # a CPU engine: its blocks are cut differently
    prompt = conversation("Q" * 600)
    b.prefix_cache.record(prompt.blocks(128))
    assert first([a, b], prompt) == 9001


def test_reason_is_only_for_a_single_candidate() -> None:
    a, b = scraped_fleet("r", "s")
    chosen = choose([a], [a, b], conversation("x"), ROUTING, SLOTS)
    assert chosen is not None and chosen.reason == "only" and ports(chosen) == [9000, 9001]


def test_a_pick_outside_the_local_region_is_a_failover() -> None:
    local, remote = scraped_fleet("home", "away")
    local.healthy = False
    chosen = choose([local, remote], [local, remote], conversation("x"), ROUTING, SLOTS)
    assert chosen is not None and chosen.reason == "failover" and ports(chosen) == [9001]
    local.healthy = True
    local.in_flight = 40  # far worse than the region penalty: spilled over, same label
    chosen = choose([local, remote], [local, remote], conversation("x"), ROUTING, SLOTS)
    assert chosen is not None and chosen.reason == "failover"


# ---------------------------------------------------------------- completion failures


def test_failing_completions_cool_a_backend_off_then_it_comes_back() -> None:
    clock = FakeClock()
    a, b = scraped_fleet("r", "s", clock=clock)
    for _ in range(FAILURES_TO_COOL_OFF - 1):
        a.note_outcome(ok=False)
    a.note_outcome(ok=True)  # a success in between resets the count
    for _ in range(FAILURES_TO_COOL_OFF - 1):
        a.note_outcome(ok=False)
    assert a.healthy
    a.note_outcome(ok=False)
    assert not a.healthy
    assert ports(choose([a, b], [a, b], None, ROUTING, SLOTS)) == [9001]  # not even alternate
    clock.now += COOL_OFF_S - 0.1
    assert not a.healthy
    clock.now += 0.2
    assert a.healthy
    assert ports(choose([a, b], [a, b], None, ROUTING, SLOTS)) == [9000, 9001]
