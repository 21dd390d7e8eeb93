"""PNG plots of an overhead run, drawn from ``results.json``'s phase rows:

* ``latency.png``: p50 and p99 latency against the request rate, one colour per arm;
* ``added_latency.png``: fairlane minus direct, p50 and p99 against the rate, with the
  targets' bounds;
* ``saturation.png``: requests/s at saturation per arm (with the target), and the CPU
  cores each process used there (service, Envoy, a peer gateway, backend, load generator);
* ``recovery.png``: each fairlane arm's window p50 after the overload, against its bound.

The figure helpers and the embedding in ``report.md`` are the A/B report's
(``loadtests/bench/plots.py``); matplotlib is imported only when plots are drawn.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loadtests.bench.overhead.scenario import DIRECT, PEERS
from loadtests.bench.overhead.verdicts import added, phase_row
from loadtests.bench.plots import SECTION_FALLBACK, embed, new_figure, save_figure

SECTION_PHASES = "## Latency per phase"
SECTION_SATURATION = "## Saturation"
SECTION_OVERLOAD = "## Overload and recovery"
"""The report's sections the plots go under."""

ARM_COLORS = {
    "direct": "C0",
    "fairlane": "C1",
    "fairlane-default": "C4",
    "vllm-router": "C5",
    "litellm": "C6",
}
CPU_ROLES = ("service", "envoy", *PEERS, "backend", "load-generator")


def _rate_rows(rows: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted((r for r in rows if r["mode"] == "rate"), key=lambda r: r["target_rps"])


def latency(out_dir: Path, results: Mapping[str, Any]) -> Path | None:
    arms = {a: _rate_rows(rows) for a, rows in results["arms"].items()}
    if not any(arms.values()):
        return None
    fig, axes = new_figure()
    ax = axes[0][0]
    for arm, rows in arms.items():
        rates = [r["target_rps"] for r in rows]
        color = ARM_COLORS.get(arm, "C2")
        for key, style in (("p50_ms", "-"), ("p99_ms", "--")):
            values = [r[key] if r[key] is not None else float("nan") for r in rows]
            ax.plot(rates, values, style, marker="o", color=color, label=f"{arm} {key[:3]}")
    ax.set_xlabel("offered load (requests/s, open loop)")
    ax.set_ylabel("latency (ms, wall)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("latency percentiles against the request rate, per arm")
    return save_figure(fig, out_dir / "latency.png")


def added_latency(out_dir: Path, results: Mapping[str, Any]) -> Path | None:
    direct = results["arms"].get("direct", [])
    fairlane = {
        a: _rate_rows(rows) for a, rows in results["arms"].items() if a not in (DIRECT, *PEERS)
    }
    fairlane = {a: rows for a, rows in fairlane.items() if rows}
    if not direct or not fairlane:
        return None
    fig, axes = new_figure()
    ax = axes[0][0]
    rates = [r["target_rps"] for rows in fairlane.values() for r in rows]
    for arm, rows in fairlane.items():
        color = ARM_COLORS.get(arm, "C2")
        for key, style in (("p50_ms", "-"), ("p99_ms", "--")):
            values = [added(phase_row(direct, r["target_rps"]), r, key) for r in rows]
            ax.plot(
                [r["target_rps"] for r in rows],
                [float("nan") if v is None else v for v in values],
                style,
                marker="o",
                color=color,
                label=f"{arm} added {key[:3]}",
            )
    shown: set[tuple[str, float]] = set()
    for t in results["targets"]:
        if (
            t["metric"] in ("added_p50_ms", "added_p99_ms")
            and (t["metric"], t["bound"]) not in shown
        ):
            shown.add((t["metric"], t["bound"]))
            style = "-" if t["metric"] == "added_p50_ms" else "--"
            ax.axhline(t["bound"], linestyle=style, color="C3", linewidth=0.8)
            rate = t["rate"] if isinstance(t["rate"], str) else f"{t['rate']:g} req/s"
            ax.annotate(
                f"target {t['metric'][6:9]} ≤ {t['bound']:g} ms at {rate}",
                (min(rates), t["bound"]),
                textcoords="offset points",
                xytext=(2, 3),
                fontsize="small",
                color="C3",
            )
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xlabel("offered load (requests/s, open loop)")
    ax.set_ylabel("fairlane minus direct (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("latency the gateway adds (Envoy + ext_proc vs Envoy alone)")
    return save_figure(fig, out_dir / "added_latency.png")


def recovery(out_dir: Path, results: Mapping[str, Any]) -> Path | None:
    rows = {
        a: next((r for r in rs if r["mode"] == "recovery"), None)
        for a, rs in results["arms"].items()
    }
    found = {a: r for a, r in rows.items() if r is not None and r["windows"]}
    if not found:
        return None
    fig, axes = new_figure()
    ax = axes[0][0]
    for arm, row in found.items():
        color = ARM_COLORS.get(arm, "C2")
        times = [w["t_s"] for w in row["windows"]]
        # a window whose p50 was a failure (or that sent nothing) is drawn as a gap
        values = [
            w["p50_ms"] if isinstance(w["p50_ms"], int | float) else float("nan")
            for w in row["windows"]
        ]
        ax.step(times, values, where="post", marker="o", color=color, label=f"{arm} window p50")
        if row.get("bound_ms") is not None:
            ax.axhline(row["bound_ms"], linestyle="--", color=color, linewidth=0.8)
            ax.annotate(
                f"{arm} bound {row['bound_ms']:g} ms",
                (0, row["bound_ms"]),
                textcoords="offset points",
                xytext=(2, 3),
                fontsize="small",
                color=color,
            )
        if row.get("recovery_s") is not None:
            ax.axvline(row["recovery_s"], linestyle=":", color=color, linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("seconds after the overload's last send")
    ax.set_ylabel("p50 per window (ms, log)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("recovery after the overload")
    return save_figure(fig, out_dir / "recovery.png")


def saturation(out_dir: Path, results: Mapping[str, Any]) -> Path | None:
    rows = {a: phase_row(rs, None) for a, rs in results["arms"].items()}
    saturated = {a: r for a, r in rows.items() if r is not None}
    if not saturated:
        return None
    fig, axes = new_figure(cols=2, width=10.5)
    left, right = axes[0][0], axes[0][1]
    names = list(saturated)
    bars = left.bar(
        names,
        [saturated[a]["achieved_rps"] for a in names],
        color=[ARM_COLORS.get(a, "C2") for a in names],
    )
    left.bar_label(bars, labels=[f"{saturated[a]['achieved_rps']:,.0f}" for a in names])
    for t in results["targets"]:
        if t["metric"] == "saturation_rps":
            left.axhline(t["bound"], linestyle="--", color="C3", linewidth=0.8)
            left.annotate(
                f"target ≥ {t['bound']:g} (fairlane)",
                (0, t["bound"]),
                textcoords="offset points",
                xytext=(0, 3),
                fontsize="small",
                color="C3",
            )
    left.set_ylabel("requests/s (closed loop)")
    left.set_title("throughput at saturation")
    bottom = [0.0] * len(names)
    for i, role in enumerate(CPU_ROLES):
        values = [
            float(
                saturated[a]["loadgen_cores"]
                if role == "load-generator"
                else saturated[a]["cpu_cores"].get(role) or 0.0
            )
            for a in names
        ]
        right.bar(names, values, bottom=bottom, color=f"C{i + 2}", label=role)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    cpus = results["meta"].get("cpus")
    if cpus:
        right.axhline(cpus, linestyle=":", color="black", linewidth=0.8)
    right.set_ylabel("CPU cores at saturation")
    right.set_title(f"CPU per process (machine: {cpus} cores)")
    right.legend(fontsize="small")
    for ax in (left, right):
        ax.grid(True, axis="y", alpha=0.3)
    return save_figure(fig, out_dir / "saturation.png")


def add_plots(markdown: str, out_dir: Path, results: Mapping[str, Any]) -> str:
    """Draw the plots and embed them; a failure to draw is noted, never loses the report."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        phases = [p for p in (latency(out_dir, results), added_latency(out_dir, results)) if p]
        sat = saturation(out_dir, results)
        rec = recovery(out_dir, results)
    except Exception as exc:  # the figures and results.json matter more than the pictures
        message = f"plots not drawn: {type(exc).__name__}: {exc}"
        print(f"fairlane bench overhead: WARNING: {message}", file=sys.stderr, flush=True)
        return markdown.rstrip("\n") + f"\n\n{SECTION_FALLBACK}\n\n({message})\n"
    sections = {SECTION_PHASES: phases}
    if sat is not None:
        sections[SECTION_SATURATION] = [sat]
    if rec is not None:
        sections[SECTION_OVERLOAD] = [rec]
    return embed(markdown, sections)
