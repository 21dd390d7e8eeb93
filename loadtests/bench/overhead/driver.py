"""One arm of the overhead bench, phase by phase: what is sent and what is measured.

:class:`Driver` runs an arm's phases in order (warm-up, saturation, the rates, concurrency
1, for a fairlane arm the overload and the recovery watch, for ``direct`` the backend
alone); :class:`Meter` takes every process's CPU, the generator's and the machine's over
each. After each phase every process of the arm must still be running
(``ProcessGroup.check_alive``), so a crash is named where it happened.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from extproc.ops.processes import ProcessGroup
from loadtests.bench.cpu import machine_busy_seconds, process_cpu_seconds, self_cpu_seconds
from loadtests.bench.overhead.loadgen import LoadGenerator, concurrency1, settle
from loadtests.bench.overhead.phase import (
    RunResult,
    Usage,
    summarize,
    summarize_concurrency1,
    summarize_overload,
    summarize_recovery,
)
from loadtests.bench.overhead.rates import direct_rates, half_capacity, resolve_rates
from loadtests.bench.overhead.scenario import DIRECT, HALF_CAPACITY, PEERS, OverheadScenario


def log(message: str) -> None:
    print(f"fairlane bench overhead: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Started:
    """A running arm: Envoy's client port, the backend's port, the pids by process name."""

    port: int
    backend_port: int
    pids: dict[str, int]


class Meter:
    """CPU of every process, of the generator and of the machine over one phase."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.before = {name: process_cpu_seconds(pid) or 0.0 for name, pid in pids.items()}
        self.self_before = self_cpu_seconds()
        self.busy0, self.total0 = machine_busy_seconds()
        self.start = time.monotonic()

    def stop(self, wall_s: float | None = None) -> Usage:
        """The usage since the meter started, over ``wall_s`` (default: the time elapsed)."""
        busy1, total1 = machine_busy_seconds()
        usage = Usage(wall_s if wall_s is not None else time.monotonic() - self.start)
        for name, pid in self.pids.items():
            after = process_cpu_seconds(pid)
            if after is not None:
                usage.cpu_s[name] = after - self.before[name]
        usage.loadgen_cpu_s = self_cpu_seconds() - self.self_before
        usage.machine_busy_fraction = (busy1 - self.busy0) / max(total1 - self.total0, 1e-9)
        return usage


async def _measure(
    gen: LoadGenerator,
    pids: dict[str, int],
    scenario: OverheadScenario,
    rate: float | None,
    mode: str | None = None,
) -> RunResult:
    """One phase: open loop at ``rate``, or closed loop at saturation (``rate`` None);
    ``mode`` names an open-loop phase other than the arm's own rates (``backend``)."""
    meter = Meter(pids)
    if rate is not None:
        latencies, errors = await gen.open_loop(rate, scenario.duration_s)
    else:
        latencies, errors = await gen.closed_loop(
            scenario.saturation_connections, scenario.duration_s
        )
    elapsed = time.monotonic() - meter.start
    mode = mode or ("rate" if rate is not None else "saturation")
    wall = max(elapsed, scenario.duration_s) if rate is not None else elapsed
    usage = meter.stop(wall)
    result = RunResult(mode, rate, wall, latencies_ms=latencies, errors=errors)
    if rate is not None:
        result.late_ms = gen.late_ms
    result.cpu_s = usage.cpu_s
    result.loadgen_cpu_s = usage.loadgen_cpu_s
    result.machine_busy_fraction = usage.machine_busy_fraction
    return result


class Driver:
    """One arm's phases, in order; after each, every process must still be running."""

    def __init__(
        self, arm: str, started: Started, scenario: OverheadScenario, group: ProcessGroup
    ) -> None:
        self.arm, self.started, self.scenario, self.group = arm, started, scenario, group
        spec = scenario.fairlane_arm(arm)
        self.api_keys = spec.api_keys if spec is not None else ("sk-overhead",)
        self.gen = LoadGenerator(started.port, api_key=self.api_keys)
        self.rows: list[dict[str, Any]] = []

    def _done(self, row: dict[str, Any], phase: str) -> None:
        self.rows.append(row)
        self.group.check_alive(f"arm {self.arm} at {phase}")
        log(
            f"{self.arm} {phase}: {row['achieved_rps']} req/s, p50/p99 {row['p50_ms']}/"
            f"{row['p99_ms']} ms, {row['errors']} errors"
        )

    async def warm_up(self) -> None:
        for _ in range(self.scenario.warmup_requests):
            await self.gen.one()
        self.group.check_alive(f"arm {self.arm} (warm-up)")

    async def saturation(self) -> float | None:
        """The closed-loop phase; the arm's capacity (its req/s), None when skipped."""
        if self.scenario.saturation_connections <= 0:
            return None
        row = summarize(await _measure(self.gen, self.started.pids, self.scenario, None))
        self._done(row, "saturation")
        return float(row["achieved_rps"])

    async def rates(self, rates: list[tuple[float, str | None]]) -> None:
        for rate, label in rates:
            row = summarize(await _measure(self.gen, self.started.pids, self.scenario, rate))
            if label is not None:
                row["rate_label"] = label
            self._done(row, f"{rate:g} req/s" + (f" ({label})" if label else ""))

    async def backend_alone(self, rates: tuple[float, ...]) -> None:
        """Open loop straight to the backend at each rate (mode ``backend``): the latency
        a whole gateway, Envoy included or a peer in its place, adds to."""
        gen = LoadGenerator(self.started.backend_port, api_key=self.api_keys)
        for rate in rates:
            run = await _measure(gen, self.started.pids, self.scenario, rate, "backend")
            self._done(summarize(run), f"the backend alone at {rate:g} req/s")
        gen.close()

    async def concurrency1(self) -> None:
        count = self.scenario.concurrency1_requests
        if count <= 0:
            return
        backend = LoadGenerator(self.started.backend_port, api_key=self.api_keys)
        meter = Meter(self.started.pids)
        through, direct, errors = await concurrency1(self.gen, backend, count)
        usage = meter.stop()
        backend.close()
        self._done(summarize_concurrency1(through, direct, errors, usage), "concurrency 1")

    async def overload(self, capacity_rps: float | None) -> None:
        """Open loop at ``factor`` x the capacity, then at once the recovery watch (the
        overload's last requests drain while it runs)."""
        spec = self.scenario.overload
        recovery_rate = self.scenario.recovery_rate
        if spec is None or not capacity_rps or recovery_rate is None:
            return
        rate = spec.factor * capacity_rps
        flood = LoadGenerator(
            self.started.port, api_key=self.api_keys, max_connections=spec.max_connections
        )
        meter = Meter(self.started.pids)
        run, pending = await flood.classified_loop(rate, spec.duration_s, spec.timeout_s)
        usage = meter.stop(run.elapsed_s)
        watch = LoadGenerator(self.started.port, api_key=self.api_keys)
        meter = Meter(self.started.pids)
        recovery, watching = await watch.classified_loop(
            recovery_rate, spec.recovery_max_s, spec.timeout_s
        )
        await settle(watching, spec.timeout_s + 5)
        recovery_usage = meter.stop(recovery.elapsed_s)
        await settle(pending, spec.timeout_s + 5)
        flood.close()
        watch.close()
        self._done(
            summarize_overload(
                run, rate, capacity_rps, spec.answer_within_ms, spec.max_connections, usage
            ),
            f"overload ({spec.factor:g} x {capacity_rps:g} req/s)",
        )
        baseline = next(
            (
                r["p50_ms"]
                for r in self.rows
                if r["mode"] == "rate" and r["target_rps"] == recovery_rate
            ),
            None,
        )
        self._done(
            summarize_recovery(
                recovery,
                recovery_rate,
                baseline,
                spec.recovery_window_s,
                spec.recovery_max_s,
                recovery_usage,
            ),
            f"recovery at {recovery_rate:g} req/s",
        )


async def drive(
    arm: str,
    started: Started,
    scenario: OverheadScenario,
    group: ProcessGroup,
    halves: dict[str, float],
) -> list[dict[str, Any]]:
    """Warm up, then every phase of ``arm``: closed loop at saturation (its req/s is the
    arm's capacity), open loop at every rate, concurrency 1 (the arm and the backend
    alternately), and for a fairlane arm the overload at ``factor`` x its capacity with the
    recovery watch. A fairlane arm's ``half_capacity`` goes into ``halves`` (the direct arm,
    which runs last, runs it too); a peer runs the numeric rates only and no overload;
    ``direct`` also measures the backend alone at the numeric rates."""
    driver = Driver(arm, started, scenario, group)
    await driver.warm_up()
    capacity = await driver.saturation()
    if arm == DIRECT:
        await driver.rates(direct_rates(scenario.rates, halves))
    elif arm in PEERS:
        await driver.rates([(rate, None) for rate in scenario.numeric_rates])
    else:
        rates = resolve_rates(scenario.rates, capacity)
        half = half_capacity(capacity)
        if half is not None and HALF_CAPACITY in scenario.rates:
            halves[arm] = half
        elif HALF_CAPACITY in scenario.rates:
            log(f"{arm}: no capacity measured, so no {HALF_CAPACITY} phase")
        await driver.rates(rates)
    await driver.concurrency1()
    if arm == DIRECT:
        await driver.backend_alone(scenario.numeric_rates)
    elif arm not in PEERS:
        await driver.overload(capacity)
    driver.gen.close()
    return driver.rows
