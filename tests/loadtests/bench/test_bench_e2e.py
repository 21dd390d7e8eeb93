"""One real ``fairlane bench`` run on the smoke scenario: both arms, real Envoy, service and
simulators on loopback, a few wall seconds each; the report exists and nothing is left
running afterwards."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from extproc.ops.cli import main
from tests.pids import alive

pytestmark = pytest.mark.integration


def test_bench_smoke_runs_both_arms_and_stops_everything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    # 100 simulated seconds = 5 wall seconds per arm: room for batch to get idle capacity
    # past the gates even when the shared machine is busy.
    assert main(["bench", "smoke", "--out", str(out), "--duration", "100"]) == 0
    printed = capsys.readouterr().out
    assert "targets:" in printed and "report:" in printed

    report_md = (out / "report.md").read_text()
    assert "| fifo | fairlane |" in report_md
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report_md)
    assert {"queue_depth.png", "throughput.png", "service_share.png"} <= set(images)
    for image in images:
        assert (out / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", image
    data = json.loads((out / "results.json").read_text())
    assert data["failed_arms"] == {}
    assert set(data["arms"]) == {"fifo", "fairlane"}
    for name, arm in data["arms"].items():
        assert not arm["capped"], name  # else the arms' open-loop arrivals could differ
        for tier in ("interactive", "batch"):
            stats = arm["summary"]["by_tier"][tier]
            assert stats["ok"] > 0, (name, tier, stats, arm["cpu"])
        assert arm["cpu"]["cores"]["load-generator"] >= 0
        assert {"envoy", "sim-0"} <= set(arm["cpu"]["cores"])
        assert 0 <= arm["cpu"]["loop_lag_max_s"] < 5, arm["cpu"]
        assert 0 < arm["cpu"]["machine_peak"] <= 1, arm["cpu"]
        records = data["records"][name]
        assert records and all(r["arm"] == name for r in records)
        # usage came back: exact output lengths (ignore_eos) and prompt sizes
        ok = [r for r in records if r["ok"]]
        assert [r for r in ok if r["completion_tokens"] != r["max_tokens"]] == []
        assert [r for r in ok if r["prompt_tokens"] != r["prompt_tokens_sent"]] == []
        for pid in arm["pids"].values():
            assert not alive(pid), f"{name}: process {pid} still running"
    for target in data["targets"]:
        noisy = any(data["arms"][a]["cpu"]["warnings"] for a in ("fifo", "fairlane"))
        assert target["suspect"] is noisy
    assert "service" in data["arms"]["fairlane"]["pids"]
    assert "service" not in data["arms"]["fifo"]["pids"]
    # the same open-loop chat arrivals in both arms (seeded workload)
    chat = {
        name: sorted(r["index"] for r in data["records"][name] if r["group"] == "chat")
        for name in data["arms"]
    }
    assert chat["fifo"] == chat["fairlane"]
    fairlane_ok = [r for r in data["records"]["fairlane"] if r["ok"]]
    assert [r for r in fairlane_ok if r["served_tier"] != r["tier"]] == []


def test_bench_bad_scenario_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nspeedup: fast\n")
    assert main(["bench", str(bad), "--out", str(tmp_path / "o")]) == 1
    assert "speedup: must be a number > 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
