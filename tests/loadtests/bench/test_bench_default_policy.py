"""``policy: default`` in a scenario: the shipped policy, rescaled to the run's speedup (also
after ``--speedup``), validated like any policy, and named with its scale in the results;
and every scenario file under ``loadtests/scenarios`` loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import extproc.policy
from extproc.policy import DEFAULT_POLICY_PATH, load_policy
from loadtests.bench import report
from loadtests.bench.cli import policy_note, scenario_json
from loadtests.bench.overhead.scenario import parse_overhead
from loadtests.bench.scenario import (
    SCENARIO_DIR,
    ScenarioError,
    load_scenario,
    parse_scenario,
    read_document,
)
from loadtests.des.model import parse_des

FLOOD_SCENARIOS = ("flood-4seat", "flood-8seat", "flood-32seat", "flood-256seat", "flood-kv-bound")


def default_scenario(speedup: float = 4) -> dict[str, Any]:
    return {
        "name": "d",
        "duration_s": 40,
        "speedup": speedup,
        "policy": "default",
        "groups": [
            {
                "name": "chat",
                "api_key": "sk-chat-demo",
                "tenant": "chat-app",
                "tier": "interactive",
                "rate": 1.0,
                "prompt_tokens": 100,
                "max_tokens": 32,
            },
            {
                "name": "api",
                "api_key": "sk-api-demo",
                "tenant": "code-review",
                "tier": "api",
                "concurrency": 2,
                "prompt_tokens": 100,
                "max_tokens": 32,
            },
            {
                "name": "flood",
                "api_key": "sk-batch-demo",
                "tenant": "nightly-batch",
                "tier": "batch",
                "concurrency": 8,
                "prompt_tokens": 300,
                "max_tokens": 64,
                "stream": False,
            },
        ],
        "arms": [{"name": "fifo", "kind": "fifo"}, {"name": "fairlane", "kind": "fairlane"}],
    }


def hand_written(speedup: float = 20) -> dict[str, Any]:
    """The same scenario on the hand-written x20 policy (which has no api tenant)."""
    data = default_scenario(speedup)
    data["policy"] = str(SCENARIO_DIR / "policies" / "bench-x20.yaml")
    data["groups"] = [g for g in data["groups"] if g["name"] != "api"]
    return data


@pytest.mark.parametrize("path", sorted(SCENARIO_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_scenario_file_loads(path: Path) -> None:
    document = read_document(path)
    if document.kind == "overhead":
        assert parse_overhead(document).name == path.stem
    elif document.kind == "des":
        des = parse_des(document)
        assert des.name == path.stem and des.fleet.engines >= 1
    else:
        scenario = load_scenario(path)
        assert scenario.name == path.stem
        assert scenario.targets


@pytest.mark.parametrize("name", FLOOD_SCENARIOS)
def test_flood_scenarios(name: str) -> None:
    scenario = load_scenario(name)
    assert scenario.policy == DEFAULT_POLICY_PATH
    assert scenario.policy_rescaled and scenario.policy_scale == scenario.speedup
    assert [a.name for a in scenario.arms] == [
        "fifo",
        "vllm-priority",  # the engine's own priority queue, no gateway: the reference
        "fairlane",
        "fairlane-no-flood",
        "fifo-no-flood",
        "vllm-router",  # peers: the cheapest router, and vLLM's priority behind LiteLLM
        "litellm-priority",
    ]
    assert {t.metric for t in scenario.targets} == {"ttft_p90", "goodput"}
    assert scenario.seed and scenario.max_requests <= 20_000
    # sized for a 2-core machine shared with others: about 25 wall seconds of load and a few
    # of drain per arm, 7 arms in ~4 minutes
    assert scenario.wall_duration_s <= 25
    assert scenario.drain_s / scenario.speedup <= 5
    # the faithful scrape interval (0.1 simulated s) costs each simulator ~10 x speedup
    # /metrics renders per wall second: the scenarios keep the speedup low
    assert scenario.speedup <= 3


def test_default_is_the_shipped_policy_rescaled(tmp_path: Path) -> None:
    scenario = parse_scenario(default_scenario(4), tmp_path / "d.yaml")
    assert scenario.policy == DEFAULT_POLICY_PATH and scenario.policy_scale == 4
    written = scenario.policy_file(tmp_path / "run")
    assert written == tmp_path / "run" / "policy-default-x4.yaml"
    policy = load_policy(written)
    assert policy.tiers[0].queue_deadline_s == 2.5  # 10 s / 4
    assert policy.backpressure.scrape_interval_s == 0.025
    # --speedup follows: rescaled to the new speedup, no other file needed
    faster = scenario.with_overrides(speedup=10)
    assert faster.policy_scale == 10
    assert load_policy(faster.policy_file(tmp_path / "run10")).tiers[0].queue_deadline_s == 1
    # a hand-written policy is used as it is, at any speedup
    written_as = parse_scenario(hand_written(4), tmp_path / "h.yaml").with_overrides(speedup=10)
    assert written_as.policy_scale is None
    assert written_as.policy_file(tmp_path / "h") == written_as.policy
    assert not (tmp_path / "h").exists()


def test_the_speedup_warning_is_for_hand_written_policies_only(tmp_path: Path) -> None:
    default = parse_scenario(default_scenario(4), tmp_path / "d.yaml")
    note = policy_note(default.with_overrides(speedup=10), written_for=4)
    assert note is not None and "warning" not in note
    assert "divided by 10" in note
    scenario = parse_scenario(hand_written(20), tmp_path / "h.yaml")
    assert policy_note(scenario, written_for=20) is None
    warning = policy_note(scenario.with_overrides(speedup=5), written_for=20)
    assert warning is not None
    assert warning.startswith("warning: the policy") and "wall-clock seconds" in warning


def test_results_and_report_name_the_policy_and_its_scale(tmp_path: Path) -> None:
    scenario = parse_scenario(default_scenario(4), tmp_path / "d.yaml")
    written = scenario.policy_file(tmp_path)
    data = scenario_json(scenario, (), written)
    assert data["policy"].endswith("policies/default.yaml")
    assert data["policy_scale"] == 4
    assert data["policy_file"] == str(written.resolve())
    line = report.fleet_line(data)
    assert "with its durations divided by 4" in line and "policy-default-x4.yaml" in line
    data = scenario_json(parse_scenario(hand_written(20), tmp_path / "h.yaml"))
    assert data["policy_scale"] is None
    assert data["policy_file"] == data["policy"]
    assert "divided" not in report.fleet_line(data)


def test_keys_are_checked_against_the_default_policy(tmp_path: Path) -> None:
    data = default_scenario()
    data["groups"][0]["api_key"] = "sk-power-a"  # bench-x20's tenant, not the default's
    with pytest.raises(ScenarioError, match=r"groups\[0\]\.api_key: 'sk-power-a' is not a key"):
        parse_scenario(data, tmp_path / "d.yaml")


def test_a_broken_default_is_reported_with_its_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = yaml.safe_load(DEFAULT_POLICY_PATH.read_text())
    broken = tmp_path / "default.yaml"
    # valid as written, but divided by 4 the deadline underflows to 0: not a valid policy
    source["tiers"][1]["queue_deadline_s"] = 5e-324
    broken.write_text(yaml.safe_dump(source, sort_keys=False))
    monkeypatch.setattr(extproc.policy, "DEFAULT_POLICY_PATH", broken)
    load_policy(broken)  # the source itself is fine
    line = next(
        i
        for i, text in enumerate(broken.read_text().splitlines(), 1)
        if "queue_deadline_s: 5.0e-324" in text
    )
    with pytest.raises(ScenarioError) as info:
        parse_scenario(default_scenario(4), tmp_path / "d.yaml")
    message = str(info.value)
    assert f"{broken} rescaled for speedup 4 is not a valid policy" in message
    assert f"{broken}:{line}: tiers[1].queue_deadline_s:" in message
    assert "(after dividing its durations by 4)" in message
    # at speedup 1 the same file is fine; --speedup 4 then fails the same way
    scenario = parse_scenario(default_scenario(1), tmp_path / "d.yaml")
    with pytest.raises(ScenarioError, match=r"--speedup 4: the default policy rescaled"):
        scenario.with_overrides(speedup=4)
    # a source that is invalid as written: its own errors, file and line
    broken.write_text(broken.read_text().replace("queue_limit: 1024", "queue_limit: -1"))
    with pytest.raises(ScenarioError, match=rf"{broken}:\d+: tiers\[1\]\.queue_limit"):
        parse_scenario(default_scenario(1), tmp_path / "d.yaml")
