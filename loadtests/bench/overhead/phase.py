"""One load phase of one arm: what was measured, and the numbers reported for it.

A phase is an open-loop rate, the closed-loop saturation, the concurrency-1 phase, the
overload or the recovery after it; its row in ``results.json`` holds rates, latency
percentiles (interpolated as in the A/B report), and the CPU cores each process used over
the phase (:func:`usage_fields`). The rows of the older phases (:func:`summarize`) keep the
fields they always had; the new phases add their own.

The recovery rule (:func:`recovery_time`) is pure: the watch after the overload is cut into
windows; a window's p50 counts a failed or timed-out request as infinitely slow; the arm has
recovered from the start of the first window after which *every* window's p50 is within
:func:`recovery_bound` of its no-load p50 at that rate.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtests.bench.overhead.loadgen import (
    CONNECTION_ERROR,
    ENVOY_ERROR,
    GATEWAY,
    OK,
    OUTCOMES,
    TIMEOUT,
    Classified,
    Sample,
)
from loadtests.bench.stats import percentile

RECOVERY_FACTOR = 1.5
RECOVERY_SLACK_MS = 0.5
RECOVERY_RULE = (
    f"recovered from the start of the first window after which every window's p50 (a failed "
    f"or timed-out request counting as infinitely slow) is within max({RECOVERY_FACTOR:g} x, "
    f"+{RECOVERY_SLACK_MS:g} ms) of the arm's no-load p50 at the recovery rate"
)


@dataclass
class Usage:
    """CPU over one phase: every process's seconds, the generator's, the machine's share."""

    wall_s: float
    cpu_s: dict[str, float] = field(default_factory=dict)
    loadgen_cpu_s: float = 0.0
    machine_busy_fraction: float = 0.0


def usage_fields(usage: Usage) -> dict[str, Any]:
    wall = max(usage.wall_s, 1e-9)
    return {
        "cpu_cores": {k: round(v / wall, 3) for k, v in usage.cpu_s.items()},
        "loadgen_cores": round(usage.loadgen_cpu_s / wall, 3),
        "machine_busy": round(usage.machine_busy_fraction, 3),
    }


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
    # Replicas (service-r1 ...) count together: the cores the service takes in all.
    replicas = [v for k, v in run.cpu_s.items() if k.startswith("service-")]
    service_cpu = sum(replicas) if replicas else run.cpu_s.get("service")
    envoy_cpu = run.cpu_s.get("envoy")
    cores = {k: round(v / run.duration_s, 3) for k, v in run.cpu_s.items()}
    if replicas and service_cpu is not None:
        cores["service"] = round(service_cpu / run.duration_s, 3)
    return {
        "mode": run.mode,
        "target_rps": run.target_rps,
        "achieved_rps": round(achieved, 1),
        "requests": done,
        "errors": run.errors,
        "send_late_p99_ms": _round(percentile(run.late_ms, 99)),
        "p50_ms": _round(percentile(run.latencies_ms, 50)),
        "p99_ms": _round(percentile(run.latencies_ms, 99)),
        "cpu_cores": cores,
        "loadgen_cores": round(run.loadgen_cpu_s / run.duration_s, 3),
        "machine_busy": round(run.machine_busy_fraction, 3),
        "rps_per_service_core": (
            round(done / service_cpu, 0) if service_cpu and service_cpu > 0 else None
        ),
        "rps_per_envoy_core": round(done / envoy_cpu, 0) if envoy_cpu and envoy_cpu > 0 else None,
    }


def summarize_concurrency1(
    through_ms: list[float], backend_ms: list[float], errors: int, usage: Usage
) -> dict[str, Any]:
    """One connection, closed loop: the arm's latency, the backend's called directly on
    the same process, alternating, and the difference of their p50s."""
    p50, backend_p50 = percentile(through_ms, 50), percentile(backend_ms, 50)
    return {
        "mode": "concurrency1",
        "target_rps": None,
        "achieved_rps": round(len(through_ms) / max(usage.wall_s, 1e-9), 1),
        "requests": len(through_ms),
        "errors": errors,
        "p50_ms": _round(p50),
        "p99_ms": _round(percentile(through_ms, 99)),
        "backend_p50_ms": _round(backend_p50),
        "backend_p99_ms": _round(percentile(backend_ms, 99)),
        "c1_added_p50_ms": None
        if p50 is None or backend_p50 is None
        else _round(p50 - backend_p50),
        **usage_fields(usage),
    }


def summarize_overload(
    run: Classified,
    rate: float,
    capacity_rps: float,
    answer_within_ms: float,
    max_connections: int,
    usage: Usage,
) -> dict[str, Any]:
    """The overload phase: what was offered, admitted (2xx answered within the phase, per
    second, against the capacity), refused by the gateway (and how fast), failed in Envoy,
    timed out; and how many sends the generator could not make."""
    samples = run.samples
    outcomes = Counter(s.outcome for s in samples)
    ok = [s.latency_ms for s in samples if s.outcome == OK]
    refusals = [s.latency_ms for s in samples if s.outcome == GATEWAY]
    refused = len(samples) - len(ok)
    in_time = sum(1 for ms in refusals if ms <= answer_within_ms)
    duration = max(run.elapsed_s, 1e-9)
    # Throughput is what the gateway let through *during* the overload: 2xx answered by the
    # last send (one queued then and answered in the recovery watch is not throughput).
    in_window = sum(
        1 for s in samples if s.outcome == OK and s.sent_s + s.latency_ms / 1000 <= run.elapsed_s
    )
    admitted = in_window / duration
    return {
        "mode": "overload",
        "target_rps": round(rate, 1),
        "capacity_rps": capacity_rps,
        "duration_s": round(run.elapsed_s, 3),
        "sent": len(samples),
        "unsent": run.unsent,
        "max_connections": max_connections,
        "outcomes": {name: outcomes.get(name, 0) for name in OUTCOMES},
        "statuses": {str(k): v for k, v in sorted(Counter(s.status for s in samples).items())},
        "achieved_rps": round(admitted, 1),
        "requests": len(ok),
        "admitted_in_window": in_window,
        "errors": refused,
        "admitted_fraction": _round(admitted / capacity_rps) if capacity_rps > 0 else None,
        "p50_ms": _round(percentile(ok, 50)),
        "p99_ms": _round(percentile(ok, 99)),
        "gateway_p50_ms": _round(percentile(refusals, 50)),
        "gateway_p99_ms": _round(percentile(refusals, 99)),
        "gateway_max_ms": _round(max(refusals, default=None)),
        "answer_within_ms": answer_within_ms,
        # Every request not admitted must be a gateway answer within the bound; with none
        # refused there is nothing to miss.
        "answered_within_fraction": _round(in_time / refused) if refused else 1.0,
        "envoy_errors": outcomes.get(ENVOY_ERROR, 0) + outcomes.get(CONNECTION_ERROR, 0),
        "timeouts": outcomes.get(TIMEOUT, 0),
        "send_late_p99_ms": _round(percentile(run.late_ms, 99)),
        **usage_fields(usage),
    }


def recovery_bound(baseline_p50_ms: float) -> float:
    """The p50 a window may have and count as recovered."""
    return max(RECOVERY_FACTOR * baseline_p50_ms, baseline_p50_ms + RECOVERY_SLACK_MS)


def window_p50s(samples: Sequence[Sample], window_s: float, watch_s: float) -> list[float | None]:
    """Each window's p50 (nearest rank; a non-2xx or a timeout is infinitely slow); None
    for a window in which nothing was sent."""
    count = max(1, math.ceil(watch_s / window_s - 1e-9))
    windows: list[list[float]] = [[] for _ in range(count)]
    for s in samples:
        index = int(s.sent_s // window_s)
        if 0 <= index < count:
            windows[index].append(s.latency_ms if s.outcome == OK else math.inf)
    found: list[float | None] = []
    for values in windows:
        if not values:
            found.append(None)
            continue
        values.sort()
        found.append(values[math.ceil(0.5 * len(values)) - 1])
    return found


def recovery_time(p50s: Sequence[float | None], window_s: float, bound_ms: float) -> float | None:
    """Seconds from the watch's start to the first window after which every window's p50
    is within ``bound_ms``; None when the last window is not (never recovered)."""
    first = len(p50s)
    for index in range(len(p50s) - 1, -1, -1):
        value = p50s[index]
        if value is None or value > bound_ms:
            break
        first = index
    return None if first == len(p50s) else round(first * window_s, 3)


def summarize_recovery(
    run: Classified,
    rate: float,
    baseline_p50_ms: float | None,
    window_s: float,
    watch_s: float,
    usage: Usage,
) -> dict[str, Any]:
    """The watch right after the overload: per window p50, and when it recovered."""
    p50s = window_p50s(run.samples, window_s, watch_s)
    bound = None if baseline_p50_ms is None else recovery_bound(baseline_p50_ms)
    recovered_at = None if bound is None else recovery_time(p50s, window_s, bound)
    ok = [s.latency_ms for s in run.samples if s.outcome == OK]
    return {
        "mode": "recovery",
        "target_rps": rate,
        "achieved_rps": round(len(ok) / max(run.elapsed_s, 1e-9), 1),
        "requests": len(ok),
        "errors": len(run.samples) - len(ok),
        "unsent": run.unsent,
        "p50_ms": _round(percentile(ok, 50)),
        "p99_ms": _round(percentile(ok, 99)),
        "baseline_p50_ms": baseline_p50_ms,
        "bound_ms": _round(bound),
        "window_s": window_s,
        "watch_s": watch_s,
        "windows": [
            {"t_s": round(i * window_s, 3), "p50_ms": None if v is None else _finite(v)}
            for i, v in enumerate(p50s)
        ],
        "recovered": recovered_at is not None,
        "recovery_s": recovered_at,
        "rule": RECOVERY_RULE,
        "send_late_p99_ms": _round(percentile(run.late_ms, 99)),
        **usage_fields(usage),
    }


def added_latency(direct: dict[str, Any], fairlane: dict[str, Any]) -> dict[str, float | None]:
    """fairlane minus direct at the same phase, for p50 and p99 (ms)."""
    return {
        key: _round(fairlane[key] - direct[key])
        if fairlane.get(key) is not None and direct.get(key) is not None
        else None
        for key in ("p50_ms", "p99_ms")
    }


def _finite(value: float) -> float | str:
    """JSON has no infinity: a window whose p50 was a failure says so."""
    return round(value, 3) if math.isfinite(value) else "failed"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
