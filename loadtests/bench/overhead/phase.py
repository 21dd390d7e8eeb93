"""One load phase of one arm: what was measured, and the numbers reported for it.

A phase is an open-loop rate or the closed-loop saturation; its row in ``results.json``
(:func:`summarize`) holds rates, latency percentiles (interpolated as in the A/B report),
and the CPU cores each process used over the phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loadtests.bench.stats import percentile


@dataclass
class RunResult:
    """One load phase of one arm."""

    mode: str
    """``rate`` (open loop at ``target_rps``) or ``saturation`` (closed loop)."""
    target_rps: float | None
    duration_s: float
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    late_ms: list[float] = field(default_factory=list)
    """Open loop: how late each request was sent (ms)."""
    cpu_s: dict[str, float] = field(default_factory=dict)
    loadgen_cpu_s: float = 0.0
    machine_busy_fraction: float = 0.0


def summarize(run: RunResult) -> dict[str, Any]:
    """The reported numbers of one phase."""
    done = len(run.latencies_ms)
    achieved = done / run.duration_s if run.duration_s > 0 else 0.0
    service_cpu = run.cpu_s.get("service")
    return {
        "mode": run.mode,
        "target_rps": run.target_rps,
        "achieved_rps": round(achieved, 1),
        "requests": done,
        "errors": run.errors,
        "send_late_p99_ms": _round(percentile(run.late_ms, 99)),
        "p50_ms": _round(percentile(run.latencies_ms, 50)),
        "p99_ms": _round(percentile(run.latencies_ms, 99)),
        "cpu_cores": {k: round(v / run.duration_s, 3) for k, v in run.cpu_s.items()},
        "loadgen_cores": round(run.loadgen_cpu_s / run.duration_s, 3),
        "machine_busy": round(run.machine_busy_fraction, 3),
        "rps_per_service_core": (
            round(done / service_cpu, 0) if service_cpu and service_cpu > 0 else None
        ),
    }


def added_latency(direct: dict[str, Any], fairlane: dict[str, Any]) -> dict[str, float | None]:
    """fairlane minus direct at the same phase, for p50 and p99 (ms)."""
    return {
        key: _round(fairlane[key] - direct[key])
        if fairlane.get(key) is not None and direct.get(key) is not None
        else None
        for key in ("p50_ms", "p99_ms")
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
