"""CPU accounting: how much each process of an arm used, and whether the numbers can be
trusted.

On a small shared machine the load generator or the machine itself can be the bottleneck,
and then latencies measure the harness, not the scheduler. So every run samples
``/proc/<pid>/stat`` (utime + stime) of each child, the load generator's own CPU, and the
machine's busy time from ``/proc/stat``, before and after the workload. When the bench
pinned the gateway's side to its own cores (:mod:`loadtests.bench.pinning`), those cores'
busy time is what says whether the gateway was CPU-bound: the engines' cores are busy by
design.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

_TICKS = os.sysconf("SC_CLK_TCK")
LOADGEN = "load-generator"
# Thresholds for the warnings (fractions of one core / of the whole machine).
LOADGEN_LIMIT_CORES = 0.7
MACHINE_LIMIT_FRACTION = 0.9
GATEWAY_CORES = "gateway"
"""The core set of the gateway's side (Envoy, the service, the load generator) when pinned."""
GATEWAY_LIMIT_FRACTION = 0.85
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


def cores_busy_seconds(cpus: Collection[int]) -> tuple[float, float]:
    """(busy, total) CPU seconds of the cores ``cpus`` since boot, from ``/proc/stat``."""
    busy = total = 0.0
    wanted = {f"cpu{c}" for c in cpus}
    with open("/proc/stat") as f:
        for line in f:
            name, _, rest = line.partition(" ")
            if name in wanted:
                values = [int(v) for v in rest.split()]
                idle = values[3] + (values[4] if len(values) > 4 else 0)
                busy += sum(values[:8]) - idle
                total += sum(values[:8])
    return busy / _TICKS, total / _TICKS


@dataclass
class CpuSample:
    wall: float
    processes: dict[str, float | None]
    loadgen: float
    machine_busy: float
    core_sets: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Each pinned core set's (busy, total) seconds (``cores_busy_seconds``)."""


@dataclass(frozen=True)
class CoreSetUse:
    """One pinned core set over the workload: its cores, and the share of them busy."""

    cpus: str
    busy: float

    def to_json(self) -> dict[str, object]:
        return {"cpus": self.cpus, "busy": self.busy}


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
    core_sets: dict[str, CoreSetUse] = field(default_factory=dict)
    """Pinned runs: each core set (``gateway``, ``engines``) and how busy it was."""
    affinity: dict[str, str] = field(default_factory=dict)
    """Pinned runs: the cores each process was allowed, as the kernel said during the arm."""

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "wall_s": self.wall_s,
            "cores": self.cores,
            "machine_cores": self.machine_cores,
            "machine_capacity": self.machine_capacity,
            "warnings": self.warnings,
            "loop_lag_max_s": self.loop_lag_max_s,
            "machine_peak": self.machine_peak,
        }
        if self.core_sets:
            data["core_sets"] = {name: use.to_json() for name, use in self.core_sets.items()}
            data["affinity"] = dict(self.affinity)
        return data

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
            core_sets={
                name: CoreSetUse(use["cpus"], use["busy"])
                for name, use in data.get("core_sets", {}).items()
            },
            affinity=dict(data.get("affinity", {})),
        )


def sample(
    pids: Mapping[str, int], core_sets: Mapping[str, Collection[int]] | None = None
) -> CpuSample:
    """CPU so far of ``pids``, the load generator, the machine and each of ``core_sets``."""
    return CpuSample(
        wall=time.monotonic(),
        processes={name: process_cpu_seconds(pid) for name, pid in pids.items()},
        loadgen=self_cpu_seconds(),
        machine_busy=machine_busy_seconds()[0],
        core_sets={name: cores_busy_seconds(cpus) for name, cpus in (core_sets or {}).items()},
    )


def usage(
    before: CpuSample, after: CpuSample, core_sets: Mapping[str, str] | None = None
) -> CpuUsage:
    """The CPU between two samples; ``core_sets``: each sampled core set's cores as text."""
    wall = max(after.wall - before.wall, 1e-9)
    result = CpuUsage(wall_s=wall, machine_capacity=os.cpu_count() or 1)
    for name, start in before.processes.items():
        end = after.processes.get(name)
        if start is not None and end is not None:
            result.cores[name] = (end - start) / wall
    result.cores[LOADGEN] = (after.loadgen - before.loadgen) / wall
    result.machine_cores = (after.machine_busy - before.machine_busy) / wall
    for name, (busy0, total0) in before.core_sets.items():
        busy1, total1 = after.core_sets.get(name, (busy0, total0))
        share = (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0
        result.core_sets[name] = CoreSetUse((core_sets or {}).get(name, "?"), share)
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
    gateway = cpu.core_sets.get(GATEWAY_CORES)
    limit = MACHINE_LIMIT_FRACTION * cpu.machine_capacity
    if gateway is not None:
        # Pinned: the engines' cores are busy by design; the gateway's tell.
        if gateway.busy > GATEWAY_LIMIT_FRACTION:
            found.append(
                f"WARNING: the gateway's cores (CPUs {gateway.cpus}: Envoy, the service, the "
                f"load generator) were {gateway.busy:.0%} busy (> "
                f"{GATEWAY_LIMIT_FRACTION:.0%}): CPU was the bottleneck there (other work on "
                "them counts too); figures are not trustworthy"
            )
    elif cpu.machine_cores > limit:
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
