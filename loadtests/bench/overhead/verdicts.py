"""The overhead run's verdicts: each target PASS/FAIL/N/A from the phase rows.

Added latency is a fairlane arm minus direct at the same rate (``half_capacity``: the rate
the fairlane arm resolved, which the direct arm also ran); saturation figures are the
fairlane arm's closed-loop phase (``rps_per_core_vs_envoy``: its req/s per service core
over the direct arm's req/s per Envoy core); ``c1_added_p50_ms`` is the arm's
concurrency-1 phase; the overload figures its overload phase and the recovery after it. A
target without an ``arm`` is judged for every fairlane arm of the run, one verdict each. A
verdict computed from a phase where the load generator or the machine was the bottleneck
is kept but marked suspect: it measures the harness too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from loadtests.bench import cpu
from loadtests.bench.overhead.scenario import (
    C1_METRICS,
    DIRECT,
    HALF_CAPACITY,
    OVERLOAD_METRICS,
    PEERS,
    SATURATION_METRICS,
    OverheadScenario,
    OverheadTarget,
)

SEND_LATE_LIMIT_MS = 2.0
"""Open loop: p99 send lateness above this means the generator's timer could not keep up."""

Row = Mapping[str, Any]
"""One phase's numbers as ``results.json`` has them (:func:`phase.summarize`)."""

_OVERLOAD_KEYS = {
    "overload_admitted_fraction": "admitted_fraction",
    "overload_answered_within_fraction": "answered_within_fraction",
    "overload_envoy_errors": "envoy_errors",
    "overload_timeouts": "timeouts",
}


@dataclass
class TargetResult:
    name: str
    metric: str
    bound: float
    op: str
    rate: float | str | None
    measured: float | None
    passed: bool | None
    note: str = ""
    arm: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def phase_row(rows: Sequence[Row], rate: float | None) -> Row | None:
    """The row of the phase at ``rate`` (None: the saturation phase)."""
    mode = "saturation" if rate is None else "rate"
    return next((r for r in rows if r["mode"] == mode and r["target_rps"] == rate), None)


def mode_row(rows: Sequence[Row], mode: str) -> Row | None:
    """The row of the arm's ``concurrency1``, ``overload`` or ``recovery`` phase."""
    return next((r for r in rows if r["mode"] == mode), None)


def rate_row(rows: Sequence[Row], rate: float | str | None) -> Row | None:
    """A fairlane arm's row at ``rate``, ``half_capacity`` being the one it resolved."""
    if rate == HALF_CAPACITY:
        return next(
            (r for r in rows if r["mode"] == "rate" and r.get("rate_label") == HALF_CAPACITY),
            None,
        )
    return phase_row(rows, None if isinstance(rate, str) else rate)


def added(direct: Row | None, fairlane: Row | None, key: str) -> float | None:
    """fairlane minus direct for ``key`` (``p50_ms``, ``p99_ms``) at one phase."""
    if direct is None or fairlane is None:
        return None
    a, b = direct.get(key), fairlane.get(key)
    return None if a is None or b is None else round(b - a, 3)


def per_core(row: Row | None, role: str) -> float | None:
    """Requests/s of a phase per core of ``role`` (``service``, ``envoy``)."""
    if row is None:
        return None
    stored = row.get(f"rps_per_{role}_core")
    if stored:
        return float(stored)
    cores = row["cpu_cores"].get(role)
    return round(row["achieved_rps"] / cores, 0) if cores else None


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
    if row.get("unsent"):
        found.append(
            f"{row['unsent']} sends not made in time (all {row.get('max_connections')} "
            "connections busy)"
        )
    return found


def row_warnings(row: Row) -> list[str]:
    """Why a phase's numbers may measure the harness or the machine instead of the gateway."""
    found = loadgen_warnings(row)
    if row["machine_busy"] > cpu.MACHINE_LIMIT_FRACTION:
        found.append(f"machine {row['machine_busy']:.0%} busy (> {cpu.MACHINE_LIMIT_FRACTION:.0%})")
    return found


def fairlane_arms(scenario: OverheadScenario) -> list[str]:
    """The arms a target without ``arm`` is judged for: neither direct nor a peer."""
    return [a for a in scenario.arms if a != DIRECT and a not in PEERS]


def evaluate(scenario: OverheadScenario, arms: Mapping[str, Sequence[Row]]) -> list[TargetResult]:
    results = []
    for target in scenario.targets:
        for arm in [target.arm] if target.arm else fairlane_arms(scenario):
            results.append(_judge(target, arm, arms))
    return results


def _judge(target: OverheadTarget, arm: str, arms: Mapping[str, Sequence[Row]]) -> TargetResult:
    direct, rows = arms.get(DIRECT, ()), arms.get(arm, ())
    measured, used, note = _measure(target, arm, direct, rows)
    passed = None
    if measured is not None:
        passed = measured <= target.bound if target.op == "max" else measured >= target.bound
    elif target.metric == "recovery_s" and mode_row(rows, "recovery") is not None:
        passed = False  # watched, never recovered: a failure, not a missing number
    noisy = [f"{a}: {w}" for a, r in used if r is not None for w in row_warnings(r)]
    if noisy and (measured is not None or passed is not None):
        note = "; ".join(([note] if note else []) + [f"suspect: {'; '.join(noisy)}"])
    return TargetResult(
        target.name,
        target.metric,
        target.bound,
        target.op,
        target.rate,
        measured,
        passed,
        note,
        arm,
    )


def _measure(
    target: OverheadTarget, arm: str, direct: Sequence[Row], rows: Sequence[Row]
) -> tuple[float | None, list[tuple[str, Row | None]], str]:
    """(the measured value, the rows it came from, a note when it could not be measured)."""
    metric = target.metric
    if metric in SATURATION_METRICS:
        row = phase_row(rows, None)
        if row is None:
            return None, [], f"no saturation phase of the {arm} arm"
        if metric == "saturation_rps":
            return row.get("achieved_rps"), [(arm, row)], ""
        if metric == "rps_per_service_core":
            return row.get("rps_per_service_core"), [(arm, row)], ""
        base = phase_row(direct, None)
        ours, envoy = per_core(row, "service"), per_core(base, "envoy")
        used = [(arm, row), (DIRECT, base)]
        if ours is None or not envoy:
            return None, used, "needs both arms' saturation phases with their CPU"
        return round(ours / envoy, 4), used, ""
    if metric in C1_METRICS:
        row = mode_row(rows, "concurrency1")
        if row is None:
            return None, [], f"no concurrency-1 phase of the {arm} arm"
        return row.get("c1_added_p50_ms"), [(arm, row)], ""
    if metric in OVERLOAD_METRICS:
        mode = "recovery" if metric == "recovery_s" else "overload"
        row = mode_row(rows, mode)
        if row is None:
            return None, [], f"no {mode} phase of the {arm} arm"
        if metric == "recovery_s":
            note = "" if row.get("recovered") else f"not recovered within {row['watch_s']:g} s"
            if row.get("baseline_p50_ms") is None:
                note = "no no-load p50 at the recovery rate"
            return row.get("recovery_s"), [(arm, row)], note
        return row.get(_OVERLOAD_KEYS[metric]), [(arm, row)], ""
    f = rate_row(rows, target.rate)
    d = phase_row(direct, f["target_rps"]) if f is not None else None
    measured = added(d, f, "p50_ms" if metric == "added_p50_ms" else "p99_ms")
    note = ""
    if measured is None:
        note = f"needs the direct and the {arm} arm at this rate"
    return measured, [(DIRECT, d), (arm, f)], note
