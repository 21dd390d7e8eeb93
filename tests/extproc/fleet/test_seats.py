"""A backend's seats (``extproc.fleet.seats``) learned from plain ``EngineMetrics``, no sockets, and
how ``Backend`` plans with them (free and busy seats, the effective waiting queue, KV)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from extproc.fleet.backend import Backend, BackendSpec
from extproc.fleet.seats import FALLBACK_SEATS, KV_BOUND, STEPS_TO_CONFIRM, Seats, restarted
from extproc.fleet.vllm_metrics import EngineMetrics
from loadtests.sim.engine import Engine as SimEngine
from loadtests.sim.engine import EngineConfig, EngineRequest
from loadtests.sim.profiles import get_profile

CONFIRMATIONS = 2
"""Seat-bound scrapes in a row that confirm a count when, as in ``Engine``, each scrape spans
many engine steps: the first starts the count of steps, the second finds them passed."""

BLOCKS = 1000
BLOCK_SIZE = 16
KV_TOKENS = BLOCKS * BLOCK_SIZE


class Engine:
    """One engine's scrapes in order: cumulative counters grow with every scrape (unless
    ``restart`` starts them over), as a real vLLM process's would."""

    def __init__(self, blocks: int | None = BLOCKS, block_size: int | None = BLOCK_SIZE) -> None:
        self.blocks = blocks
        self.block_size = block_size
        self.tokens = 0.0
        self.clock = 0.0

    def scrape(self, running: float, waiting: float = 0, kv: float = 0.5) -> EngineMetrics:
        self.tokens += 10 * running
        self.clock += 0.1
        return EngineMetrics(
            waiting=waiting,
            running=running,
            kv_cache_usage=kv,
            itl_sum_s=self.tokens * 0.02,
            itl_count=self.tokens,
            scraped_at=self.clock,
            block_size=self.block_size,
            num_gpu_blocks=self.blocks,
        )

    def restart(self, blocks: int | None = BLOCKS, block_size: int | None = BLOCK_SIZE) -> None:
        """A new process: counters from zero, perhaps another cache configuration."""
        self.tokens = 0.0
        self.blocks, self.block_size = blocks, block_size


def feed(
    seats: Seats, scrapes: list[EngineMetrics], last: EngineMetrics | None = None
) -> list[bool]:
    """Observe ``scrapes`` in order (``last``: the scrape before them); what each returned."""
    changed = []
    for current in scrapes:
        changed.append(seats.observe(last, current))
        last = current
    return changed


def seat_bound(engine: Engine, running: int, times: int = CONFIRMATIONS) -> list[EngineMetrics]:
    """Scrapes where requests wait although the KV cache has room: every seat is taken."""
    return [engine.scrape(running, waiting=3, kv=0.4) for _ in range(times)]


# --- learning ---------------------------------------------------------------------------


def test_a_count_is_learned_after_confirmations_seat_bound_scrapes_alike() -> None:
    engine, seats = Engine(), Seats()
    assert STEPS_TO_CONFIRM >= 2  # one scrape can catch a request between arrival and a step
    scrapes = seat_bound(engine, 8)
    changed = feed(seats, scrapes)
    assert (seats.learned, seats.count, seats.source) == (8, 8, "learned")
    # the first scrape only raised the fallback (9 = peak 8 + 1), the last one taught 8
    assert changed == [True] + [False] * (CONFIRMATIONS - 2) + [True]


def test_one_seat_bound_scrape_is_not_enough() -> None:
    engine, seats = Engine(), Seats()
    feed(seats, seat_bound(engine, 8, times=CONFIRMATIONS - 1))
    assert seats.learned is None and seats.source == "fallback"
    assert seats.count > 8  # the fallback plans with more than the engine was seen running


def test_the_confirmations_must_be_in_a_row_and_agree() -> None:
    engine, seats = Engine(), Seats()
    # a scrape without a queue between two seat-bound ones starts the count over
    feed(seats, [*seat_bound(engine, 8, 1), engine.scrape(8), *seat_bound(engine, 8, 1)])
    assert seats.learned is None
    # running counts that differ are different candidates
    last = engine.scrape(0)
    feed(seats, [engine.scrape(6, waiting=2), engine.scrape(7, waiting=2)], last)
    assert seats.learned is None


@pytest.mark.parametrize("kv", [KV_BOUND, 0.95, 1.0])
def test_a_kv_bound_scrape_teaches_nothing(kv: float) -> None:
    engine, seats = Engine(), Seats()
    feed(seats, [engine.scrape(5, waiting=4, kv=kv) for _ in range(5)])
    assert seats.learned is None and seats.source == "fallback"
    assert seats.count > 5  # only the fallback, from what it demonstrably runs


def test_a_queue_with_nothing_running_teaches_nothing() -> None:
    engine, seats = Engine(), Seats()
    feed(seats, [engine.scrape(0, waiting=4, kv=0.0) for _ in range(5)])  # still loading
    assert (seats.learned, seats.count) == (None, FALLBACK_SEATS)


def test_more_running_than_learned_raises_it_at_once() -> None:
    engine, seats = Engine(), Seats()
    scrapes = seat_bound(engine, 8)
    feed(seats, scrapes)
    assert seats.observe(scrapes[-1], engine.scrape(10)) is True  # no queue needed
    assert (seats.learned, seats.count, seats.source) == (10, 10, "learned")


def test_fewer_running_with_a_queue_does_not_lower_a_learned_count_without_a_restart() -> None:
    """What the engine proved it runs stays proved; only a new process may have fewer
    seats (a transient short running batch, e.g. long prompts filling the token budget,
    must not shrink the fleet)."""
    engine, seats = Engine(), Seats()
    scrapes = seat_bound(engine, 8)
    feed(seats, scrapes)
    assert feed(seats, seat_bound(engine, 5, times=4), scrapes[-1]) == [False] * 4
    assert seats.learned == 8


def test_a_queue_behind_a_long_prefill_is_not_a_full_engine() -> None:
    """vLLM (and the simulator, which follows its scheduler) also leaves requests waiting
    while seats are free when the step's token budget is spent on prefill chunks. One step
    of a long prefill outlasts two 100 ms scrapes, so both see the same running count with
    a queue and KV room: the count is learned as 1 on a 16-seat engine. Only more running
    than that raises it, and a tier that needs a free seat (batch, max_waiting 0) never
    sends more: a batch-only long-prompt workload stays capped at the wrong count."""
    config = EngineConfig(
        profile=get_profile("llama-8b-l4"),
        max_num_seqs=16,
        max_num_batched_tokens=2048,
        num_gpu_blocks=100_000,  # KV far from full: only seats or the budget can hold them
        max_model_len=32_768,
    )
    engine = SimEngine(config)
    for i in range(6):
        request = EngineRequest(f"r{i}", 16_000, [], max_tokens=100, output_len=100)
        engine.add(request, 0.0)
    seats, previous, now, scrape_at, tokens = Seats(), None, 0.0, 0.1, 0
    while now < 3.0:
        step = engine.step(now)
        now, tokens = step.end, tokens + len(step.outputs)
        while scrape_at <= now:  # the engine's numbers as of its last finished step
            current = EngineMetrics(
                engine.num_waiting,
                engine.num_running,
                engine.pool.usage,
                tokens * 0.05,
                tokens,
                scrape_at,
                BLOCK_SIZE,
                config.num_gpu_blocks,
            )
            seats.observe(previous, current)
            assert current.kv_cache_usage < KV_BOUND and current.waiting > 0
            previous, scrape_at = current, scrape_at + 0.1
    assert seats.learned in (None, 16)


# --- restarts ---------------------------------------------------------------------------


def test_a_restart_with_fewer_seats_forgets_and_relearns_the_smaller_count() -> None:
    engine, seats = Engine(), Seats()
    before = seat_bound(engine, 16)
    feed(seats, before)
    assert seats.count == 16
    engine.restart()  # same cache, `--max-num-seqs 2` now: counters start over
    after = seat_bound(engine, 2)
    changed = feed(seats, after, before[-1])
    assert changed[0] is True  # forgotten at once: back to the fallback
    assert seats.peak_running == 2
    assert (seats.learned, seats.count, seats.source) == (2, 2, "learned")


def test_a_restart_forgets_the_peak_the_fallback_grew_from() -> None:
    engine, seats = Engine(), Seats()
    last = engine.scrape(12)
    feed(seats, [last])
    grown = seats.count
    assert grown > 12
    engine.restart()
    assert seats.observe(last, engine.scrape(1)) is True
    assert seats.peak_running == 1 and seats.source == "fallback"
    assert seats.count == Seats(peak_running=1).count < grown


@pytest.mark.parametrize(
    ("blocks", "block_size"),
    [(BLOCKS // 2, BLOCK_SIZE), (BLOCKS, 2 * BLOCK_SIZE), (2 * BLOCKS, BLOCK_SIZE)],
    ids=["fewer-blocks", "other-block-size", "scaled-up"],
)
def test_another_cache_configuration_is_another_engine(blocks: int, block_size: int) -> None:
    """Counters that did not go backwards (the new process already served more tokens than
    the old one did, or the address now sums more data-parallel engines) still count as a
    restart when ``cache_config_info`` changed."""
    engine, seats = Engine(), Seats()
    before = seat_bound(engine, 16)
    feed(seats, before)
    engine.blocks, engine.block_size = blocks, block_size  # counters keep growing
    feed(seats, seat_bound(engine, 4), before[-1])
    assert (seats.learned, seats.count) == (4, 4)


def test_restarted_compares_counters_and_cache_configuration() -> None:
    engine = Engine()
    first, second = engine.scrape(4), engine.scrape(4)
    assert not restarted(first, second)
    assert not restarted(second, second)  # an idle engine: counters stand still
    assert restarted(second, first)  # counters went backwards
    fewer_seconds = EngineMetrics(0, 4, 0.5, 0.0, second.itl_count, 1.0, BLOCK_SIZE, BLOCKS)
    assert restarted(second, fewer_seconds)
    other = Engine(blocks=BLOCKS + 1)
    other.tokens = engine.tokens
    assert restarted(second, other.scrape(4))


def test_without_the_itl_histogram_no_counters_say_restart_and_no_steps_teach_seats() -> None:
    """The ITL count is what counts engine steps; a page without it cannot confirm a
    count (the fallback keeps probing), nor tell a restart by counters."""
    engine, seats = Engine(), Seats()
    blind = [
        dataclasses.replace(m, itl_sum_s=None, itl_count=None) for m in seat_bound(engine, 8, 4)
    ]
    feed(seats, blind)
    assert seats.learned is None and seats.source == "fallback" and seats.count > 8
    with_itl = engine.scrape(4)
    assert not restarted(with_itl, blind[0]) and not restarted(blind[0], with_itl)


def test_a_cache_size_not_known_yet_is_not_a_restart() -> None:
    """vLLM reports ``num_gpu_blocks`` as None until its memory profiling has run."""
    engine = Engine(blocks=None)
    unsized = engine.scrape(2)
    engine.blocks = BLOCKS
    sized = engine.scrape(2)
    assert not restarted(unsized, sized)
    engine.blocks = None
    assert not restarted(sized, engine.scrape(2))


# --- fallback and declared --------------------------------------------------------------


def test_the_fallback_grows_with_the_most_ever_seen_running() -> None:
    engine, seats = Engine(), Seats()
    assert (seats.count, seats.source) == (FALLBACK_SEATS, "fallback")
    assert feed(seats, [engine.scrape(6)]) == [True]
    grown = seats.count
    assert grown > 6 and seats.peak_running == 6  # a little more than it demonstrably runs
    assert feed(seats, [engine.scrape(1)]) == [False]  # a quiet moment keeps the peak
    assert seats.count == grown
    assert feed(seats, [engine.scrape(9)]) == [True]
    assert seats.count > 9 and seats.source == "fallback"


def test_a_larger_configured_fallback_is_kept_until_the_engine_runs_past_it() -> None:
    engine, seats = Engine(), Seats(fallback=10)
    feed(seats, [engine.scrape(3)])
    assert seats.count == 10
    feed(seats, [engine.scrape(12)])
    assert seats.count > 12


def test_declared_seats_win_over_everything_observed() -> None:
    engine, seats = Engine(), Seats(declared=6)
    assert (seats.count, seats.source) == (6, "declared")
    changes = feed(seats, [*seat_bound(engine, 8), engine.scrape(20), *seat_bound(engine, 3)])
    assert not any(changes)  # the count the gateway plans with never moved
    assert (seats.count, seats.source) == (6, "declared")
    assert seats.learned == 20  # still observed (for a log line), never used


@pytest.mark.parametrize("kwargs", [{"declared": 0}, {"declared": -1}, {"fallback": 0}])
def test_seat_counts_below_one_are_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        Seats(**kwargs)


def test_observe_says_whether_the_count_changed() -> None:
    engine, seats = Engine(), Seats()
    last = engine.scrape(0)
    assert feed(seats, [last]) == [False]
    learn = seat_bound(engine, 6, times=CONFIRMATIONS + 2)
    # the first raises the fallback past 6, the confirming one teaches 6, the rest repeat it
    assert feed(seats, learn, last) == [True, *[False] * (CONFIRMATIONS - 2), True, False, False]
    assert seats.observe(learn[-1], engine.scrape(6)) is False  # a queue that drained
    assert seats.observe(learn[-1], engine.scrape(7)) is True


# --- Backend: the scrapes feed its seats -------------------------------------------------


def backend(seats: int | None = None) -> Backend:
    return Backend(BackendSpec("127.0.0.1", 8001, "east", seats=seats))


def test_record_scrape_learns_the_backend_seats_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="fairlane.backends")
    engine, b = Engine(), backend()
    for metrics in [engine.scrape(1), engine.scrape(3), *seat_bound(engine, 8)]:
        b.record_scrape(metrics, 0)
    assert (b.seats.count, b.seats.source) == (8, "learned")
    messages = [r.getMessage() for r in caplog.records]
    fallback = [m for m in messages if "not declared and not learned yet" in m]
    assert len(fallback) == 1, "the fallback is logged once, not per scrape"
    assert [m for m in messages if "runs" in m] == [
        "backend 127.0.0.1:8001 runs 8 requests at once (learned: requests waited while KV "
        "had room)"
    ]


def test_a_declared_backend_logs_no_fallback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fairlane.backends")
    engine, b = Engine(), backend(seats=6)
    for metrics in seat_bound(engine, 8):
        b.record_scrape(metrics, 0)
    assert (b.seats.count, b.seats.source) == (6, "declared")
    assert not caplog.records


def learned(seats: int, engine: Engine | None = None) -> tuple[Backend, Engine]:
    """A backend that learned ``seats`` from its engine, then scraped it with no queue."""
    engine = engine or Engine()
    b = backend()
    for metrics in seat_bound(engine, seats):
        b.record_scrape(metrics, 0)
    assert (b.seats.count, b.seats.source) == (seats, "learned")
    return b, engine


def test_busy_and_free_seats_count_the_engine_and_the_grants_since() -> None:
    b = backend()
    assert (b.busy_seats(), b.free_seats()) == (0, FALLBACK_SEATS)
    b.note_grant()
    assert (b.busy_seats(), b.free_seats()) == (1, FALLBACK_SEATS - 1)  # before any scrape
    b, engine = learned(8)
    b.record_scrape(engine.scrape(5, waiting=1), 0)
    assert (b.busy_seats(), b.free_seats()) == (6, 2)
    b.note_grant()
    b.note_grant()
    b.note_completion()
    assert (b.busy_seats(), b.free_seats()) == (7, 1)
    b.record_scrape(engine.scrape(8, waiting=3), 2, 1)  # the engine counted them
    assert (b.busy_seats(), b.free_seats()) == (11, -3)  # negative: queued inside vLLM


def test_busy_seats_follow_the_gateways_own_count_when_the_engine_shows_less() -> None:
    b, engine = learned(8)
    for _ in range(6):
        b.note_grant()
    b.record_scrape(engine.scrape(2), 6)  # the engine has not seen four of them arrive yet
    assert b.in_flight == 6
    assert (b.busy_seats(), b.free_seats()) == (6, 2)


def test_every_grant_since_a_scrape_counts_as_waiting_even_with_free_seats() -> None:
    """Free seats are filled one grant per scrape: a burst of prefills in one engine step
    would slow every request in it (``Backend.effective_waiting``)."""
    b, engine = learned(8)
    b.record_scrape(engine.scrape(5), 0)  # 3 seats free at the scrape
    for expected in (1, 2, 3):
        b.note_grant()
        assert b.effective_waiting() == expected
    b.note_completion()  # a seat freed: it takes a waiting request
    assert b.effective_waiting() == 2


def test_with_a_queue_at_the_scrape_every_grant_waits() -> None:
    b, engine = learned(8)
    b.record_scrape(engine.scrape(8, waiting=2), 0)
    b.note_grant()
    assert b.effective_waiting() == 3
    b.note_completion()
    b.note_completion()
    assert b.effective_waiting() == 1


def test_effective_waiting_before_any_scrape_is_what_was_granted() -> None:
    b = backend()
    b.note_grant()
    b.note_grant()
    b.note_completion()
    assert b.effective_waiting() == 1


def test_projected_kv_usage_adds_what_grants_since_the_scrape_will_hold() -> None:
    b = backend()
    assert b.projected_kv_usage() == 1.0  # never scraped: full
    engine = Engine()
    b.record_scrape(engine.scrape(2, kv=0.25), 0)
    assert b.kv_capacity_tokens() == KV_TOKENS
    b.note_grant(KV_TOKENS // 4)
    b.note_grant(KV_TOKENS // 8)
    assert b.projected_kv_usage() == pytest.approx(0.25 + 0.25 + 0.125)
    b.record_scrape(engine.scrape(3, kv=0.5), 1, 0, KV_TOKENS // 4)  # saw the first only
    assert b.projected_kv_usage() == pytest.approx(0.5 + 0.125)


def test_projected_kv_usage_of_an_unknown_cache_is_the_scraped_figure() -> None:
    b = backend()
    b.record_scrape(Engine(blocks=None).scrape(2, kv=0.3), 0)
    b.note_grant(50_000)
    assert b.projected_kv_usage() == pytest.approx(0.3)


def test_scrapes_inside_one_long_step_confirm_nothing() -> None:
    """A long prefill step outlasts several scrapes: they all see the same moment, so they
    cannot show that the engine scheduled again and still admitted nobody."""
    engine, seats = Engine(), Seats()
    first = engine.scrape(8, waiting=3, kv=0.4)
    same_step = [dataclasses.replace(first, scraped_at=first.scraped_at + i) for i in (1, 2, 3)]
    feed(seats, [first, *same_step])
    assert seats.learned is None


def test_a_queue_admitted_at_the_next_step_was_the_token_budget_not_seats() -> None:
    engine, seats = Engine(), Seats()
    waiting = engine.scrape(8, waiting=4, kv=0.4)  # budget spent on prefill this step
    admitted = engine.scrape(12, waiting=0, kv=0.5)  # the next steps seated them
    feed(seats, [waiting, admitted])
    assert seats.learned is None and seats.count > 12
