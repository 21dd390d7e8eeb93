"""The overhead run's verdicts: each target PASS/FAIL/N/A from the phase rows.

Added latency is fairlane minus direct at the same rate; saturation figures are the fairlane
arm's closed-loop phase. A verdict computed from a phase where the load generator or the
machine was the bottleneck is kept but marked suspect: it measures the harness too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from loadtests.bench import cpu
from loadtests.bench.overhead.scenario import SATURATION_METRICS, OverheadScenario

SEND_LATE_LIMIT_MS = 2.0
"""Open loop: p99 send lateness above this means the generator's timer could not keep up."""

Row = Mapping[str, Any]
"""One phase's numbers as ``results.json`` has them (:func:`phase.summarize`)."""


@dataclass
class TargetResult:
    name: str
    metric: str
    bound: float
    op: str
    rate: float | None
    measured: float | None
    passed: bool | None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def phase_row(rows: Sequence[Row], rate: float | None) -> Row | None:
    """The row of the phase at ``rate`` (None: the saturation phase)."""
    mode = "saturation" if rate is None else "rate"
    return next((r for r in rows if r["mode"] == mode and r["target_rps"] == rate), None)


def added(direct: Row | None, fairlane: Row | None, key: str) -> float | None:
    """fairlane minus direct for ``key`` (``p50_ms``, ``p99_ms``) at one phase."""
    if direct is None or fairlane is None:
        return None
    a, b = direct.get(key), fairlane.get(key)
    return None if a is None or b is None else round(b - a, 3)


def loadgen_warnings(row: Row) -> list[str]:
    """Why the load generator may have limited a phase (then it measures the harness)."""
    found = []
    if row["loadgen_cores"] > cpu.LOADGEN_LIMIT_CORES:
        found.append(
            f"load generator at {row['loadgen_cores']:.2f} of its core "
            f"(> {cpu.LOADGEN_LIMIT_CORES:.0%})"
        )
    late = row.get("send_late_p99_ms")
    if late is not None and late > SEND_LATE_LIMIT_MS:
        found.append(f"requests sent {late:g} ms late at p99 (> {SEND_LATE_LIMIT_MS:g} ms)")
    return found


def row_warnings(row: Row) -> list[str]:
    """Why a phase's numbers may measure the harness or the machine instead of the gateway."""
    found = loadgen_warnings(row)
    if row["machine_busy"] > cpu.MACHINE_LIMIT_FRACTION:
        found.append(f"machine {row['machine_busy']:.0%} busy (> {cpu.MACHINE_LIMIT_FRACTION:.0%})")
    return found


def evaluate(scenario: OverheadScenario, arms: Mapping[str, Sequence[Row]]) -> list[TargetResult]:
    direct, fairlane = arms.get("direct", ()), arms.get("fairlane", ())
    results = []
    for target in scenario.targets:
        note = ""
        if target.metric in SATURATION_METRICS:
            row = phase_row(fairlane, None)
            rows = [("fairlane", row)]
            key = "achieved_rps" if target.metric == "saturation_rps" else "rps_per_service_core"
            measured = None if row is None else row.get(key)
            if row is None:
                note = "no saturation phase of the fairlane arm"
        else:
            d, f = phase_row(direct, target.rate), phase_row(fairlane, target.rate)
            rows = [("direct", d), ("fairlane", f)]
            measured = added(d, f, "p50_ms" if target.metric == "added_p50_ms" else "p99_ms")
            if measured is None:
                note = "needs the direct and the fairlane arm at this rate"
        passed = None
        if measured is not None:
            passed = measured <= target.bound if target.op == "max" else measured >= target.bound
        noisy = [f"{a}: {w}" for a, r in rows if r is not None for w in row_warnings(r)]
        if noisy and measured is not None:
            note = f"suspect: {'; '.join(noisy)}"
        results.append(
            TargetResult(
                target.name,
                target.metric,
                target.bound,
                target.op,
                target.rate,
                measured,
                passed,
                note,
            )
        )
    return results
