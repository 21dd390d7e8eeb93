"""The cross-check: the discrete-event run and the real run of the same A/B
scenario agree within 15 % on its headline figures.

Each case runs the scenario's fairlane arm for real (Envoy, the service and two HTTP
simulators on loopback, ~25-35 wall seconds) and as a simulation on the same seeded
requests (a few seconds). The engines' speed on this machine comes from the real run
(``calibrated_costs``), so a busy machine moves both sides alike. The check can fail: the
same simulation with the scenario's policy perturbed where it matters (``PERTURBED``)
must disagree with the same real run.

A real run during which the machine was over ``BUSY`` (other jobs beside it) is not a
result (at speedup 20 each wall millisecond of the machine's stalls is 20 simulated ones):
it is run once more, and skipped, saying so, if the machine stays that busy."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from loadtests.bench.scenario import Scenario, load_scenario
from loadtests.des.ab import simulate_arm
from loadtests.des.crosscheck import HEADLINES, compare, run, table
from tests.pids import alive

pytestmark = pytest.mark.integration

BUSY = 0.8
"""The machine's busiest second above which a real run says more about the machine."""


def _policy_in_wall_seconds(scenario: Scenario, _: Path) -> Scenario:
    """The x20 policy read as if in simulated seconds: deadlines, aging, the reserve's idle
    time and scrapes 20 times shorter (the translation's rescaling left out)."""
    return dataclasses.replace(scenario, policy_rescaled=True)


def _tenant_d_weighs_three(scenario: Scenario, directory: Path) -> Scenario:
    """tenant-d with three times power-a's fair-share weight."""
    policy = yaml.safe_load(scenario.policy.read_text())
    for tenant in policy["tenants"]:
        if tenant["name"] == "tenant-d":
            tenant["weight"] = 3
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / scenario.policy.name
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    return dataclasses.replace(scenario, policy=path)


PERTURBED: dict[str, Callable[[Scenario, Path], Scenario]] = {
    "batch-flood": _policy_in_wall_seconds,
    "power-user": _tenant_d_weighs_three,
}


@pytest.mark.parametrize("name", ["batch-flood", "power-user"])
def test_the_simulation_agrees_with_the_real_arm_on_the_headline_figures(
    name: str, tmp_path: Path
) -> None:
    scenario = load_scenario(name)
    check = run(scenario, tmp_path / "first")
    _all_stopped(check.pids)
    if not check.agrees and check.machine_peak > BUSY:
        check = run(scenario, tmp_path / "again")
        _all_stopped(check.pids)
        if not check.agrees and check.machine_peak > BUSY:
            pytest.skip(f"the machine was over {BUSY:.0%} busy twice: not a result\n{table(check)}")
    shown = table(check)
    headlines = [row for row in check.rows if row.asserted]
    assert len(headlines) == len(HEADLINES[name]) and all(
        row.real is not None and row.des is not None for row in headlines
    ), shown
    assert check.agrees, shown
    # The same requests reached both: every chat arrival or closed-loop client's requests.
    assert check.des.total.sent > 0.8 * check.real.total.sent, shown
    perturbed = PERTURBED[name](scenario, tmp_path / "perturbed")
    _, wrong = simulate_arm(perturbed, tmp_path / "perturbed", check.costs)
    control = compare(HEADLINES[name], check.real, wrong)
    assert not all(row.agrees for row in control), (shown, control)


def _all_stopped(pids: dict[str, int]) -> None:
    assert {"envoy", "service", "sim-0", "sim-1"} <= set(pids)
    for process, pid in pids.items():
        assert not alive(pid), f"{process} (pid {pid}) still running"
