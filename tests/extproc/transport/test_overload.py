"""The overload watch on a real event loop: a stalled loop or old requests make Envoy shed."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from functools import partial

import pytest

from extproc.core.overload import OverloadControl, OverloadSettings
from extproc.transport.overload import Ages, watch_overload
from extproc.transport.runtime import RuntimeLayer
from extproc.wire import SHED_RUNTIME_KEY
from tests.polling import until as poll_until

# Short periods, and bounds far above what a busy test machine's loop lags on its own. No
# CPU floor: these tests are about the lag and age signals; the floor has its own test.
SETTINGS = OverloadSettings(
    period_s=0.02, high_lag_s=0.1, low_lag_s=0.05, recover_step=0.05, min_busy=0.0
)
PROBE_S = 0.002
STALL_S = 0.3
WAIT_S = 10.0


def test_ages_mean_per_period() -> None:
    ages = Ages()
    assert ages.take_mean() == 0.0  # none observed
    for seconds in (0.1, 0.2, 0.6):
        ages.observe(seconds)
    assert ages.take_mean() == pytest.approx(0.3)
    assert ages.take_mean() == 0.0  # reset by the take
    ages.observe(2.0)
    assert ages.take_mean() == 2.0


class RecordingLayer(RuntimeLayer):
    """Remembers every value published for the shed key, changed or not."""

    def __init__(self) -> None:
        super().__init__()
        self.published: list[float] = []

    def publish(self, key: str, value: float) -> None:
        if key == SHED_RUNTIME_KEY:
            self.published.append(value)
        super().publish(key, value)


class RecordingControl(OverloadControl):
    """Remembers how far behind each control period was told the service is."""

    def __init__(self, settings: OverloadSettings = SETTINGS) -> None:
        super().__init__(settings)
        self.lags: list[float] = []
        self.busy: list[float] = []
        self.fractions: list[float] = []

    def period(self, lag_s: float, busy: float = 1.0) -> float:
        self.lags.append(lag_s)
        self.busy.append(busy)
        self.fractions.append(super().period(lag_s, busy))
        return self.fractions[-1]


class Watch:
    def __init__(self, settings: OverloadSettings = SETTINGS) -> None:
        self.control = RecordingControl(settings)
        self.layer = RecordingLayer()
        self.ages = Ages()

    def shed_percent(self) -> float | None:
        return self.layer.values.get(SHED_RUNTIME_KEY)

    def periods(self) -> int:
        return len(self.control.lags)


until = partial(poll_until, timeout_s=WAIT_S, every_s=0.005)
"""Polling finer than the 50 ms control period the tests wait on."""


@pytest.fixture
async def watch(request: pytest.FixtureRequest) -> AsyncIterator[Watch]:
    w = Watch(getattr(request, "param", SETTINGS))
    w.ages.observe(60.0)  # observed before the watch started: not this period's
    task = asyncio.create_task(watch_overload(w.control, w.layer, w.ages, probe_s=PROBE_S))
    try:
        await until(lambda: w.periods() >= 3, "three control periods")
        yield w
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_starts_at_zero_and_ignores_ages_from_before(watch: Watch) -> None:
    assert watch.layer.published[0] == 0
    assert watch.shed_percent() == 0
    assert max(watch.control.lags) < 60.0


async def test_a_stalled_loop_sheds_then_recovers(
    watch: Watch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="fairlane.overload")
    await until(lambda: watch.shed_percent() == 0, "idle at start")
    before = len(watch.layer.published)
    spin(STALL_S)  # the loop busy with its own work: its timers fire late
    await until(lambda: any(v > 0 for v in watch.layer.published[before:]), "shedding")
    assert max(watch.control.lags) >= STALL_S * 0.9  # the lag was measured, not guessed
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("overloaded" in r.getMessage() for r in warnings)
    # Idle again: the fraction falls back to nothing, and Envoy is told so.
    await until(lambda: watch.shed_percent() == 0 and not watch.control.overloaded, "recovery")
    assert watch.layer.published[-1] == 0


def spin(seconds: float) -> None:
    """Keep this thread, the event loop's, busy on the CPU (an overloaded service)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.parametrize("watch", [dataclasses.replace(SETTINGS, min_busy=0.5)], indirect=True)
async def test_a_loop_starved_of_cpu_by_others_does_not_shed(watch: Watch) -> None:
    """Stalled without using the CPU itself (time.sleep stands for an engine on the same
    cores, or a CPU limit): refusing requests would not give the time back."""
    await until(lambda: watch.shed_percent() == 0, "idle at start")
    before = watch.periods()
    time.sleep(STALL_S)
    await until(lambda: watch.periods() > before + 2, "periods after the stall")
    stalled = [i for i, lag in enumerate(watch.control.lags) if lag >= STALL_S * 0.9]
    assert stalled, watch.control.lags  # it did fall behind...
    assert all(watch.control.busy[i] < 0.5 for i in stalled)  # ...using little CPU
    assert all(v == 0 for v in watch.layer.published)


@pytest.mark.parametrize("watch", [dataclasses.replace(SETTINGS, min_busy=0.5)], indirect=True)
async def test_a_loop_busy_with_its_own_work_sheds(watch: Watch) -> None:
    await until(lambda: watch.shed_percent() == 0, "idle at start")
    spin(STALL_S)
    await until(lambda: watch.control.overloaded, "shedding")
    assert max(watch.control.busy) >= 0.5


async def test_old_requests_shed_while_the_loop_is_on_time(watch: Watch) -> None:
    await until(lambda: watch.shed_percent() == 0, "idle at start")
    before_published, before_periods = len(watch.layer.published), watch.periods()
    watch.ages.observe(1.5)
    watch.ages.observe(0.5)  # the mean of the period is taken: 1 s behind
    await until(lambda: any(v > 0 for v in watch.layer.published[before_published:]), "shedding")
    lags = watch.control.lags[before_periods:]
    assert any(lag == pytest.approx(1.0) for lag in lags)
    # taken once: the next periods see the loop's own lag again, and it recovers
    await until(lambda: watch.shed_percent() == 0 and not watch.control.overloaded, "recovery")
    assert max(watch.control.lags[-3:]) < SETTINGS.high_lag_s


async def test_each_period_publishes_its_fraction_in_percent(watch: Watch) -> None:
    await until(lambda: watch.shed_percent() == 0, "idle at start")
    for _ in range(3):
        watch.ages.observe(5.0)
        periods = watch.periods()
        await until(lambda: watch.periods() > periods, "a period")  # noqa: B023
    await until(lambda: watch.shed_percent() == 0, "recovery")
    # The first value is published before any period, then one per period, in percent.
    published = watch.layer.published
    assert published[0] == 0
    assert published[1:] == [round(f * 100) for f in watch.control.fractions]
    assert all(isinstance(v, int) for v in published)
    assert max(published) >= 3 * 5  # three overloaded periods, at least min_step each
