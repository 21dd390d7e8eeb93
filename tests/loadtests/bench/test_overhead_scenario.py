"""The ``kind: overhead`` scenario file: the shipped one loads, mistakes name file:line and
field, command-line overrides are checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.policy import DEFAULT_POLICY_PATH
from loadtests.bench.overhead.scenario import (
    HALF_CAPACITY,
    FairlaneArm,
    OverheadScenario,
    OverloadSpec,
    parse_overhead,
)
from loadtests.bench.scenario import SCENARIO_DIR, ScenarioError, load_scenario, read_document


def test_shipped_overhead_scenario() -> None:
    document = read_document("overhead")
    assert document.kind == "overhead"
    scenario = parse_overhead(document)
    assert scenario.rates == (100.0, HALF_CAPACITY)
    assert scenario.arms == ("fairlane", "fairlane-default", "vllm-router", "litellm", "direct")
    # the peers run before direct, which runs every fairlane arm's half capacity
    assert scenario.run_order == scenario.arms
    fairlane, default, shared, replicas = scenario.fairlane_specs
    assert fairlane.policy != default.policy
    assert (shared.name, shared.shared_state, shared.replicas) == ("fairlane-shared", True, 1)
    assert (replicas.name, replicas.shared_state, replicas.replicas) == (
        "fairlane-2-replicas",
        False,
        2,
    )
    # Defined but not run by default: --arms picks them.
    picked = scenario.with_overrides(arms=["fairlane", "fairlane-shared"])
    assert picked.arms == ("fairlane", "fairlane-shared")
    assert (fairlane.name, fairlane.policy.name, fairlane.api_keys) == (
        "fairlane",
        "overhead.yaml",
        ("sk-overhead",),
    )
    assert scenario.policy == fairlane.policy
    assert default.policy == DEFAULT_POLICY_PATH and default.seats == 256
    assert default.api_keys == ("sk-chat-demo",)
    # the replica arms send several keys in turn: Envoy hashes each key to one replica
    (two,) = (a for a in scenario.fairlane_specs if a.name == "fairlane-2-replicas")
    assert len(two.api_keys) >= 16 and two.api_keys[0] == "sk-overhead"
    assert scenario.concurrency1_requests > 0
    assert scenario.overload == OverloadSpec(
        factor=2, duration_s=30, answer_within_ms=50, timeout_s=5, max_connections=512
    )
    assert scenario.recovery_rate == 100.0
    by_key = {(t.metric, t.rate): t for t in scenario.targets}
    assert all(t.arm is None for t in scenario.targets)  # judged for every fairlane arm
    assert (by_key["added_p50_ms", 100.0].bound, by_key["added_p99_ms", 100.0].bound) == (0.5, 2)
    assert by_key["added_p50_ms", HALF_CAPACITY].bound == 0.5
    assert by_key["added_p99_ms", HALF_CAPACITY].bound == 2.0
    assert (
        by_key["rps_per_core_vs_envoy", None].op,
        by_key["rps_per_core_vs_envoy", None].bound,
    ) == (
        "min",
        0.25,
    )
    assert by_key["c1_added_p50_ms", None].bound == 1.0
    assert by_key["overload_admitted_fraction", None].bound == 0.9
    assert by_key["overload_answered_within_fraction", None].bound == 1.0
    assert by_key["overload_envoy_errors", None].bound == 0
    assert by_key["overload_timeouts", None].bound == 0
    assert (by_key["recovery_s", None].op, by_key["recovery_s", None].bound) == ("max", 5)
    short = scenario.with_overrides(duration_s=2.5)
    assert short.duration_s == 2.5 and short.overload is not None
    assert short.overload.duration_s == 2.5  # --duration sets the overload's too
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
        f"{path}:4: rates: must be a list of distinct requests/s > 0 (or half_capacity)",
        f"{path}:5: duration_s: must be wall seconds > 0 per phase, got 'fast'",
        f"{path}:6: arms: unknown arm(s) fifo: the arms are direct, fairlane",
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


OVERHEAD_POLICY = SCENARIO_DIR / "policies" / "overhead.yaml"
ARMS = f"""\
kind: overhead
name: arms
fairlane_arms:
  fairlane: {{policy: {OVERHEAD_POLICY}}}
  fairlane-default: {{policy: default, api_key: sk-chat-demo, seats: 256}}
rates: [100, half_capacity]
duration_s: 1
concurrency1_requests: 10
overload: {{factor: 2, duration_s: 1, recovery_max_s: 2}}
arms: [direct, fairlane-default, fairlane]
targets:
  - {{name: half, metric: added_p50_ms, rate: half_capacity, max: 0.5}}
  - {{name: c1, metric: c1_added_p50_ms, arm: fairlane-default, max: 1}}
  - {{name: rec, metric: recovery_s, max: 5}}
"""


def _parse(tmp_path: Path, text: str) -> OverheadScenario:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return parse_overhead(read_document(path))


def _errors(tmp_path: Path, text: str) -> str:
    with pytest.raises(ScenarioError) as info:
        _parse(tmp_path, text)
    return str(info.value)


def test_fairlane_arms_rates_and_the_new_phases(tmp_path: Path) -> None:
    scenario = _parse(tmp_path, ARMS)
    assert [a.name for a in scenario.fairlane_specs] == ["fairlane", "fairlane-default"]
    assert scenario.fairlane_arm("fairlane-default") == FairlaneArm(
        "fairlane-default", DEFAULT_POLICY_PATH, ("sk-chat-demo",), 256
    )
    assert scenario.fairlane_arm("fairlane") == FairlaneArm("fairlane", OVERHEAD_POLICY)
    # direct runs last, whatever the listed order: it needs the resolved half capacities
    assert scenario.run_order == ("fairlane-default", "fairlane", "direct")
    assert scenario.rates == (100.0, HALF_CAPACITY) and scenario.numeric_rates == (100.0,)
    assert scenario.concurrency1_requests == 10
    assert scenario.overload == OverloadSpec(factor=2, duration_s=1, recovery_max_s=2)
    assert scenario.recovery_rate == 100.0  # the lowest numeric rate
    half, c1, rec = scenario.targets
    assert (half.rate, half.arm) == (HALF_CAPACITY, None)
    assert (c1.arm, rec.rate) == ("fairlane-default", None)


def test_without_fairlane_arms_the_policy_is_the_fairlane_arm(tmp_path: Path) -> None:
    text = ARMS.replace(
        ARMS[ARMS.index("fairlane_arms:") : ARMS.index("rates:")], f"policy: {OVERHEAD_POLICY}\n"
    ).replace("arms: [direct, fairlane-default, fairlane]", "arms: [direct, fairlane]")
    text = text.replace("arm: fairlane-default, ", "")
    scenario = _parse(tmp_path, text)
    assert scenario.fairlane_specs == (FairlaneArm("fairlane", OVERHEAD_POLICY),)
    assert scenario.run_order == ("fairlane", "direct")


def test_new_fields_mistakes_are_named(tmp_path: Path) -> None:
    text = (
        ARMS.replace("api_key: sk-chat-demo", "api_key: sk-nobody")
        .replace("seats: 256", "seats: 0, grpc_server: grpcio")
        .replace("rates: [100, half_capacity]", "rates: [100, half, 100]")
        .replace("concurrency1_requests: 10", "concurrency1_requests: -1")
        .replace("factor: 2,", "factor: 2, colour: red, recovery_rate: 7,")
        .replace("arms: [direct, fairlane-default, fairlane]", "arms: [direct, fifo]")
        .replace("arm: fairlane-default,", "arm: nope,")
        .replace("metric: recovery_s,", "metric: recovery_s, rate: 100,")
    )
    message = _errors(tmp_path, text)
    path = tmp_path / "s.yaml"
    expected = [
        f"{path}:5: fairlane_arms.fairlane-default.seats: must be an integer >= 1, got 0",
        f"{path}:5: fairlane_arms.fairlane-default.grpc_server: unknown field",
        f"{path}:6: rates: must be a list of distinct requests/s > 0 (or half_capacity)",
        f"{path}:8: concurrency1_requests: must be an integer >= 0 (0: no phase), got -1",
        f"{path}:9: overload.colour: unknown field",
        f"{path}:9: overload.recovery_rate: 7 is not one of the numeric rates",
        f"{path}:10: arms: unknown arm(s) fifo: the arms are direct, fairlane",
        f"{path}:13: targets[1].arm: 'nope' is not a fairlane arm",
        f"{path}:14: targets[2].rate: recovery_s is not measured at a rate: no rate",
    ]
    for line in expected:
        assert line in message, (line, message)
    # the key is checked against the policy once the arm's other fields are right
    keyed = _errors(tmp_path, ARMS.replace("api_key: sk-chat-demo", "api_key: sk-nobody"))
    assert "fairlane_arms.fairlane-default.api_key: no tenant of" in keyed
    assert "has the key 'sk-nobody'" in keyed
    listed = _errors(
        tmp_path, ARMS.replace("api_key: sk-chat-demo", "api_key: [sk-chat-demo, sk-nobody]")
    )
    assert "has the key 'sk-nobody'" in listed and "sk-chat-demo'" not in listed
    empty = _errors(tmp_path, ARMS.replace("api_key: sk-chat-demo", "api_key: []"))
    assert "api_key: must be a non-empty string or list of them" in empty


def test_phases_a_target_needs_must_be_there(tmp_path: Path) -> None:
    text = (
        ARMS.replace("concurrency1_requests: 10\n", "")
        .replace("overload: {factor: 2, duration_s: 1, recovery_max_s: 2}\n", "")
        .replace("arms: [", "saturation_connections: 0\narms: [")
    )
    message = _errors(tmp_path, text)
    assert "targets[1].metric: c1_added_p50_ms needs concurrency1_requests > 0" in message
    assert "targets[2].metric: recovery_s needs the overload block" in message
    assert "saturation_connections: half_capacity and the overload need the saturation" in message
    both = ARMS.replace("fairlane_arms:", f"policy: {OVERHEAD_POLICY}\nfairlane_arms:")
    assert "policy: give the policy in fairlane_arms" in _errors(tmp_path, both)
    numeric = ARMS.replace("rates: [100, half_capacity]", "rates: [half_capacity]").replace(
        "  - {name: half, metric: added_p50_ms, rate: half_capacity, max: 0.5}\n", ""
    )
    assert "overload: the recovery needs a numeric rate" in _errors(tmp_path, numeric)
