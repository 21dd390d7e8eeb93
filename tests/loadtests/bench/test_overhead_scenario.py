"""The ``kind: overhead`` scenario file: the shipped one loads, mistakes name file:line and
field, command-line overrides are checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.bench.overhead.scenario import parse_overhead
from loadtests.bench.scenario import SCENARIO_DIR, ScenarioError, load_scenario, read_document


def test_shipped_overhead_scenario() -> None:
    document = read_document("overhead")
    assert document.kind == "overhead"
    scenario = parse_overhead(document)
    assert scenario.rates == (100.0, 500.0, 1000.0)
    assert scenario.arms == ("direct", "fairlane")
    assert scenario.policy.name == "overhead.yaml"
    by_metric = {t.metric: t for t in scenario.targets}
    assert (by_metric["added_p50_ms"].rate, by_metric["added_p50_ms"].bound) == (500.0, 0.5)
    assert (by_metric["added_p99_ms"].op, by_metric["added_p99_ms"].bound) == ("max", 2.0)
    assert (by_metric["saturation_rps"].op, by_metric["saturation_rps"].bound) == ("min", 2000)
    assert scenario.with_overrides(duration_s=2.5).duration_s == 2.5
    assert scenario.with_overrides(arms=["fairlane"]).arms == ("fairlane",)
    with pytest.raises(ScenarioError, match="--arms: unknown arm"):
        scenario.with_overrides(arms=["fifo"])
    with pytest.raises(ScenarioError, match="--duration must be > 0"):
        scenario.with_overrides(duration_s=0)


def test_an_overhead_file_is_not_an_ab_scenario() -> None:
    with pytest.raises(ScenarioError, match="kind 'overhead': not an A/B scenario"):
        load_scenario("overhead")


BAD = """\
kind: overhead
name: bad
policy: policies/nope.yaml
rates: [100, 0]
duration_s: fast
arms: [direct, fifo]
targets:
  - {name: p50, metric: added_p50_ms, rate: 300, max: 1}
  - {name: sat, metric: saturation_rps, rate: 100, min: 1}
  - {name: what, metric: p42, max: 1}
colour: blue
"""


def test_every_mistake_is_named_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD.replace("policies/nope.yaml", str(tmp_path / "nope.yaml")))
    with pytest.raises(ScenarioError) as info:
        parse_overhead(read_document(path))
    message = str(info.value)
    expected = [
        f"{path}:11: colour: unknown field",
        f"{path}:3: policy: no such file",
        f"{path}:4: rates: must be a list of requests/s > 0",
        f"{path}:5: duration_s: must be wall seconds > 0 per phase, got 'fast'",
        f"{path}:6: arms: must be a list of distinct arms out of ('direct', 'fairlane')",
        f"{path}:9: targets[1].rate: saturation_rps is measured at saturation: no rate",
        f"{path}:10: targets[2].metric: must be one of",
    ]
    for line in expected:
        assert line in message, (line, message)


def test_a_target_rate_must_be_one_of_the_rates(tmp_path: Path) -> None:
    path = tmp_path / "rate.yaml"
    path.write_text(
        BAD.replace("rates: [100, 0]", "rates: [100]")
        .replace("duration_s: fast", "duration_s: 1")
        .replace("arms: [direct, fifo]", "arms: [direct]")
        .replace("policies/nope.yaml", str(SCENARIO_DIR / "policies" / "overhead.yaml"))
        .replace("colour: blue\n", "")
    )
    with pytest.raises(ScenarioError) as info:
        parse_overhead(read_document(path))
    assert f"{path}:8: targets[0].rate: 300 is not one of the rates ['100']" in str(info.value)
