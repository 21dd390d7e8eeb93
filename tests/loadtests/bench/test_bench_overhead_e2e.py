"""``fairlane bench`` with a tiny ``kind: overhead`` scenario, end to end through the real
Envoy, service and instant backend on loopback (about 10 s): the report's numbers are present
and sane, the plots are written, nothing is left running; and a service killed during the
fairlane arm is named, the arm reported failed, everything stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.ops.cli import main
from extproc.ops.processes import ProcessGroup
from loadtests.bench.overhead import runner as overhead_runner
from loadtests.bench.overhead.scenario import OverheadScenario
from loadtests.bench.scenario import SCENARIO_DIR
from tests.pids import alive

pytestmark = pytest.mark.integration

TINY = f"""\
kind: overhead
name: overhead-tiny
description: CI check of the overhead runner, not a measurement.
policy: {SCENARIO_DIR / "policies" / "overhead.yaml"}
rates: [50]
duration_s: 1
saturation_connections: 4
warmup_requests: 20
arms: [direct, fairlane]
targets:
  - {{name: added p50, metric: added_p50_ms, rate: 50, max: 0.5}}
  - {{name: added p99, metric: added_p99_ms, rate: 50, max: 2}}
  - {{name: saturation, metric: saturation_rps, min: 2000}}
"""


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "overhead-tiny.yaml"
    path.write_text(TINY)
    return path


def test_overhead_tiny_runs_both_arms_and_reports(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["bench", str(tiny), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"(PASS|FAIL) added p50: [\d.]+ <= 0.5", printed), printed

    data = json.loads((out / "results.json").read_text())
    assert data["failed_arms"] == {}
    assert set(data["arms"]) == {"direct", "fairlane"}
    for arm, rows in data["arms"].items():
        assert [r["mode"] for r in rows] == ["rate", "saturation"], arm
        for row in rows:
            assert row["errors"] == 0, (arm, row)
            assert row["achieved_rps"] > 0 and row["requests"] > 0, (arm, row)
            assert 0 < row["p50_ms"] <= row["p99_ms"] < 1000, (arm, row)
            assert row["cpu_cores"]["envoy"] > 0 and row["loadgen_cores"] > 0, (arm, row)
        assert ("service" in rows[0]["cpu_cores"]) is (arm == "fairlane")
    direct, fairlane = data["arms"]["direct"][0], data["arms"]["fairlane"][0]
    # the gateway's extra gRPC round trips cost something (noise allowed for a busy machine)
    assert fairlane["p50_ms"] - direct["p50_ms"] > -0.5, (direct, fairlane)
    assert data["arms"]["fairlane"][1]["rps_per_service_core"] > 0
    targets = {t["metric"]: t for t in data["targets"]}
    assert set(targets) == {"added_p50_ms", "added_p99_ms", "saturation_rps"}
    for t in targets.values():
        assert t["measured"] is not None and t["passed"] in (True, False), t
    assert targets["saturation_rps"]["measured"] == data["arms"]["fairlane"][1]["achieved_rps"]

    report = (out / "report.md").read_text()
    assert "load generator the bottleneck?" in report and "machine CPU-bound?" in report
    assert "| 50 req/s | fairlane |" in report and "| saturation | direct |" in report
    assert re.search(r"\*\*(PASS|FAIL)\*\* saturation: [\d.]+ ≥ 2000", report)
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report)
    assert set(images) == {"latency.png", "added_latency.png", "saturation.png"}
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

    def start_arm(
        arm: str, scenario: OverheadScenario, group: ProcessGroup
    ) -> tuple[int, dict[str, Any]]:
        port, pids = real(arm, scenario, group)
        if "service" in pids:
            killed.append(pids["service"])
            timer = threading.Timer(0.5, os.kill, (pids["service"], signal.SIGKILL))
            timers.append(timer)
            timer.start()
        return port, pids

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
    # (at 50 req/s, or in the warm-up on a very slow machine)
    message = f"the service (pid {pid}) exited with signal SIGKILL during arm fairlane"
    assert message in captured.err
    assert "last lines of its log" in captured.err
    assert "fairlane: FAILED: ChildExited: " + message in captured.out
    data = json.loads((out / "results.json").read_text())
    assert message in data["failed_arms"]["fairlane"]
    assert "**Arm fairlane failed**" in (out / "report.md").read_text()
    assert not [p for p in data["pids"]["fairlane"].values() if alive(p)]
