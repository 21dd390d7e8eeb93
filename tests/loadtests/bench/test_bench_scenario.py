"""Scenario files: the shipped ones load, and every kind of mistake names file and field."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtests.bench.scenario import (
    SCENARIO_DIR,
    ScenarioError,
    load_scenario,
    parse_scenario,
)
from loadtests.bench.scenario.model import PEER_KINDS

POLICY = SCENARIO_DIR / "policies" / "bench-x20.yaml"


def minimal() -> dict[str, Any]:
    return {
        "name": "t",
        "duration_s": 60,
        "speedup": 10,
        "policy": str(POLICY),
        "groups": [
            {
                "name": "chat",
                "api_key": "sk-chat-demo",
                "tenant": "chat-app",
                "tier": "interactive",
                "rate": 1.0,
                "prompt_tokens": 100,
                "max_tokens": {"dist": "uniform", "min": 8, "max": 16},
            },
            {
                "name": "flood",
                "api_key": "sk-batch-demo",
                "tenant": "nightly-batch",
                "tier": "batch",
                "concurrency": 4,
                "prompt_tokens": {"dist": "lognormal", "median": 200, "max": 800},
                "max_tokens": 32,
                "stream": False,
            },
        ],
        "arms": [
            {"name": "fifo", "kind": "fifo"},
            {"name": "fairlane", "kind": "fairlane"},
            {"name": "quiet", "kind": "fairlane", "drop_groups": ["flood"]},
        ],
        "targets": [
            {
                "name": "ttft",
                "metric": "ttft_p99",
                "tier": "interactive",
                "arm": "fairlane",
                "baseline_arm": "quiet",
                "max": 1.5,
            },
            {
                "name": "jain",
                "metric": "jain",
                "tenants": ["chat-app", "nightly-batch"],
                "arm": "fairlane",
                "min": 0.9,
            },
        ],
    }


def errors_of(data: object, tmp_path: Path) -> str:
    path = tmp_path / "bad.yaml"
    with pytest.raises(ScenarioError) as info:
        parse_scenario(data, path)
    message = str(info.value)
    assert all(line.startswith(f"{path}: ") for line in message.splitlines() if line[:1] != " ")
    return message


@pytest.mark.parametrize("name", ["smoke", "batch-flood", "power-user", "starvation"])
def test_shipped_scenarios_load(name: str) -> None:
    scenario = load_scenario(name)
    assert scenario.name == name
    kinds = {a.kind for a in scenario.arms} - set(PEER_KINDS)
    assert kinds == {"fifo", "fairlane"}
    assert scenario.targets
    # sized for this machine: every arm's load lasts at most 30 wall seconds
    assert scenario.wall_duration_s <= 30


def test_minimal_scenario_parses(tmp_path: Path) -> None:
    scenario = parse_scenario(minimal(), tmp_path / "x.yaml")
    assert scenario.group("flood").closed_loop
    assert scenario.group("chat").max_tokens.kind == "uniform"
    assert [g.name for g in scenario.groups_of(scenario.arm("quiet"))] == ["chat"]
    assert scenario.targets[0].baseline_arm == "quiet"
    assert scenario.tiers == ("interactive", "batch")


def test_load_by_path_and_not_valid_yaml(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(minimal()))
    assert load_scenario(str(good)).name == "t"
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ScenarioError, match=r"broken\.yaml:2: YAML syntax error"):
        load_scenario(str(bad))
    with pytest.raises(ScenarioError, match="no such scenario"):
        load_scenario("no-such-scenario")


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d.pop("duration_s"), "duration_s: required"),
        (lambda d: d.update(speedup=0), "speedup: must be a number > 0"),
        (lambda d: d.update(colour="red"), "colour: unknown field"),
        (lambda d: d["groups"][0].update(concurrency=3), "groups[0]: needs exactly one of rate"),
        (lambda d: d["groups"][1].pop("concurrency"), "groups[1]: needs exactly one of rate"),
        (
            lambda d: d["groups"][0].update(prompt_tokens={"dist": "zipf"}),
            "groups[0].prompt_tokens.dist: must be fixed, uniform or lognormal",
        ),
        (
            lambda d: d["groups"][0].update(max_tokens={"dist": "uniform", "min": 9, "max": 2}),
            "groups[0].max_tokens.max: must be >= min",
        ),
        (lambda d: d["groups"][0].update(stream="yes"), "groups[0].stream: must be true or false"),
        (
            lambda d: d["groups"][0].update(api_key="sk-nobody"),
            "groups[0].api_key: 'sk-nobody' is not a key",
        ),
        (lambda d: d["groups"][0].update(tenant="someone"), "groups[0].tenant: 'someone', but"),
        (lambda d: d["groups"][1].update(name="chat"), "groups[1].name: duplicate group name"),
        (lambda d: d.update(policy="missing.yaml"), "policy: no such file"),
        (
            lambda d: d.update(backends={"flags": ["--speedup", "3"]}),
            "backends.flags: --speedup is set by the harness",
        ),
        (lambda d: d.update(backends={"profile": "gpu-9000"}), "backends.profile: unknown"),
        (
            lambda d: d.update(arms=[{"name": "fifo", "kind": "fifo"}]),
            "arms: needs at least one fairlane arm and one Envoy-only arm",
        ),
        (
            lambda d: d["arms"][2].update(drop_groups=["nope"]),
            "arms[2].drop_groups: unknown group 'nope'",
        ),
        (lambda d: d["targets"][0].update(arm="nope"), "targets[0].arm: unknown arm 'nope'"),
        (lambda d: d["targets"][0].update(metric="speed"), "targets[0].metric: must be one of"),
        (lambda d: d["targets"][0].update(min=1), "targets[0]: needs exactly one bound"),
        (lambda d: d["targets"][0].update(tier="gold"), "targets[0].tier: unknown tier 'gold'"),
        (lambda d: d["targets"][1].update(tenants=["chat-app"]), "targets[1]: jain takes"),
        (lambda d: d.update(warmup_s=90), "warmup_s: must be below duration_s"),
    ],
)
def test_mistakes_name_the_file_and_field(
    mutate: Callable[[dict[str, Any]], object], expected: str, tmp_path: Path
) -> None:
    data = minimal()
    mutate(data)
    assert expected in errors_of(data, tmp_path)


def test_every_mistake_is_reported_at_once(tmp_path: Path) -> None:
    data = minimal()
    data["speedup"] = -1
    data["groups"][0]["rate"] = "fast"
    message = errors_of(data, tmp_path)
    assert "speedup:" in message
    assert "groups[0].rate:" in message


def test_not_a_mapping(tmp_path: Path) -> None:
    assert "(top level): must be a mapping" in errors_of(["a"], tmp_path)


def test_overrides() -> None:
    scenario = load_scenario("batch-flood")
    changed = scenario.with_overrides(duration_s=100, speedup=5, arms=["fifo", "fairlane"])
    assert (changed.duration_s, changed.speedup) == (100, 5)
    assert [a.name for a in changed.arms] == ["fifo", "fairlane"]
    assert changed.warmup_s <= 25
    with pytest.raises(ScenarioError, match="--arms: unknown arm"):
        scenario.with_overrides(arms=["fifo", "lifo"])
    with pytest.raises(ScenarioError, match="--speedup must be > 0"):
        scenario.with_overrides(speedup=0)


def test_power_user_x5_is_power_user_slower_with_the_same_simulated_durations() -> None:
    """The replicas' A/B scenario: the same groups and targets at speedup 5, its policy's
    gateway-side durations four times bench-x20's, so each means the same simulated time."""
    from extproc.policy import load_policy

    fast, slow = load_scenario("power-user"), load_scenario("power-user-x5")
    assert (fast.speedup, slow.speedup) == (20, 5)
    assert slow.groups == fast.groups and slow.targets == fast.targets
    assert fast.policy is not None and slow.policy is not None
    quick, scaled = load_policy(fast.policy), load_policy(slow.policy)
    for a, b in zip(quick.tiers, scaled.tiers, strict=True):
        assert b.queue_deadline_s == 4 * a.queue_deadline_s
    assert scaled.backpressure.scrape_interval_s == 4 * quick.backpressure.scrape_interval_s


def test_power_user_x5_varied_differs_only_in_output_lengths_of_the_same_mean() -> None:
    """Its figures compare with power-user-x5's: the same fleet, policy, groups (but their
    output lengths) and targets."""
    fixed, varied = load_scenario("power-user-x5"), load_scenario("power-user-x5-varied")
    assert (varied.speedup, varied.policy, varied.targets) == (
        fixed.speedup,
        fixed.policy,
        fixed.targets,
    )
    assert len(varied.groups) == len(fixed.groups)
    for a, b in zip(fixed.groups, varied.groups, strict=True):
        assert dataclasses.replace(b, max_tokens=a.max_tokens) == a
        assert (a.max_tokens.kind, a.max_tokens.value) == ("fixed", 128)
        assert (b.max_tokens.kind, b.max_tokens.low, b.max_tokens.high) == ("uniform", 64, 192)
