"""The overload control law: plain arithmetic, one call per control period."""

from __future__ import annotations

import itertools

import pytest

from extproc.core.overload import OverloadControl, OverloadSettings

SETTINGS = OverloadSettings(
    high_lag_s=0.020, low_lag_s=0.005, max_cut=0.25, min_step=0.05, max_shed=0.95, recover_step=0.05
)
HIGH = 0.050  # well above high_lag_s
BAND = 0.010  # between low_lag_s and high_lag_s
LOW = 0.001  # below low_lag_s


def control() -> OverloadControl:
    return OverloadControl(SETTINGS)


def test_starts_idle_and_stays_idle_while_keeping_up() -> None:
    c = control()
    assert c.shed_fraction == 0.0 and not c.overloaded
    for _ in range(5):
        assert c.period(LOW) == 0.0
        assert c.period(BAND) == 0.0
    assert not c.overloaded


def test_rises_while_lagging() -> None:
    c = control()
    values = [c.period(HIGH) for _ in range(4)]
    assert values[0] > 0 and c.overloaded
    assert all(b > a for a, b in itertools.pairwise(values))
    assert c.last_lag_s == HIGH


def test_cuts_what_gets_through_in_proportion_to_how_far_behind() -> None:
    c = control()  # high_lag_s 20 ms, max_cut 0.25
    # 25 ms behind: one such period is a hiccup; the second confirms it, and then let
    # through 20/25 of what got through.
    assert c.period(0.025) == 0.0 and not c.overloaded
    assert c.period(0.025) == pytest.approx(0.2)
    assert c.period(0.025) == pytest.approx(1 - 0.8 * 0.8)
    # Far behind: the cut per period is capped at max_cut.
    c = control()
    assert c.period(1.0) == pytest.approx(0.25)
    assert c.period(1.0) == pytest.approx(1 - 0.75 * 0.75)
    # Just past the bound the proportional cut is below min_step: min_step is taken.
    c = control()
    assert [c.period(0.0201) for _ in range(4)] == pytest.approx([0.0, 0.05, 0.10, 0.15])


def test_one_period_a_little_over_the_bound_is_a_hiccup() -> None:
    """A single period between the bound and twice it (a collection, the machine's other
    processes) turns nothing away; twice the bound does at once."""
    c = control()
    for _ in range(5):
        assert c.period(0.030) == 0.0
        assert c.period(LOW) == 0.0
    assert not c.overloaded
    assert c.period(0.030, busy=0.1) == 0.0 and c.period(0.030) == 0.0  # not busy: no streak
    assert c.period(2.5 * SETTINGS.high_lag_s) > 0.0 and c.overloaded


def test_rises_by_at_least_min_step() -> None:
    # Near the top, just past the bound, what a proportional step adds is small (below
    # min_step); min_step still applies.
    c = control()
    c.shed_fraction = 0.85
    c.behind = True  # already turning requests away: no confirmation needed
    assert c.period(SETTINGS.high_lag_s * 1.05) == pytest.approx(0.85 + SETTINGS.min_step)
    for start in (0.0, 0.3, 0.6):
        c.shed_fraction = start
        assert c.period(HIGH) >= start + SETTINGS.min_step - 1e-12


def test_never_past_max_shed() -> None:
    c = control()
    values = [c.period(1.0) for _ in range(50)]
    assert max(values) == pytest.approx(SETTINGS.max_shed)
    assert all(v <= SETTINGS.max_shed for v in values)
    assert values[-1] == pytest.approx(SETTINGS.max_shed)
    assert values == sorted(values)  # monotone while lagging


def test_falls_by_recover_step_below_low_and_never_below_zero() -> None:
    c = control()
    c.period(HIGH)
    c.period(HIGH)
    start = c.shed_fraction
    assert c.period(LOW) == pytest.approx(start - SETTINGS.recover_step)
    assert c.period(LOW) == pytest.approx(start - 2 * SETTINGS.recover_step)
    for _ in range(100):
        c.period(LOW)
    assert c.shed_fraction == 0.0
    assert not c.overloaded


def test_holds_in_the_band() -> None:
    c = control()
    c.period(HIGH)
    held = c.shed_fraction
    for lag in (BAND, SETTINGS.low_lag_s, SETTINGS.high_lag_s, 0.015):
        assert c.period(lag) == held  # the thresholds themselves are inside the band
    assert c.overloaded


def test_overloaded_means_anything_is_shed() -> None:
    c = control()
    c.period(HIGH)
    assert c.overloaded
    while c.shed_fraction > 0:
        c.period(LOW)
        assert c.overloaded == (c.shed_fraction > 0)
    assert not c.overloaded


def test_from_max_to_nothing_in_a_second_of_default_periods() -> None:
    c = OverloadControl()
    for _ in range(100):
        c.period(1.0)
    assert c.shed_fraction == pytest.approx(c.settings.max_shed)
    periods = 0
    while c.overloaded:
        c.period(0.0)
        periods += 1
    assert periods * c.settings.period_s <= 1.0


def test_behind_while_using_little_cpu_is_not_overload() -> None:
    """Starved by something else on the machine: shedding would only lose requests."""
    c = control()
    idle_cpu = c.settings.min_busy / 2
    assert c.period(HIGH, busy=idle_cpu) == 0.0
    c.period(HIGH, busy=1.0)
    shed = c.shed_fraction
    assert shed > 0
    assert c.period(HIGH, busy=idle_cpu) == pytest.approx(shed - c.settings.recover_step)


def test_a_flood_of_the_least_urgent_tier_is_refused_by_the_service_not_by_envoy() -> None:
    """Envoy cannot tell tiers apart: while the least urgent tier is most of what arrives,
    the service refuses that tier and Envoy turns nothing away (chat is never shed for a
    batch flood)."""
    c = control()
    for _ in range(10):
        for least_urgent in (True, True, True, False):  # three batch requests to one chat
            c.handled(least_urgent)
        assert c.period(HIGH) == 0.0
        assert c.behind and c.overloaded
    while c.overloaded:  # caught up: the tier is let in again
        c.period(LOW)
    assert not c.behind


def test_envoy_sheds_when_the_least_urgent_tier_is_a_small_share() -> None:
    c = control()
    for least_urgent in (True, False, False, False):
        c.handled(least_urgent)
    assert c.period(HIGH) > 0.0 and c.behind
    # the counts are per period: with none decided, the share is nothing, Envoy sheds more
    before = c.shed_fraction
    assert c.period(HIGH) > before


def test_a_batch_flood_after_envoy_shedding_lets_the_envoy_share_fall() -> None:
    c = control()
    c.period(HIGH)  # nothing decided: Envoy sheds
    shed = c.shed_fraction
    for _ in range(4):
        c.handled(True)
    assert c.period(HIGH) == pytest.approx(shed - SETTINGS.recover_step)
    assert c.behind
