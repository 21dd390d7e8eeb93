"""``fairlane bench`` with a tiny ``kind: overhead`` scenario, end to end through the real
Envoy, service and instant backend on loopback (about 15 s): every phase (saturation, the rates
with half capacity, concurrency 1, a 1 s overload and the recovery watch) of the default-policy
arm and of direct, the report's numbers present and sane, the plots written, nothing left
running; and a service killed during the
fairlane arm is named, the arm reported failed, everything stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.ops.cli import main
from extproc.ops.processes import ProcessGroup
from loadtests.bench.overhead import runner as overhead_runner
from loadtests.bench.overhead.driver import Started
from loadtests.bench.overhead.scenario import OverheadScenario
from loadtests.bench.peers.install import LITELLM, VLLM_ROUTER, missing_reason
from loadtests.bench.scenario import SCENARIO_DIR
from tests.pids import alive

pytestmark = pytest.mark.integration

TINY = f"""\
kind: overhead
name: overhead-tiny
description: CI check of the overhead runner, not a measurement.
fairlane_arms:
  fairlane: {{policy: {SCENARIO_DIR / "policies" / "overhead.yaml"}}}
  fairlane-default: {{policy: default, api_key: sk-chat-demo, seats: 256}}
rates: [50, half_capacity]
duration_s: 1
saturation_connections: 4
warmup_requests: 20
concurrency1_requests: 20
overload: {{factor: 2, duration_s: 1, timeout_s: 2, recovery_window_s: 0.5, recovery_max_s: 1}}
arms: [direct, fairlane, fairlane-default]
targets:
  - {{name: added p50, metric: added_p50_ms, rate: 50, max: 0.5}}
  - {{name: added p99, metric: added_p99_ms, rate: 50, max: 2}}
  - {{name: added p50 half, metric: added_p50_ms, rate: half_capacity, max: 0.5}}
  - {{name: saturation, metric: saturation_rps, min: 2000}}
  - {{name: per core, metric: rps_per_core_vs_envoy, min: 0.25}}
  - {{name: c1, metric: c1_added_p50_ms, max: 1}}
  - {{name: admitted, metric: overload_admitted_fraction, min: 0.9}}
  - {{name: within, metric: overload_answered_within_fraction, min: 1}}
  - {{name: envoy errors, metric: overload_envoy_errors, max: 0}}
  - {{name: timeouts, metric: overload_timeouts, max: 0}}
  - {{name: recovery, metric: recovery_s, max: 5}}
"""
ARM = "fairlane-default"
"""The fairlane arm the end-to-end run drives (the default policy: gates, scrapes, seats)."""


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "overhead-tiny.yaml"
    path.write_text(TINY)
    return path


def test_overhead_tiny_runs_both_arms_and_reports(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["bench", str(tiny), "--out", str(out), "--arms", f"direct,{ARM}"]) == 0
    printed = capsys.readouterr().out
    assert re.search(rf"(PASS|FAIL) \[{ARM}\] added p50: [\d.]+ <= 0.5", printed), printed

    data = json.loads((out / "results.json").read_text())
    assert data["failed_arms"] == {}
    assert list(data["arms"]) == [ARM, "direct"]  # the fairlane arm first: direct needs its rates
    fair, direct = data["arms"][ARM], data["arms"]["direct"]
    assert [r["mode"] for r in fair] == [
        "saturation",
        "rate",
        "rate",
        "concurrency1",
        "overload",
        "recovery",
    ]
    # direct also measures the backend alone at the numeric rate (the peers' baseline)
    assert [r["mode"] for r in direct] == ["saturation", "rate", "rate", "concurrency1", "backend"]
    assert direct[4]["target_rps"] == 50 and direct[4]["errors"] == 0
    for arm, rows in data["arms"].items():
        for row in rows[:4]:
            # the default policy's arm is not throttled (its backend's seats are declared)
            assert row["errors"] == 0, (arm, row)
            assert row["achieved_rps"] > 0 and row["requests"] > 0, (arm, row)
            assert 0 < row["p50_ms"] <= row["p99_ms"] < 1000, (arm, row)
            assert row["loadgen_cores"] > 0, (arm, row)
        for row in rows[:3]:
            assert row["cpu_cores"]["envoy"] > 0, (arm, row)
        assert ("service" in rows[0]["cpu_cores"]) is (arm == ARM)
    capacity = fair[0]["achieved_rps"]
    half = round(capacity / 2)
    assert data["half_capacity_rps"] == {ARM: half}
    assert (fair[2]["target_rps"], fair[2]["rate_label"]) == (half, "half_capacity")
    assert {r["target_rps"] for r in direct[1:3]} == {50, half}
    c1 = fair[3]
    assert c1["requests"] == 20 and 0 < c1["backend_p50_ms"] < c1["p50_ms"]
    # Three figures each rounded to 1 µs: their difference may be off by up to 1.5 µs.
    assert c1["c1_added_p50_ms"] == pytest.approx(c1["p50_ms"] - c1["backend_p50_ms"], abs=2e-3)
    overload, recovery = fair[4], fair[5]
    assert overload["target_rps"] == pytest.approx(2 * capacity, abs=0.1)
    # every request due was either sent (and classified) or counted unsent
    assert overload["sent"] + overload["unsent"] == int(2 * capacity * 1)
    assert sum(overload["outcomes"].values()) == overload["sent"] > 0
    assert overload["admitted_fraction"] == pytest.approx(
        overload["achieved_rps"] / capacity, abs=1e-3
    )
    assert overload["cpu_cores"]["service"] > 0
    assert recovery["baseline_p50_ms"] == fair[1]["p50_ms"]
    assert [w["t_s"] for w in recovery["windows"]] == [0.0, 0.5]
    assert recovery["recovered"] is (recovery["recovery_s"] is not None)

    targets = {t["name"]: t for t in data["targets"]}
    assert len(targets) == len(data["targets"]) == 11  # one fairlane arm: one verdict each
    assert {t["arm"] for t in data["targets"]} == {ARM}
    for t in targets.values():
        if t["name"] != "recovery":
            assert t["measured"] is not None and t["passed"] in (True, False), t
    assert targets["saturation"]["measured"] == capacity
    assert targets["timeouts"]["measured"] == overload["timeouts"]
    assert targets["added p50 half"]["measured"] == pytest.approx(
        fair[2]["p50_ms"] - next(r for r in direct if r["target_rps"] == half)["p50_ms"], abs=1e-3
    )

    report = (out / "report.md").read_text()
    assert "load generator the bottleneck?" in report and "machine CPU-bound?" in report
    assert f"| 50 req/s | {ARM} |" in report and "| saturation | direct |" in report
    assert re.search(rf"\*\*(PASS|FAIL)\*\* \[{ARM}\] saturation: [\d.]+ ≥ 2000", report)
    assert "## Concurrency 1" in report and "## Overload and recovery" in report
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report)
    assert set(images) == {"latency.png", "added_latency.png", "saturation.png", "recovery.png"}
    for image in images:
        png = (out / image).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000, image
    for arm, pids in data["pids"].items():
        assert pids and not [p for p in pids.values() if alive(p)], arm


@pytest.fixture
def kill_service_after(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Kill the fairlane arm's service 0.5 s after it is up (a crash mid-run)."""
    killed: list[int] = []
    timers: list[threading.Timer] = []
    real = overhead_runner.start_arm

    def start_arm(arm: str, scenario: OverheadScenario, group: ProcessGroup) -> Started:
        started = real(arm, scenario, group)
        if "service" in started.pids:
            killed.append(started.pids["service"])
            timer = threading.Timer(0.5, os.kill, (started.pids["service"], signal.SIGKILL))
            timers.append(timer)
            timer.start()
        return started

    monkeypatch.setattr(overhead_runner, "start_arm", start_arm)
    yield killed
    for timer in timers:
        timer.cancel()


def test_overhead_names_a_component_that_died(
    tiny: Path,
    tmp_path: Path,
    kill_service_after: list[int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    tiny.write_text(TINY.replace("duration_s: 1", "duration_s: 2"))
    assert main(["bench", str(tiny), "--out", str(out), "--arms", "fairlane"]) == 1
    captured = capsys.readouterr()
    pid = kill_service_after[0]
    # (at saturation, or in the warm-up on a very slow machine)
    message = f"the service (pid {pid}) exited with signal SIGKILL during arm fairlane"
    assert message in captured.err
    assert "last lines of its log" in captured.err
    assert "fairlane: FAILED: ChildExited: " + message in captured.out
    data = json.loads((out / "results.json").read_text())
    assert message in data["failed_arms"]["fairlane"]
    assert "**Arm fairlane failed**" in (out / "report.md").read_text()
    assert not [p for p in data["pids"]["fairlane"].values() if alive(p)]


def test_overhead_runs_the_peers_beside_direct(tiny: Path, tmp_path: Path) -> None:
    """vllm-router and LiteLLM in place of Envoy + fairlane: their phases, what each whole
    gateway adds to the backend alone, and no target judging them. A peer that is not
    installed fails the test with how to install it."""
    for peer in (VLLM_ROUTER, LITELLM):
        reason = missing_reason(peer)
        if reason is not None:
            pytest.fail(reason, pytrace=False)
    out = tmp_path / "out"
    assert (
        main(["bench", str(tiny), "--out", str(out), "--arms", "vllm-router,litellm,direct"]) == 0
    )
    data = json.loads((out / "results.json").read_text())
    assert data["failed_arms"] == {} and data["targets"] == []
    for name in ("vllm-router", "litellm"):
        rows = data["arms"][name]
        assert [r["mode"] for r in rows] == ["saturation", "rate", "concurrency1"]
        for row in rows:
            assert row["errors"] == 0 and row["requests"] > 0, (name, row)
            assert row["cpu_cores"][name] >= 0, (name, row)
        # Saturation keeps the gateway busy; a few requests at concurrency 1 can cost a
        # Rust router less than the 0.001 of a core a phase row is rounded to.
        assert rows[0]["cpu_cores"][name] > 0, (name, rows[0])
        gateway = data["gateways"][name]
        assert gateway["processes"] == [name]
        assert gateway["rates"]["50"]["cpu_s_per_1000"] > 0
        assert gateway["concurrency1"]["added_p50_ms"] is not None
    report = (out / "report.md").read_text()
    assert "## The whole gateway, beside the peers" in report
    assert "| 50 req/s | the backend alone |" in report and "| 50 req/s | litellm |" in report
    for arm, pids in data["pids"].items():
        assert pids and not [p for p in pids.values() if alive(p)], arm
