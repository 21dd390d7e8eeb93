"""The overhead report's verdicts from phase rows: targets (added latency = fairlane minus
direct at the same rate; saturation from the fairlane arm), suspect marks, bottleneck lines,
and the markdown's plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtests.bench.overhead.report import other_cores, render_markdown, write_report
from loadtests.bench.overhead.scenario import (
    FairlaneArm,
    OverheadScenario,
    OverheadTarget,
    OverloadSpec,
)
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
    assert "- **PASS** [fairlane] p50: 0.4 ≤ 0.5" in markdown
    assert "- **FAIL** [fairlane] sat: 1500 ≥ 2000 (suspect" in markdown
    assert "| 500 req/s | fairlane | 500 | 0.7 | 3.4 | 0.4 | 2.5 | 0 | 0.5 |" in markdown
    assert "1500 req/s = 1400 req/s per service core" in markdown
    report = write_report(tmp_path, results).read_text()
    for png in ("latency.png", "added_latency.png", "saturation.png"):
        assert f"]({png})" in report and (tmp_path / png).stat().st_size > 0


def test_other_cores_is_the_machine_minus_the_measured_processes() -> None:
    r = row("rate", 100.0, 1.0, 2.0, machine_busy=0.5)
    assert round(other_cores(r, 2), 3) == 0.8  # 1.0 busy core - 0.1 - 0.05 - 0.05
    assert other_cores(row("rate", 100.0, 1.0, 2.0, machine_busy=0.0), 2) == 0.0


NEW = OverheadScenario(
    name="t",
    description="d",
    policy=Path("p.yaml"),
    rates=(100.0, "half_capacity"),
    duration_s=1.0,
    saturation_connections=4,
    warmup_requests=0,
    arms=("fairlane", "fairlane-default", "direct"),
    fairlane_arms=(
        FairlaneArm("fairlane", Path("p.yaml")),
        FairlaneArm("fairlane-default", Path("default.yaml"), ("sk-chat-demo",), 256),
    ),
    concurrency1_requests=10,
    overload=OverloadSpec(duration_s=1.0),
    targets=(
        OverheadTarget("half p50", "added_p50_ms", 0.5, "max", "half_capacity"),
        OverheadTarget("per core", "rps_per_core_vs_envoy", 0.25, "min"),
        OverheadTarget("c1", "c1_added_p50_ms", 1.0, "max", arm="fairlane"),
        OverheadTarget("admitted", "overload_admitted_fraction", 0.9, "min"),
        OverheadTarget("within", "overload_answered_within_fraction", 1.0, "min"),
        OverheadTarget("envoy", "overload_envoy_errors", 0, "max"),
        OverheadTarget("timeouts", "overload_timeouts", 0, "max"),
        OverheadTarget("recovery", "recovery_s", 5, "max"),
    ),
)


def overload_row(**extra: Any) -> dict[str, Any]:
    base = {
        "mode": "overload",
        "target_rps": 2800.0,
        "capacity_rps": 1400.0,
        "duration_s": 1.0,
        "sent": 2800,
        "unsent": 0,
        "max_connections": 512,
        "outcomes": {
            "ok": 1300,
            "gateway": 1480,
            "envoy_error": 20,
            "timeout": 0,
            "connection_error": 0,
            "other": 0,
        },
        "statuses": {"200": 1300, "429": 1480, "503": 20},
        "achieved_rps": 1300.0,
        "requests": 1300,
        "errors": 1500,
        "admitted_fraction": 0.929,
        "p50_ms": 5.0,
        "p99_ms": 40.0,
        "gateway_p50_ms": 3.0,
        "gateway_p99_ms": 20.0,
        "gateway_max_ms": 70.0,
        "answer_within_ms": 50.0,
        "answered_within_fraction": 0.98,
        "envoy_errors": 20,
        "timeouts": 0,
        "send_late_p99_ms": 1.0,
        "cpu_cores": {"service": 1.0},
        "loadgen_cores": 0.3,
        "machine_busy": 0.99,
    }
    base.update(extra)
    return base


def recovery_row(recovered: float | None) -> dict[str, Any]:
    return {
        "mode": "recovery",
        "target_rps": 100.0,
        "achieved_rps": 100.0,
        "requests": 100,
        "errors": 0,
        "unsent": 0,
        "p50_ms": 1.0,
        "p99_ms": 3.0,
        "baseline_p50_ms": 1.0,
        "bound_ms": 1.5,
        "window_s": 0.5,
        "watch_s": 1.0,
        "windows": [{"t_s": 0.0, "p50_ms": "failed"}, {"t_s": 0.5, "p50_ms": 1.2}],
        "recovered": recovered is not None,
        "recovery_s": recovered,
        "rule": "the rule",
        "send_late_p99_ms": 1.0,
        "cpu_cores": {"service": 0.1},
        "loadgen_cores": 0.02,
        "machine_busy": 0.4,
    }


def c1_row(added: float) -> dict[str, Any]:
    return {
        "mode": "concurrency1",
        "target_rps": None,
        "achieved_rps": 500.0,
        "requests": 10,
        "errors": 0,
        "p50_ms": 0.2 + added,
        "p99_ms": 3.0,
        "backend_p50_ms": 0.2,
        "backend_p99_ms": 0.3,
        "c1_added_p50_ms": added,
        "cpu_cores": {},
        "loadgen_cores": 0.05,
        "machine_busy": 0.3,
    }


def new_arms() -> dict[str, list[dict[str, Any]]]:
    service = {"envoy": 0.4, "service": 1.0}
    return {
        "fairlane": [
            row(
                "saturation",
                None,
                9.0,
                30.0,
                achieved_rps=1400.0,
                cpu_cores=service,
                rps_per_service_core=1400.0,
            ),
            row("rate", 100.0, 1.5, 3.0),
            row("rate", 700.0, 1.2, 2.5, rate_label="half_capacity"),
            c1_row(0.8),
            overload_row(),
            recovery_row(0.5),
        ],
        "fairlane-default": [
            row(
                "saturation",
                None,
                9.0,
                30.0,
                achieved_rps=1000.0,
                cpu_cores={"envoy": 0.3, "service": 1.0},
            ),
            row("rate", 100.0, 1.6, 3.0),
            row("rate", 500.0, 1.4, 2.5, rate_label="half_capacity"),
            c1_row(1.3),
            overload_row(unsent=40, timeouts=3),
            recovery_row(None),
        ],
        "direct": [
            row(
                "saturation",
                None,
                1.0,
                2.0,
                achieved_rps=16000.0,
                cpu_cores={"envoy": 1.0, "backend": 0.3},
                rps_per_envoy_core=16000.0,
            ),
            row("rate", 100.0, 0.4, 0.9),
            row("rate", 500.0, 0.3, 0.8, rate_label="half_capacity of fairlane-default"),
            row("rate", 700.0, 0.35, 0.8, rate_label="half_capacity of fairlane"),
            c1_row(0.1),
        ],
    }


def test_new_targets_per_fairlane_arm() -> None:
    results = {(t.name, t.arm): t for t in evaluate(NEW, new_arms())}
    # without an arm, a target is judged for every fairlane arm; with one, only for it
    assert len(results) == 7 * 2 + 1 and ("c1", "fairlane-default") not in results
    half = results["half p50", "fairlane"], results["half p50", "fairlane-default"]
    assert [(t.measured, t.passed) for t in half] == [(0.85, False), (1.1, False)]
    # 1400 req/s per service core / 16000 per Envoy core; the second from cpu_cores
    per_core = results["per core", "fairlane"], results["per core", "fairlane-default"]
    assert [t.measured for t in per_core] == [0.0875, 0.0625]
    assert (results["c1", "fairlane"].measured, results["c1", "fairlane"].passed) == (0.8, True)
    admitted = results["admitted", "fairlane"]
    assert (admitted.measured, admitted.passed) == (0.929, True)
    assert admitted.note.startswith("suspect: fairlane: machine 99% busy")
    assert (results["within", "fairlane"].measured, results["within", "fairlane"].passed) == (
        0.98,
        False,
    )
    assert (results["envoy", "fairlane"].measured, results["envoy", "fairlane"].passed) == (
        20,
        False,
    )
    timeouts = results["timeouts", "fairlane-default"]
    assert (timeouts.measured, timeouts.passed) == (3, False)
    assert "40 sends not made in time (all 512 connections busy)" in timeouts.note
    assert (results["recovery", "fairlane"].measured, results["recovery", "fairlane"].passed) == (
        0.5,
        True,
    )
    never = results["recovery", "fairlane-default"]
    assert (never.measured, never.passed) == (None, False)
    assert never.note == "not recovered within 1 s"
    missing = evaluate(NEW, {"fairlane": [c1_row(0.1)]})
    assert {t.passed for t in missing if t.metric != "c1_added_p50_ms"} == {None}


def test_report_has_the_new_phases(tmp_path: Path) -> None:
    data = new_arms()
    results = {
        "scenario": {
            "description": "d",
            "path": "x.yaml",
            "policy": "p.yaml",
            "fairlane_arms": {
                "fairlane": {"policy": "p.yaml", "api_key": "k", "seats": None},
                "fairlane-default": {"policy": "default.yaml", "api_key": "k", "seats": 256},
            },
            "run_order": ["fairlane", "fairlane-default", "direct"],
            "duration_s": 1.0,
            "warmup_requests": 0,
        },
        "meta": {"loadgen": "gen", "backend": "instant", "cpus": 2, "saturation_connections": 4},
        "arms": data,
        "half_capacity_rps": {"fairlane": 700.0, "fairlane-default": 500.0},
        "failed_arms": {},
        "targets": [t.to_json() for t in evaluate(NEW, data)],
    }
    markdown = render_markdown(results)
    assert "`fairlane-default`: policy `default.yaml`, backend seats declared 256" in markdown
    assert "arms in the order they ran: fairlane, fairlane-default, direct" in markdown
    assert "- **FAIL** [fairlane-default] recovery: - ≤ 5 (not recovered within 1 s)" in markdown
    assert "| 700 req/s (half_capacity) | fairlane | 700 | 1.2 | 2.5 | 0.85 | 1.7 |" in markdown
    assert "16000 req/s = 16000 req/s per Envoy core" in markdown
    assert "1400 req/s per service core (9% of Envoy-alone's req/s per Envoy core)" in markdown
    assert "| fairlane | 10 | 1 / 3 | 0.2 / 0.3 | **0.8** |" in markdown
    assert "| fairlane | 2800 | 1400 | 2800 | 0 | 1300 (93%) | 1480 | 3 / 20 / 70 " in markdown
    assert "| 98.0% within 50 ms | 20 | 0 | 0 | 200: 1300, 429: 1480, 503: 20 |" in markdown
    assert "inherent here, the rule is kept" in markdown
    assert "| fairlane | 100 req/s | 1 | 1.5 | **0.5 s** | failed 1.2 (0.5 s each)" in markdown
    assert "**not within 1 s**" in markdown
    assert "fairlane-default overload: 40 sends not made in time" in markdown
    report = write_report(tmp_path, results).read_text()
    for png in ("latency.png", "added_latency.png", "saturation.png", "recovery.png"):
        assert f"]({png})" in report and (tmp_path / png).stat().st_size > 0
