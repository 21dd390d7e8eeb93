"""CPU accounting: how much each process of an arm used, and whether the numbers can be
trusted.

On a small shared machine the load generator or the machine itself can be the bottleneck,
and then latencies measure the harness, not the scheduler. So every run samples
``/proc/<pid>/stat`` (utime + stime) of each child, the load generator's own CPU, and the
machine's busy time from ``/proc/stat``, before and after the workload.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_TICKS = os.sysconf("SC_CLK_TCK")
LOADGEN = "load-generator"
# Thresholds for the warnings (fractions of one core / of the whole machine).
LOADGEN_LIMIT_CORES = 0.7
MACHINE_LIMIT_FRACTION = 0.9
# A client stall longer than both of these (wall, and simulated) distorts the percentiles.
LOOP_LAG_LIMIT_S = 0.05
LOOP_LAG_LIMIT_SIM_S = 1.0


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS


def self_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, summed over cores."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already inside user/nice
    return (total - idle) / _TICKS, total / _TICKS


@dataclass
class CpuSample:
    wall: float
    processes: dict[str, float | None]
    loadgen: float
    machine_busy: float


@dataclass
class CpuUsage:
    """CPU over one arm's workload: cores used per process (CPU seconds / wall seconds)."""

    wall_s: float
    cores: dict[str, float] = field(default_factory=dict)
    machine_cores: float = 0.0
    machine_capacity: int = 1
    warnings: list[str] = field(default_factory=list)
    loop_lag_max_s: float = 0.0
    """The load generator's worst event-loop lateness (wall seconds)."""
    machine_peak: float = 0.0
    """The machine's busiest second, as a fraction of all its cores."""
    speedup: float = 1.0

    def to_json(self) -> dict[str, object]:
        return {
            "wall_s": self.wall_s,
            "cores": self.cores,
            "machine_cores": self.machine_cores,
            "machine_capacity": self.machine_capacity,
            "warnings": self.warnings,
            "loop_lag_max_s": self.loop_lag_max_s,
            "machine_peak": self.machine_peak,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CpuUsage:
        """Read back from ``results.json`` (which has no ``speedup``: it is the run's)."""
        return cls(
            wall_s=data["wall_s"],
            cores=dict(data["cores"]),
            machine_cores=data["machine_cores"],
            machine_capacity=data["machine_capacity"],
            warnings=list(data["warnings"]),
            loop_lag_max_s=data.get("loop_lag_max_s", 0.0),
            machine_peak=data.get("machine_peak", 0.0),
        )


def sample(pids: Mapping[str, int]) -> CpuSample:
    return CpuSample(
        wall=time.monotonic(),
        processes={name: process_cpu_seconds(pid) for name, pid in pids.items()},
        loadgen=self_cpu_seconds(),
        machine_busy=machine_busy_seconds()[0],
    )


def usage(before: CpuSample, after: CpuSample) -> CpuUsage:
    wall = max(after.wall - before.wall, 1e-9)
    result = CpuUsage(wall_s=wall, machine_capacity=os.cpu_count() or 1)
    for name, start in before.processes.items():
        end = after.processes.get(name)
        if start is not None and end is not None:
            result.cores[name] = (end - start) / wall
    result.cores[LOADGEN] = (after.loadgen - before.loadgen) / wall
    result.machine_cores = (after.machine_busy - before.machine_busy) / wall
    result.warnings = warnings(result)
    return result


def warnings(cpu: CpuUsage) -> list[str]:
    found = []
    loadgen = cpu.cores.get(LOADGEN, 0.0)
    if loadgen > LOADGEN_LIMIT_CORES:
        found.append(
            f"WARNING: the load generator used {loadgen:.2f} of a core (> "
            f"{LOADGEN_LIMIT_CORES:.0%}): it may have been the bottleneck; latencies are not "
            "trustworthy"
        )
    limit = MACHINE_LIMIT_FRACTION * cpu.machine_capacity
    if cpu.machine_cores > limit:
        found.append(
            f"WARNING: the machine was {cpu.machine_cores:.2f} of {cpu.machine_capacity} cores "
            f"busy (> {MACHINE_LIMIT_FRACTION:.0%}): CPU was the bottleneck (other work "
            "counts too); figures are not trustworthy"
        )
    lag = cpu.loop_lag_max_s
    if lag > LOOP_LAG_LIMIT_S and lag * cpu.speedup > LOOP_LAG_LIMIT_SIM_S:
        found.append(
            f"WARNING: the load generator stalled for up to {lag * 1000:.0f} ms wall "
            f"({lag * cpu.speedup:.1f} s simulated; machine's busiest second "
            f"{cpu.machine_peak:.0%}): requests around then were sent and read late, so the "
            "high percentiles may be the machine's, not the scheduler's"
        )
    return found
