"""The fair scheduler: band order, aging, VTC fairness, lift rule, bookkeeping, memory."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from extproc.core import scheduler as scheduler_module
from extproc.core.scheduler import (
    BandConfig,
    DrainMeter,
    Entry,
    FairnessConfig,
    FairScheduler,
    Lookahead,
    QueueFull,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


_ids = itertools.count()

BANDS = (
    BandConfig("interactive", 0, 1000),
    BandConfig("api", 1, 1000),
    BandConfig("batch", 2, 1000),
)


def scheduler(
    bands: tuple[BandConfig, ...] = BANDS,
    fairness: FairnessConfig | None = None,
    clock: FakeClock | None = None,
) -> FairScheduler:
    fairness = fairness or FairnessConfig()
    sched = FairScheduler(fairness, clock or FakeClock())
    sched.configure(bands, fairness)
    return sched


def entry(
    band: str,
    flow: str = "t",
    *,
    at: float = 1000.0,
    inp: int = 10,
    out: int = 0,
    weight: float = 1.0,
    rid: str | None = None,
) -> Entry:
    return Entry(rid or f"r{next(_ids)}", band, flow, weight, inp, out, at)


def pop_id(sched: FairScheduler) -> str:
    popped = sched.pop()
    assert popped is not None
    return popped.request_id


def pop_flows(sched: FairScheduler, n: int) -> list[str]:
    flows = []
    for _ in range(n):
        popped = sched.pop()
        assert popped is not None
        flows.append(popped.flow)
    return flows


# --------------------------------------------------------------------------- bands


def test_bands_are_served_in_strict_rank_order_then_fifo() -> None:
    sched = scheduler()
    for rid, band in [("b1", "batch"), ("a1", "api"), ("i1", "interactive"), ("b2", "batch")]:
        sched.push(entry(band, rid=rid))
    sched.push(entry("interactive", rid="i2"))
    assert [pop_id(sched) for _ in range(5)] == ["i1", "i2", "a1", "b1", "b2"]
    assert sched.pop() is None


def test_aging_lets_an_old_batch_entry_overtake_only_after_the_configured_time() -> None:
    clock = FakeClock()
    bands = (
        BandConfig("interactive", 0, 100),
        BandConfig("batch", 2, 100, aging_rate=0.1, aging_cap=3.0),
    )
    sched = scheduler(bands, clock=clock)
    sched.push(entry("batch", rid="old", at=clock.now))
    # after 19 s batch is at effective rank 0.1: fresh interactive work still goes first
    clock.now += 19
    sched.push(entry("interactive", rid="i1", at=clock.now))
    assert pop_id(sched) == "i1"
    # after 20 s it ties with interactive; ties go to the more urgent base rank
    clock.now += 1
    sched.push(entry("interactive", rid="i2", at=clock.now))
    assert pop_id(sched) == "i2"
    # past 20 s it is strictly better and overtakes fresh interactive entries
    clock.now += 1
    sched.push(entry("interactive", rid="i3", at=clock.now))
    sched.push(entry("batch", rid="young", at=clock.now))
    assert pop_id(sched) == "old"
    # aging is judged on the band's oldest entry: the young one does not ride along
    assert [pop_id(sched) for _ in range(2)] == ["i3", "young"]


def test_aging_never_lifts_a_band_beyond_its_cap() -> None:
    clock = FakeClock()
    bands = (
        BandConfig("interactive", 0, 100),
        BandConfig("api", 1, 100),
        BandConfig("batch", 2, 100, aging_rate=10.0, aging_cap=1.5),
    )
    sched = scheduler(bands, clock=clock)
    sched.push(entry("batch", rid="old", at=clock.now))
    clock.now += 10_000
    sched.push(entry("interactive", rid="i", at=clock.now))
    sched.push(entry("api", rid="a", at=clock.now))
    # capped at effective rank 0.5: ahead of api, never ahead of interactive
    assert [pop_id(sched) for _ in range(3)] == ["i", "old", "a"]


def test_without_a_cap_the_rate_alone_does_not_age() -> None:
    clock = FakeClock()
    sched = scheduler(
        (BandConfig("hi", 0, 10), BandConfig("lo", 1, 10, aging_rate=5.0)), clock=clock
    )
    sched.push(entry("lo", rid="lo", at=clock.now))
    clock.now += 3600
    sched.push(entry("hi", rid="hi", at=clock.now))
    assert pop_id(sched) == "hi"


def test_pop_skips_bands_that_are_not_eligible() -> None:
    sched = scheduler()
    sched.push(entry("interactive", rid="i"))
    sched.push(entry("batch", rid="b"))
    asked: list[str] = []

    def only_batch(band: str) -> bool:
        asked.append(band)
        return band == "batch"

    popped = sched.pop(only_batch)
    assert popped is not None and popped.request_id == "b"
    assert "api" not in asked  # empty bands are not even asked about
    assert sched.pop(lambda band: band == "batch") is None
    assert sched.depths()["interactive"] == 1 and len(sched) == 1
    assert pop_id(sched) == "i"


# --------------------------------------------------------------------------- VTC


def served_tokens(order: list[Entry]) -> list[dict[str, int]]:
    """Cumulative cost (input + 2 x output) per flow after each pop."""
    totals: dict[str, int] = Counter()
    history = []
    for item in order:
        totals[item.flow] += item.input_tokens + 2 * item.output_tokens_estimate
        history.append(dict(totals))
    return history


def drain(sched: FairScheduler, n: int) -> list[Entry]:
    order = []
    for _ in range(n):
        popped = sched.pop()
        assert popped is not None
        order.append(popped)
    return order


def test_equal_flows_get_token_shares_within_one_request_of_each_other() -> None:
    sched = scheduler()
    rng = random.Random(7)
    for _ in range(300):
        sched.push(entry("api", "a", inp=rng.randint(10, 200), out=rng.randint(0, 100)))
        sched.push(entry("api", "b", inp=rng.randint(10, 200), out=rng.randint(0, 100)))
    max_cost = 200 + 2 * 100
    # while both stay backlogged, service differs by at most one request's cost at every step
    for totals in served_tokens(drain(sched, 400)):
        assert abs(totals.get("a", 0) - totals.get("b", 0)) <= max_cost


def test_alternation_is_by_tokens_not_by_count() -> None:
    sched = scheduler()
    for _ in range(200):
        sched.push(entry("api", "small", inp=100))
        sched.push(entry("api", "big", inp=400))
    pops = Counter(pop_flows(sched, 200))
    assert pops["small"] == pytest.approx(4 * pops["big"], abs=4)


def test_flow_weights_give_proportional_token_shares() -> None:
    sched = scheduler()
    for _ in range(300):
        sched.push(entry("api", "heavy", inp=50, out=25, weight=2.0))
        sched.push(entry("api", "light", inp=50, out=25, weight=1.0))
    totals = served_tokens(drain(sched, 300))[-1]
    assert totals["heavy"] / totals["light"] == pytest.approx(2.0, rel=0.02)


def test_output_weight_is_configurable() -> None:
    sched = scheduler(fairness=FairnessConfig(input_weight=1.0, output_weight=0.0))
    for _ in range(50):
        sched.push(entry("api", "talky", inp=10, out=1000))
        sched.push(entry("api", "terse", inp=10, out=0))
    # output is free under this policy, so the two alternate one for one
    assert Counter(pop_flows(sched, 40)) == {"talky": 20, "terse": 20}


def test_a_flow_back_from_idle_gets_no_burst() -> None:
    sched = scheduler()
    for _ in range(5):
        sched.push(entry("api", "c", inp=10))
    for _ in range(100):
        sched.push(entry("api", "a", inp=10))
        sched.push(entry("api", "b", inp=10))
    # c is served first while everybody starts equal, then goes idle
    drain(sched, 15)
    assert sched.depth("api") == 200 - 10
    flows = pop_flows(sched, 60)  # a and b keep being served while c is away
    assert "c" not in flows
    for _ in range(10):
        sched.push(entry("api", "c", inp=10))
    flows = pop_flows(sched, 30)
    # without the lift rule c's stale counter would win 10 pops in a row; with it, c
    # takes its turn in the rotation: never twice in a row, a third of the pops
    assert "c,c" not in ",".join(flows)
    assert flows.count("c") == 10


def test_a_new_flow_joins_at_the_backlog_minimum() -> None:
    sched = scheduler()
    for _ in range(20):
        sched.push(entry("api", "a", inp=10))
    drain(sched, 10)
    assert sched.counters("api") == {"a": 100.0}
    sched.push(entry("api", "new", inp=10))
    assert sched.counters("api")["new"] == 100.0
    # tie on the counter: the earlier head (a's) goes first, then the newcomer
    assert pop_flows(sched, 3) == ["a", "new", "a"]


def test_correct_moves_a_counter_and_refunds_stop_at_the_floor() -> None:
    sched = scheduler()
    for _ in range(5):
        sched.push(entry("api", "a", inp=10, out=50))
        sched.push(entry("api", "b", inp=10, out=50))
    drain(sched, 2)  # a and b both charged 10 + 2*50 = 110
    assert sched.counters("api") == {"a": 110.0, "b": 110.0}
    # a's request produced 80 tokens instead of 50: 2 * 30 more
    sched.correct("a", "api", estimated_output=50, actual_output=80, weight=1.0)
    assert sched.counters("api")["a"] == 170.0
    assert pop_flows(sched, 1) == ["b"]  # b is now behind, so b goes first
    # b is at 220 now; a (170) is the backlog minimum, so a refund cannot take it lower
    sched.correct("a", "api", estimated_output=50, actual_output=0, weight=1.0)
    assert sched.counters("api") == {"a": 170.0, "b": 220.0}
    # b can be refunded down to a's 170, not below
    sched.correct("b", "api", estimated_output=20, actual_output=0, weight=1.0)
    assert sched.counters("api")["b"] == 180.0
    sched.correct("b", "api", estimated_output=1000, actual_output=0, weight=1.0)
    assert sched.counters("api")["b"] == 170.0
    # the weight divides corrections as it divides charges
    before = sched.counters("api")["b"]
    sched.correct("b", "api", estimated_output=0, actual_output=10, weight=4.0)
    assert sched.counters("api")["b"] == before + 5.0


def test_refund_never_drops_below_the_backlog_minimum() -> None:
    sched = scheduler()
    for _ in range(3):
        sched.push(entry("api", "a", inp=100))
        sched.push(entry("api", "b", inp=100))
    drain(sched, 3)  # a: 200, b: 100
    assert sched.counters("api") == {"a": 200.0, "b": 100.0}
    sched.correct("a", "api", estimated_output=500, actual_output=0, weight=1.0)
    assert sched.counters("api")["a"] == 100.0  # not -800: no burst for a


def test_correct_records_debt_of_an_untracked_flow_and_ignores_an_empty_band() -> None:
    sched = scheduler()
    sched.correct("x", "api", estimated_output=0, actual_output=100, weight=1.0)
    assert sched.counters("api") == {}  # nothing queued: the busy period is over
    sched.correct("x", "nope", estimated_output=0, actual_output=100, weight=1.0)
    for _ in range(3):
        sched.push(entry("api", "a", inp=10))
    sched.correct("x", "api", estimated_output=0, actual_output=100, weight=1.0)
    assert sched.counters("api")["x"] == 200.0
    sched.correct("y", "api", estimated_output=100, actual_output=0, weight=1.0)
    assert "y" not in sched.counters("api")


# --------------------------------------------------------------------------- bookkeeping


def test_remove_keeps_depths_exact_and_takes_the_flow_out_of_the_backlog() -> None:
    sched = scheduler()
    a1, a2 = entry("api", "a", rid="a1"), entry("api", "a", rid="a2")
    b1 = entry("api", "b", rid="b1")
    for item in (a1, b1, a2):
        sched.push(item)
    assert sched.remove(b1)
    assert not sched.remove(b1)
    assert sched.depths()["api"] == 2 and len(sched) == 2
    assert not sched.contains("b1") and sched.contains("a1")
    assert "b" not in sched.counters("api")  # b left the backlog with nothing owed
    assert sched.remove(a1)  # the head of a: the flow's next entry becomes its head
    assert pop_id(sched) == "a2"
    assert sched.pop() is None and len(sched) == 0
    assert not sched.remove(entry("api", "a", rid="a2"))  # same id, other object


def test_removing_a_flow_lets_the_next_flow_go() -> None:
    sched = scheduler()
    entries = [entry("api", "a", inp=1) for _ in range(3)]
    for item in entries:
        sched.push(item)
    sched.push(entry("api", "b", inp=1000, rid="b"))
    assert pop_flows(sched, 2) == ["a", "b"]  # a then b; now a at 1 and b at 1000
    for item in entries[1:]:
        assert sched.remove(item)
    assert sched.pop() is None
    assert sched.depths() == {"interactive": 0, "api": 0, "batch": 0}


def test_full_band_refuses_with_retry_after() -> None:
    clock = FakeClock()
    sched = scheduler((BandConfig("api", 0, 2), BandConfig("batch", 1, 1)), clock=clock)
    sched.push(entry("api"))
    sched.push(entry("api"))
    with pytest.raises(QueueFull) as info:
        sched.push(entry("api"))
    assert info.value.tier == "api" and info.value.limit == 2
    assert info.value.retry_after_s >= 1
    sched.push(entry("batch"))  # other bands are unaffected
    assert sched.depths() == {"api": 2, "batch": 1}
    # once it drains at 1 per second, retry-after is depth over that rate
    for i in range(30):
        clock.now += 1
        sched.pop(lambda band: band == "api")
        sched.push(entry("api", rid=f"refill{i}"))
    assert sched.retry_after_s("api") == 2
    assert sched.retry_after_s("unknown") == 30


def test_pushes_that_cannot_be_queued_are_refused() -> None:
    sched = scheduler()
    with pytest.raises(KeyError):
        sched.push(entry("unknown"))
    with pytest.raises(ValueError):
        sched.push(entry("api", weight=0.0))
    sched.push(entry("api", rid="dup"))
    with pytest.raises(ValueError):
        sched.push(entry("batch", rid="dup"))
    assert len(sched) == 1


def test_oldest_wait_tracks_the_band_head() -> None:
    clock = FakeClock()
    sched = scheduler(clock=clock)
    assert sched.oldest_wait_s("api") == 0.0
    sched.push(entry("api", at=clock.now))
    clock.now += 5
    sched.push(entry("api", at=clock.now))
    clock.now += 2
    assert sched.oldest_wait_s("api") == 7.0
    sched.pop()
    assert sched.oldest_wait_s("api") == 2.0


def test_configure_reranks_without_dropping_and_keeps_removed_bands_until_drained() -> None:
    sched = scheduler()
    sched.push(entry("interactive", rid="i"))
    sched.push(entry("batch", rid="b"))
    sched.push(entry("api", rid="a"))
    # reload: batch becomes most urgent, api disappears from the policy
    sched.configure(
        (BandConfig("batch", 0, 10), BandConfig("interactive", 1, 10)), FairnessConfig()
    )
    assert len(sched) == 3
    with pytest.raises(KeyError):
        sched.push(entry("api"))
    # api keeps its old rank 1, which interactive now has too: equal ranks tie-break by name
    assert pop_id(sched) == "b"
    assert [pop_id(sched) for _ in range(2)] == ["a", "i"]
    assert "api" not in sched.depths()  # gone once drained
    with pytest.raises(QueueFull):  # the new limit applies
        for _ in range(11):
            sched.push(entry("batch"))


def test_reconfigured_fairness_weights_apply_to_later_charges() -> None:
    sched = scheduler()
    for _ in range(3):
        sched.push(entry("api", "a", inp=10, out=10))
    sched.pop()
    sched.configure(BANDS, FairnessConfig(input_weight=0.0, output_weight=1.0))
    sched.pop()
    assert sched.counters("api")["a"] == 30.0 + 10.0


# --------------------------------------------------------------------------- memory


def test_distinct_flows_leave_no_state_behind_once_idle() -> None:
    sched = scheduler((BandConfig("api", 0, 10_000),))
    for i in range(10_000):
        sched.push(entry("api", f"user{i}", inp=100, out=50))
    assert sched.tracked_flows() == 10_000
    drain(sched, 10_000)
    assert sched.tracked_flows() == 0
    assert sched.counters("api") == {}


def test_flow_state_stays_bounded_through_a_long_busy_period() -> None:
    sched = scheduler()
    for _ in range(3):
        sched.push(entry("api", "steady", inp=100))
    most = 0
    for i in range(10_000):
        sched.push(entry("api", f"user{i}", inp=100, out=i % 7))
        sched.push(entry("api", "steady", inp=100))
        drain(sched, 2)
        if i % 3 == 0:  # some flows also get corrections after they went idle
            sched.correct(f"user{i}", "api", 0, 5, 1.0)
        most = max(most, sched.tracked_flows())
    assert len(sched) == 3  # the band never drained
    assert most <= 10


# --------------------------------------------------------------------------- model check


@dataclass
class _RefBand:
    config: BandConfig
    configured: bool = True
    entries: list[tuple[int, Entry]] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    vtime: float = 0.0

    def backlogged(self) -> set[str]:
        return {e.flow for _, e in self.entries}

    def settle(self) -> None:
        if not self.entries:
            self.counters.clear()
            self.vtime = 0.0
            return
        self.vtime = max(self.vtime, min(self.counters[f] for f in self.backlogged()))


class _Reference:
    """The same rules, written the obvious O(n) way."""

    def __init__(self, clock: FakeClock, fairness: FairnessConfig) -> None:
        self.clock = clock
        self.fairness = fairness
        self.bands: dict[str, _RefBand] = {}
        self.seq = 0

    def configure(self, bands: tuple[BandConfig, ...]) -> None:
        names = {b.name for b in bands}
        for name, band in list(self.bands.items()):
            if name not in names:
                if band.entries:
                    band.configured = False
                else:
                    del self.bands[name]
        for config in bands:
            band = self.bands.setdefault(config.name, _RefBand(config))
            band.config, band.configured = config, True

    def push(self, item: Entry) -> bool:
        band = self.bands.get(item.band)
        if band is None or not band.configured or len(band.entries) >= band.config.queue_limit:
            return False
        if item.flow not in band.backlogged():
            band.counters[item.flow] = max(band.counters.get(item.flow, 0.0), band.vtime)
        band.entries.append((self.seq, item))
        self.seq += 1
        band.settle()
        return True

    def pop(self, eligible: set[str]) -> Entry | None:
        now = self.clock()
        candidates = [
            (b.config.effective_rank(now - b.entries[0][1].enqueued_at), b.config.rank, n)
            for n, b in self.bands.items()
            if b.entries and n in eligible
        ]
        if not candidates:
            return None
        name = min(candidates)[2]
        band = self.bands[name]
        heads: dict[str, int] = {}
        for seq, item in band.entries:
            heads.setdefault(item.flow, seq)
        flow = min(heads, key=lambda f: (band.counters[f], heads[f]))
        index = next(i for i, (_, e) in enumerate(band.entries) if e.flow == flow)
        _, item = band.entries.pop(index)
        band.counters[flow] += self.fairness.cost(
            item.input_tokens, item.output_tokens_estimate, item.weight
        )
        self.after(name, band)
        return item

    def remove(self, item: Entry) -> bool:
        band = self.bands.get(item.band)
        if band is None:
            return False
        for i, (_, e) in enumerate(band.entries):
            if e is item:
                del band.entries[i]
                self.after(item.band, band)
                return True
        return False

    def correct(self, flow: str, name: str, delta_tokens: int, weight: float) -> None:
        band = self.bands.get(name)
        if band is None or not band.entries:
            return
        current = max(band.counters.get(flow, band.vtime), band.vtime)
        band.counters[flow] = max(
            current + self.fairness.output_weight * delta_tokens / weight, band.vtime
        )
        band.settle()

    def after(self, name: str, band: _RefBand) -> None:
        band.settle()
        if not band.entries and not band.configured:
            del self.bands[name]


@pytest.mark.parametrize("seed", range(12))
def test_matches_a_naive_reference_under_random_operations(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if seed % 2:  # rebuild the lazy heaps at every chance, to exercise compaction too
        monkeypatch.setattr(scheduler_module, "_COMPACT_SLACK", 0)
    rng = random.Random(seed)
    clock = FakeClock()
    fairness = FairnessConfig(1.0, 2.0)
    layouts = [
        (
            BandConfig("hi", 0, 40),
            BandConfig("mid", 1, 40, aging_rate=0.2, aging_cap=1.0),
            BandConfig("lo", 2, 40, aging_rate=0.1, aging_cap=2.5),
        ),
        (BandConfig("lo", 0, 30), BandConfig("hi", 1, 30, aging_rate=0.5, aging_cap=0.5)),
    ]
    sched = FairScheduler(fairness, clock)
    ref = _Reference(clock, fairness)
    sched.configure(layouts[0], fairness)
    ref.configure(layouts[0])
    queued: list[Entry] = []
    flows = [f"f{i}" for i in range(12)]
    for step in range(3000):
        clock.now += rng.choice([0.0, 0.0, 0.5, 3.0])
        op = rng.random()
        if op < 0.45:
            item = Entry(
                f"s{seed}-{step}",
                rng.choice(["hi", "mid", "lo"]),
                rng.choice(flows),
                rng.choice([0.5, 1.0, 3.0]),
                rng.randint(1, 500),
                rng.randint(0, 300),
                clock.now,
            )
            accepted = ref.push(item)
            if accepted:
                sched.push(item)
                queued.append(item)
            else:
                with pytest.raises((KeyError, QueueFull)):
                    sched.push(item)
        elif op < 0.8:
            eligible = {n for n in ("hi", "mid", "lo") if rng.random() < 0.8}
            expected = ref.pop(eligible)
            got = sched.pop(eligible.__contains__)
            assert got is expected
            if got is not None:
                queued.remove(got)
        elif op < 0.9 and queued:
            item = rng.choice(queued) if rng.random() < 0.9 else queued[0]
            assert sched.remove(item) is ref.remove(item) is True
            queued.remove(item)
            assert not sched.remove(item)
        elif op < 0.98:
            flow, where = rng.choice(flows), rng.choice(["hi", "mid", "lo"])
            estimated, actual = rng.randint(0, 300), rng.randint(0, 300)
            ref.correct(flow, where, actual - estimated, 2.0)
            sched.correct(flow, where, estimated, actual, 2.0)
        else:
            layout = rng.choice(layouts)
            ref.configure(layout)
            sched.configure(layout, fairness)
        assert sched.depths() == {n: len(b.entries) for n, b in ref.bands.items()}
        assert len(sched) == len(queued)
        for name, ref_band in ref.bands.items():
            counters = sched.counters(name)
            for flow in ref_band.backlogged():
                assert counters[flow] == pytest.approx(ref_band.counters[flow])
            for flow, value in counters.items():  # what is tracked is what matters
                assert value > ref_band.vtime or flow in ref_band.backlogged()


def test_drain_meter_rate_follows_dequeues_in_its_window() -> None:
    clock = FakeClock()
    meter = DrainMeter(window_s=10.0, clock=clock)
    assert meter.rate() == 0
    for _ in range(20):
        meter.record()
    assert meter.rate() == pytest.approx(2.0)
    clock.now += 11
    assert meter.rate() == 0


def test_a_flow_is_fresh_until_served_and_again_when_back_from_idle() -> None:
    """``Head.fresh``: the counter is the lift rule's floor, not service (replicas let such
    a flow win ties, ``extproc.core.peers``)."""
    sched = scheduler()
    sched.push(entry("api", "a"))
    sched.push(entry("api", "a"))
    head = sched.head("api")
    assert head is not None and head.fresh
    sched.pop()
    head = sched.head("api")
    assert head is not None and head.flow == "a" and not head.fresh  # served, still queued
    sched.pop()
    sched.push(entry("api", "b"))  # keeps the band busy while a is idle
    sched.push(entry("api", "a"))  # a back from idle
    heads = {}
    while (head := sched.head("api")) is not None:
        heads[head.flow] = head.fresh
        sched.pop()
    assert heads == {"b": True, "a": True}


# --------------------------------------------------------------------------- lookahead


def test_a_lookahead_takes_a_later_request_of_the_flow_charging_the_flow_the_same() -> None:
    sched = scheduler()
    a, b, c = (entry("api", "t", inp=10, rid=r) for r in "abc")
    other = entry("api", "u", inp=10, rid="u1")
    for e in (a, b, c, other):
        sched.push(e)
    last = Lookahead(3, lambda band, window: window[-1])
    assert sched.pop(lookahead=last) is c  # flow t's turn (earliest head), its third
    assert sched.counters("api")["t"] == 10.0  # charged as for its oldest
    assert a.passed_over == b.passed_over == 1
    assert sched.pop(lookahead=last) is other  # VTC between flows as before
    assert sched.pop(lookahead=last) is b
    assert sched.pop(lookahead=last) is a
    assert sched.pop(lookahead=last) is None


def test_no_request_is_passed_over_more_than_the_lookahead_size() -> None:
    sched = scheduler()
    entries = [entry("api", "t", rid=f"r{i}") for i in range(6)]
    for e in entries:
        sched.push(e)
    last = Lookahead(2, lambda band, window: window[-1])
    order = [sched.pop(lookahead=last) for _ in range(6)]
    # r0 is passed over twice (by r1, then r2), then it is the only choice.
    assert [e.request_id for e in order if e] == ["r1", "r2", "r0", "r4", "r5", "r3"]
    assert max(e.passed_over for e in entries) == 2


def test_a_request_passed_over_enough_ends_the_window_it_is_in() -> None:
    sched = scheduler()
    a, b, c = (entry("api", "t", rid=r) for r in "abc")
    for e in (a, b, c):
        sched.push(e)
    b.passed_over = 4
    seen: list[list[str]] = []

    def last(band: str, window: list[Entry]) -> Entry:
        seen.append([e.request_id for e in window])
        return window[-1]

    assert sched.pop(lookahead=Lookahead(4, last)) is b  # c would pass over b
    assert seen == [["a", "b"]]


def test_group_depth_counts_every_band_of_a_group_as_entries_come_and_go() -> None:
    bands = (BandConfig("chat@a", 0, 100, group="chat"), BandConfig("chat@b", 0, 100, group="chat"))
    sched = scheduler(bands)
    a1, a2, b1 = entry("chat@a"), entry("chat@a"), entry("chat@b")
    for e in (a1, a2, b1):
        sched.push(e)
    assert sched.group_depth("chat") == 3 and sched.group_depth("other") == 0
    sched.pop()
    sched.remove(b1)
    assert sched.group_depth("chat") == 1
    regrouped = (BandConfig("chat@a", 0, 100, group="talk"), bands[1])
    sched.configure(regrouped, FairnessConfig())  # a reload that regroups a busy band
    assert (sched.group_depth("chat"), sched.group_depth("talk")) == (0, 1)
    sched.configure((BandConfig("solo", 0, 100),), FairnessConfig())
    sched.push(entry("solo"))
    assert sched.group_depth("solo") == 1  # a band of no group counts as its own
