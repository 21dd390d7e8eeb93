"""The overhead run's ``report.md``: targets with their numbers, the phases side by side,
the saturation figures, the concurrency-1 phase, every arm's whole gateway beside the peers
(:mod:`~loadtests.bench.overhead.gateways`), the overload and recovery phases, and whether
the load generator or the machine was the bottleneck (then the numbers measure the harness,
and the report says so)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loadtests.bench import cpu
from loadtests.bench.overhead.gateways import gateway_lines
from loadtests.bench.overhead.phase import RECOVERY_RULE
from loadtests.bench.overhead.plots import (
    SECTION_OVERLOAD,
    SECTION_PHASES,
    SECTION_SATURATION,
    add_plots,
)
from loadtests.bench.overhead.scenario import DIRECT, PEERS
from loadtests.bench.overhead.verdicts import (
    SEND_LATE_LIMIT_MS,
    Row,
    added,
    loadgen_warnings,
    mode_row,
    per_core,
    phase_row,
    row_warnings,
)

_MODES = {"saturation": "saturation", "concurrency1": "concurrency 1", "overload": "overload"}


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:g}"


def _phase(row: Row) -> str:
    if row["mode"] == "rate":
        label = row.get("rate_label")
        return f"{row['target_rps']:g} req/s" + (f" ({label})" if label else "")
    if row["mode"] == "recovery":
        return f"recovery at {row['target_rps']:g} req/s"
    return _MODES.get(row["mode"], str(row["mode"]))


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
        *_concurrency1_lines(results),
        *gateway_lines(results["arms"], _numeric(results["scenario"].get("rates", []))),
        *_overload_lines(results),
        *_warning_lines(results),
    ]
    return "\n".join(lines) + "\n"


def _numeric(rates: list[Any]) -> list[float]:
    return [float(r) for r in rates if not isinstance(r, str)]


def _head_lines(results: Mapping[str, Any]) -> list[str]:
    scenario, meta = results["scenario"], results["meta"]
    fairlane = scenario.get("fairlane_arms") or {"fairlane": {"policy": scenario["policy"]}}
    arms = "; ".join(
        f"`{name}`: policy `{a['policy']}`"
        + (f", backend seats declared {a['seats']}" if a.get("seats") else "")
        for name, a in fairlane.items()
    )
    order = scenario.get("run_order") or scenario.get("arms") or []
    peers = [a for a in order if a in PEERS]
    return [
        "# fairlane bench overhead: Envoy direct vs Envoy + fairlane ext_proc",
        "",
        scenario["description"].strip(),
        "",
        f"- scenario: `{scenario['path']}`; fairlane arms: {arms}",
        *(
            [
                f"- peer gateways in place of Envoy and fairlane: {', '.join(peers)} "
                "(`loadtests/bench/peers`: vllm-router round_robin, the LiteLLM proxy); each: "
                "warm-up, saturation, the numeric rates, concurrency 1"
            ]
            if peers
            else []
        ),
        f"- arms in the order they ran: {', '.join(order)}; each: warm-up, saturation, the "
        "rates, concurrency 1, then (fairlane arms) the overload and the recovery",
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
        arm = f"[{t['arm']}] " if t.get("arm") else ""
        lines.append(
            f"- **{verdict}** {arm}{t['name']}: {_fmt(t['measured'])} {sign} {t['bound']:g}{note}"
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
            if row["mode"] not in ("rate", "saturation"):
                continue
            extra: dict[str, float | None] = {"p50_ms": None, "p99_ms": None}
            if arm != DIRECT and arm not in PEERS:  # a peer replaces Envoy: see the section below
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
    direct = phase_row(results["arms"].get(DIRECT, []), None)
    envoy = per_core(direct, "envoy")
    for arm, rows in results["arms"].items():
        row = phase_row(rows, None)
        if row is None:
            continue
        cores = ", ".join(f"{p} {c:.2f}" for p, c in row["cpu_cores"].items())
        per_core_text = ""
        if arm == DIRECT and envoy:
            per_core_text = f" = {envoy:g} req/s per Envoy core"
        elif row.get("rps_per_service_core"):
            per_core_text = f" = {_fmt(row['rps_per_service_core'])} req/s per service core"
            if envoy:
                ratio = row["rps_per_service_core"] / envoy
                per_core_text += f" ({ratio:.0%} of Envoy-alone's req/s per Envoy core)"
        lines.append(
            f"- {arm}: {row['achieved_rps']:g} req/s{per_core_text}; p50/p99 "
            f"{_fmt(row['p50_ms'])}/{_fmt(row['p99_ms'])} ms; CPU cores: {cores}, load "
            f"generator {row['loadgen_cores']:.2f}; machine {row['machine_busy']:.0%} busy"
        )
    halves = results.get("half_capacity_rps") or {}
    if halves:
        lines += [
            "",
            "Half capacity (each fairlane arm's saturation req/s / 2, run by it and by "
            "direct): " + ", ".join(f"{a} {r:g} req/s" for a, r in halves.items()),
        ]
    return lines


def _concurrency1_lines(results: Mapping[str, Any]) -> list[str]:
    rows = [(a, mode_row(rs, "concurrency1")) for a, rs in results["arms"].items()]
    found = [(a, r) for a, r in rows if r is not None]
    if not found:
        return []
    lines = [
        "",
        "## Concurrency 1",
        "",
        "One client, one connection, closed loop, alternating: a request through the arm, "
        "then one straight to the same backend process (no Envoy).",
        "",
        "| arm | requests | arm p50 / p99 ms | backend p50 / p99 ms | **added p50 ms** "
        "| errors | loadgen cores | machine busy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, r in found:
        lines.append(
            f"| {arm} | {r['requests']} | {_fmt(r['p50_ms'])} / {_fmt(r['p99_ms'])} "
            f"| {_fmt(r['backend_p50_ms'])} / {_fmt(r['backend_p99_ms'])} "
            f"| **{_fmt(r['c1_added_p50_ms'])}** | {r['errors']} | {r['loadgen_cores']:g} "
            f"| {r['machine_busy']:.0%} |"
        )
    return lines


def _overload_lines(results: Mapping[str, Any]) -> list[str]:
    rows = [
        (a, mode_row(rs, "overload"), mode_row(rs, "recovery")) for a, rs in results["arms"].items()
    ]
    found = [(a, o, r) for a, o, r in rows if o is not None]
    if not found:
        return []
    lines = [
        "",
        SECTION_OVERLOAD,
        "",
        "Open loop at the factor x the arm's own saturation req/s. Outcomes: **2xx**; "
        "**gateway** = 429/503 with an OpenAI-shaped JSON error body (the service's own "
        "answer); **Envoy errors** = any other 5xx (ext_proc's status_on_error 503 has no "
        "such body; 504: a timeout in Envoy) and connections Envoy closed; **timeouts** = the "
        "client gave up; **unsent** = due while every allowed connection was busy (the "
        "generator could not offer the load: flagged). On a 2-core machine that the load "
        "generator, Envoy, the service and the backend share, this phase keeps the machine "
        "busy by design, so its verdicts are marked suspect by the CPU rule: that is inherent "
        "here, the rule is kept.",
        "",
        "| arm | offered req/s | capacity req/s | sent | unsent | 2xx req/s (of capacity) "
        "| gateway answers | gateway p50 / p99 / max ms | within bound | Envoy errors "
        "| timeouts | other | statuses | loadgen cores | send late p99 ms | machine busy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, o, _ in found:
        outcomes = o["outcomes"]
        fraction = o.get("admitted_fraction")
        statuses = ", ".join(f"{k}: {v}" for k, v in o["statuses"].items())
        lines.append(
            f"| {arm} | {o['target_rps']:g} | {o['capacity_rps']:g} | {o['sent']} "
            f"| {o['unsent']} | {o['achieved_rps']:g} "
            f"({'-' if fraction is None else f'{fraction:.0%}'}) | {outcomes['gateway']} "
            f"| {_fmt(o['gateway_p50_ms'])} / {_fmt(o['gateway_p99_ms'])} / "
            f"{_fmt(o['gateway_max_ms'])} | {o['answered_within_fraction']:.1%} within "
            f"{o['answer_within_ms']:g} ms | {o['envoy_errors']} | {o['timeouts']} "
            f"| {outcomes['other']} | {statuses} | {o['loadgen_cores']:g} "
            f"| {_fmt(o.get('send_late_p99_ms'))} | {o['machine_busy']:.0%} |"
        )
    recoveries = [(a, r) for a, _, r in found if r is not None]
    if recoveries:
        lines += [
            "",
            f"Recovery, right after the overload's last send: {RECOVERY_RULE}.",
            "",
            "| arm | rate | no-load p50 ms | bound ms | **recovered after** | window p50s ms "
            "| machine busy |",
            "|---|---|---|---|---|---|---|",
        ]
        for arm, r in recoveries:
            after = f"{r['recovery_s']:g} s" if r["recovered"] else f"not within {r['watch_s']:g} s"
            windows = " ".join(
                "-" if w["p50_ms"] is None else str(w["p50_ms"]) for w in r["windows"]
            )
            lines.append(
                f"| {arm} | {r['target_rps']:g} req/s | {_fmt(r['baseline_p50_ms'])} "
                f"| {_fmt(r['bound_ms'])} | **{after}** | {windows} ({r['window_s']:g} s each) "
                f"| {r['machine_busy']:.0%} |"
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
