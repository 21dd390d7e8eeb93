"""An A/B bench scenario's fairlane arm on the virtual clock (``loadtests.des.ab``): the
bench's own requests, policy and engine flags, summarised by the bench's statistics."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from loadtests.bench.scenario import ScenarioError, load_scenario
from loadtests.bench.workload import client_shapes, open_loop_schedule
from loadtests.des.ab import WallCosts, engine_config, policy_file, simulate_arm
from loadtests.sim.engine import Policy


def test_the_simulation_sends_the_benchs_seeded_requests(tmp_path: Path) -> None:
    scenario = load_scenario("batch-flood").with_overrides(duration_s=120)
    records, summary = simulate_arm(scenario, tmp_path)
    chat, flood = scenario.group("chat"), scenario.group("flood")
    arrivals = open_loop_schedule(chat, scenario.seed, scenario.duration_s, 10**6)
    sent = sorted((r.start_s, r.prompt_tokens_sent) for r in records if r.group == "chat")
    assert [p for _, p in sent] == [s.prompt_tokens for s in arrivals]
    assert [t for t, _ in sent] == pytest.approx([s.at_s for s in arrivals])
    # 96 flood clients from the start, each sending its own seeded sequence
    first = sorted(r.prompt_tokens_sent for r in records if r.group == "flood" and r.start_s == 0)
    assert first == sorted(
        next(client_shapes(flood, scenario.seed, k)).prompt_tokens for k in range(96)
    )
    ok = [r for r in records if r.ok]
    assert ok and all(r.completion_tokens == r.max_tokens for r in ok)
    assert all(r.prompt_tokens == r.prompt_tokens_sent for r in ok)
    assert summary.by_tier["interactive"].ok > 0 and summary.by_tier["batch"].goodput > 0


def test_the_policy_is_in_simulated_seconds_and_the_engines_follow_the_flags(
    tmp_path: Path,
) -> None:
    scenario = load_scenario("batch-flood")
    policy = yaml.safe_load(policy_file(scenario, tmp_path).read_text())
    tiers = {t["name"]: t for t in policy["tiers"]}
    assert tiers["interactive"]["queue_deadline_s"] == pytest.approx(10.0)  # 0.5 wall x 20
    assert tiers["interactive"]["slo_ttft_ms"] == 500
    assert tiers["batch"]["aging"]["seconds_per_rank"] == pytest.approx(50.0)
    assert tiers["batch"]["gate"]["max_itl_ms"] == 150  # already simulated time
    assert policy["backpressure"]["scrape_interval_s"] == pytest.approx(1.0)
    config = engine_config(scenario, step_s=0.02)
    assert (config.max_num_seqs, config.num_gpu_blocks) == (16, 1200)
    assert config.policy is Policy.PRIORITY
    assert config.profile.base_s == pytest.approx(engine_config(scenario).profile.base_s + 0.02)


def test_a_slower_step_and_a_longer_path_make_the_answers_later(tmp_path: Path) -> None:
    scenario = load_scenario("power-user").with_overrides(duration_s=120)
    _, plain = simulate_arm(scenario, tmp_path / "plain", WallCosts(forward_s=0, response_s=0))
    _, slow = simulate_arm(scenario, tmp_path / "slow", WallCosts(step_s=0.002))
    light = "tenant-b"
    assert slow.by_tenant[light].e2e_p50 > 1.3 * plain.by_tenant[light].e2e_p50  # type: ignore[operator]
    assert slow.total.goodput < 0.8 * plain.total.goodput


def test_what_the_simulation_cannot_carry_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="shared_prefix"):
        simulate_arm(load_scenario("shared-prefix"), tmp_path)


def test_traffic_that_bypasses_the_gateway_is_refused(tmp_path: Path) -> None:
    scenario = load_scenario("smoke")
    group = dataclasses.replace(scenario.groups[0], direct=True)
    with pytest.raises(ScenarioError, match="direct"):
        simulate_arm(dataclasses.replace(scenario, groups=(group, *scenario.groups[1:])), tmp_path)
