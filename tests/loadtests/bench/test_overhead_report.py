"""The overhead report's verdicts from phase rows: targets (added latency = fairlane minus
direct at the same rate; saturation from the fairlane arm), suspect marks, bottleneck lines,
and the markdown's plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtests.bench.overhead.report import other_cores, render_markdown, write_report
from loadtests.bench.overhead.scenario import OverheadScenario, OverheadTarget
from loadtests.bench.overhead.verdicts import evaluate


def row(mode: str, rate: float | None, p50: float, p99: float, **extra: Any) -> dict[str, Any]:
    base = {
        "mode": mode,
        "target_rps": rate,
        "achieved_rps": rate or 1500.0,
        "requests": 100,
        "errors": 0,
        "send_late_p99_ms": 1.0 if rate else None,
        "p50_ms": p50,
        "p99_ms": p99,
        "cpu_cores": {"envoy": 0.1, "backend": 0.05},
        "loadgen_cores": 0.05,
        "machine_busy": 0.3,
        "rps_per_service_core": None,
    }
    base.update(extra)
    return base


SCENARIO = OverheadScenario(
    name="t",
    description="d",
    policy=Path("p.yaml"),
    rates=(500.0,),
    duration_s=1.0,
    saturation_connections=4,
    warmup_requests=0,
    arms=("direct", "fairlane"),
    targets=(
        OverheadTarget("p50", "added_p50_ms", 0.5, "max", 500.0),
        OverheadTarget("p99", "added_p99_ms", 2.0, "max", 500.0),
        OverheadTarget("sat", "saturation_rps", 2000.0, "min"),
    ),
)


def arms() -> dict[str, list[dict[str, Any]]]:
    fair_cores = {"envoy": 0.2, "backend": 0.05, "service": 0.5}
    return {
        "direct": [row("rate", 500.0, 0.3, 0.9), row("saturation", None, 1.0, 2.0)],
        "fairlane": [
            row("rate", 500.0, 0.7, 3.4, cpu_cores=fair_cores),
            row("saturation", None, 9.0, 30.0, machine_busy=0.95, rps_per_service_core=1400.0),
        ],
    }


def test_targets_from_the_phases() -> None:
    results = {t.name: t for t in evaluate(SCENARIO, arms())}
    assert (results["p50"].measured, results["p50"].passed) == (0.4, True)
    assert (results["p99"].measured, results["p99"].passed) == (2.5, False)
    assert (results["sat"].measured, results["sat"].passed) == (1500.0, False)
    assert results["sat"].note.startswith("suspect: fairlane: machine 95% busy")
    assert results["p50"].note == ""
    missing = evaluate(SCENARIO, {"fairlane": arms()["fairlane"]})
    assert missing[0].measured is None and missing[0].passed is None
    assert "needs the direct and the fairlane arm" in missing[0].note


def test_report_says_who_was_the_bottleneck(tmp_path: Path) -> None:
    data = arms()
    data["direct"][0]["send_late_p99_ms"] = 9.0
    results = {
        "scenario": {
            "description": "d",
            "path": "x.yaml",
            "policy": "p.yaml",
            "duration_s": 1.0,
            "warmup_requests": 0,
        },
        "meta": {"loadgen": "gen", "backend": "instant", "cpus": 2, "saturation_connections": 4},
        "arms": data,
        "failed_arms": {},
        "targets": [t.to_json() for t in evaluate(SCENARIO, data)],
    }
    markdown = render_markdown(results)
    assert (
        "load generator the bottleneck? **yes** in direct 500 req/s (requests sent 9 ms" in markdown
    )
    assert "machine CPU-bound? **yes** in fairlane saturation 95%" in markdown
    assert "- **PASS** p50: 0.4 ≤ 0.5" in markdown
    assert "- **FAIL** sat: 1500 ≥ 2000 (suspect" in markdown
    assert "| 500 req/s | fairlane | 500 | 0.7 | 3.4 | 0.4 | 2.5 | 0 | 0.5 |" in markdown
    assert "1500 req/s = 1400 req/s per service core" in markdown
    report = write_report(tmp_path, results).read_text()
    for png in ("latency.png", "added_latency.png", "saturation.png"):
        assert f"]({png})" in report and (tmp_path / png).stat().st_size > 0


def test_other_cores_is_the_machine_minus_the_measured_processes() -> None:
    r = row("rate", 100.0, 1.0, 2.0, machine_busy=0.5)
    assert round(other_cores(r, 2), 3) == 0.8  # 1.0 busy core - 0.1 - 0.05 - 0.05
    assert other_cores(row("rate", 100.0, 1.0, 2.0, machine_busy=0.0), 2) == 0.0
