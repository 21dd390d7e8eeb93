"""The overhead run's ``report.md``: targets with their numbers, the phases side by side,
the saturation figures and whether the load generator or the machine was the bottleneck
(then the numbers measure the harness, and the report says so)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loadtests.bench import cpu
from loadtests.bench.overhead.plots import SECTION_PHASES, SECTION_SATURATION, add_plots
from loadtests.bench.overhead.verdicts import (
    SEND_LATE_LIMIT_MS,
    Row,
    added,
    loadgen_warnings,
    phase_row,
    row_warnings,
)


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:g}"


def _phase(row: Row) -> str:
    return f"{row['target_rps']:g} req/s" if row["mode"] == "rate" else "saturation"


def bottleneck_lines(results: Mapping[str, Any]) -> list[str]:
    """Whether the load generator, or the machine's CPU, limited any phase, with numbers."""
    rows = [(arm, r) for arm, rs in results["arms"].items() for r in rs]
    if not rows:
        return ["- load generator the bottleneck? no phase ran"]
    arm, worst = max(rows, key=lambda ar: ar[1]["loadgen_cores"])
    late = max((r.get("send_late_p99_ms") or 0.0 for _, r in rows), default=0.0)
    limited = [
        f"{a} {_phase(r)} ({'; '.join(loadgen_warnings(r))})"
        for a, r in rows
        if loadgen_warnings(r)
    ]
    busy = [
        f"{a} {_phase(r)} {r['machine_busy']:.0%}"
        for a, r in rows
        if r["machine_busy"] > cpu.MACHINE_LIMIT_FRACTION
    ]
    verdict = f"**yes** in {', '.join(limited)}" if limited else "**no**"
    starved = limited and worst["loadgen_cores"] <= cpu.LOADGEN_LIMIT_CORES
    return [
        f"- load generator the bottleneck? {verdict}. Its CPU: at most "
        f"{worst['loadgen_cores']:.2f} of its one core ({arm} {_phase(worst)}; warning above "
        f"{cpu.LOADGEN_LIMIT_CORES:.2f}); sends at most {late:g} ms late at p99 (warning "
        f"above {SEND_LATE_LIMIT_MS:g} ms)"
        + (
            ": late sends with little CPU of its own mean the machine did not run it in time"
            if starved
            else ""
        ),
        "- machine CPU-bound? "
        + (
            f"**yes** in {', '.join(busy)} busy (> {cpu.MACHINE_LIMIT_FRACTION:.0%}: the "
            "processes compete for the cores; at saturation that is expected on a small "
            "machine)"
            if busy
            else f"**no** (every phase below {cpu.MACHINE_LIMIT_FRACTION:.0%} busy)"
        ),
    ]


def other_cores(row: Row, cpus: int | None) -> float:
    """Cores the machine spent on anything but this phase's processes and the generator:
    on a shared machine, how much other work competed with the measurement."""
    ours = sum(row["cpu_cores"].values()) + row["loadgen_cores"]
    return max(0.0, row["machine_busy"] * (cpus or 1) - ours)


def render_markdown(results: Mapping[str, Any]) -> str:
    lines = [
        *_head_lines(results),
        *_target_lines(results),
        *_phase_lines(results),
        *_saturation_lines(results),
        *_warning_lines(results),
    ]
    return "\n".join(lines) + "\n"


def _head_lines(results: Mapping[str, Any]) -> list[str]:
    scenario, meta = results["scenario"], results["meta"]
    return [
        "# fairlane bench overhead: Envoy direct vs Envoy + fairlane ext_proc",
        "",
        scenario["description"].strip(),
        "",
        f"- scenario: `{scenario['path']}`; policy `{scenario['policy']}`",
        f"- load generator: {meta['loadgen']} ({meta['saturation_connections']} connections "
        "at saturation)",
        *bottleneck_lines(results),
        f"- backend: {meta['backend']}",
        f"- machine: {meta['cpus']} cores, shared by the load generator, Envoy, the service, "
        "the backend and anything else running on it",
        f"- {scenario['duration_s']:g} wall seconds per phase, "
        f"{scenario['warmup_requests']} warm-up requests per arm",
    ]


def _target_lines(results: Mapping[str, Any]) -> list[str]:
    lines = ["", "## Targets", ""]
    for t in results["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "N/A"}[t["passed"]]
        sign = "≤" if t["op"] == "max" else "≥"
        note = f" ({t['note']})" if t["note"] else ""
        lines.append(
            f"- **{verdict}** {t['name']}: {_fmt(t['measured'])} {sign} {t['bound']:g}{note}"
        )
    for arm, error in results["failed_arms"].items():
        lines += ["", f"**Arm {arm} failed**:", "", "```", error, "```"]
    return lines


def _phase_lines(results: Mapping[str, Any]) -> list[str]:
    """Every phase of every arm, one table row each (fairlane's with the added latency)."""
    lines = [
        "",
        SECTION_PHASES,
        "",
        "| phase | arm | req/s | p50 ms | p99 ms | added p50 | added p99 | errors "
        "| service cores | Envoy cores | backend cores | loadgen cores | send late p99 ms "
        "| machine busy | other work cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    direct = results["arms"].get("direct", [])
    cpus = results["meta"]["cpus"]
    for arm, rows in results["arms"].items():
        for row in rows:
            extra: dict[str, float | None] = {"p50_ms": None, "p99_ms": None}
            if arm == "fairlane":
                base = phase_row(direct, row["target_rps"] if row["mode"] == "rate" else None)
                extra = {k: added(base, row, k) for k in extra}
            cores = row["cpu_cores"]
            lines.append(
                f"| {_phase(row)} | {arm} | {row['achieved_rps']:g} | {_fmt(row['p50_ms'])} "
                f"| {_fmt(row['p99_ms'])} | {_fmt(extra['p50_ms'])} | {_fmt(extra['p99_ms'])} "
                f"| {row['errors']} | {_fmt(cores.get('service'))} | {_fmt(cores.get('envoy'))} "
                f"| {_fmt(cores.get('backend'))} | {row['loadgen_cores']:g} "
                f"| {_fmt(row.get('send_late_p99_ms'))} | {row['machine_busy']:.0%} "
                f"| {other_cores(row, cpus):.2f} |"
            )
    return lines


def _saturation_lines(results: Mapping[str, Any]) -> list[str]:
    lines = ["", SECTION_SATURATION, ""]
    for arm, rows in results["arms"].items():
        row = phase_row(rows, None)
        if row is None:
            continue
        cores = ", ".join(f"{p} {c:.2f}" for p, c in row["cpu_cores"].items())
        per_core = (
            f" = {_fmt(row['rps_per_service_core'])} req/s per service core"
            if row.get("rps_per_service_core")
            else ""
        )
        lines.append(
            f"- {arm}: {row['achieved_rps']:g} req/s{per_core}; p50/p99 "
            f"{_fmt(row['p50_ms'])}/{_fmt(row['p99_ms'])} ms; CPU cores: {cores}, load "
            f"generator {row['loadgen_cores']:.2f}; machine {row['machine_busy']:.0%} busy"
        )
    return lines


def _warning_lines(results: Mapping[str, Any]) -> list[str]:
    warnings = [
        f"- {arm} {_phase(r)}: {w}"
        for arm, rs in results["arms"].items()
        for r in rs
        for w in row_warnings(r)
    ]
    if not warnings:
        return []
    return [
        "",
        "## Warnings",
        "",
        "Numbers at these phases measure the machine too:",
        "",
        *warnings,
    ]


def write_report(out: Path, results: Mapping[str, Any]) -> Path:
    """report.md with the plots embedded (a plotting failure is noted, never fatal)."""
    markdown = add_plots(render_markdown(results), out, results)
    path = out / "report.md"
    path.write_text(markdown)
    return path
