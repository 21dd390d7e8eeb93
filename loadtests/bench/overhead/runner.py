"""``fairlane bench overhead``: run the overhead scenario's arms and write the report.

The arms run one after the other against their own instant backend
(:mod:`loadtests.bench.overhead.backend`) (side by side they would steal each other's CPU):

* ``direct``: Envoy without ext_proc straight to the backend
  (:func:`loadtests.bench.fifo_bootstrap.render_fifo_bootstrap`);
* every fairlane arm (``fairlane``, ``fairlane-default`` ...): the same Envoy with the
  ext_proc filter and the completion access log, and one fairlane service process
  (:class:`extproc.ops.up.Stack`) with that arm's policy (and the backend's seats declared
  when the arm says so).

The fairlane arms run first, in the listed order, then ``direct``. Each arm is warmed up,
then: closed loop at saturation (its req/s is the arm's *capacity*); open loop at every rate
(``half_capacity`` resolved to half the arm's own capacity; ``direct`` runs every fairlane
arm's resolved rate); the concurrency-1 phase (the arm and the backend straight, one
connection each, alternating); and for a fairlane arm the overload (open loop at ``factor``
x its capacity) followed at once by the recovery watch. Per phase the latencies, errors and
every process's CPU (``loadtests/bench/cpu.py``) are kept. Every process lives in the arm's
:class:`ProcessGroup`, so it is stopped after the arm, also on failure or Ctrl-C; a process
that dies during an arm is named with its exit and log tail (:class:`ChildExited`) and the
arm is reported as failed, the other arms still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

from extproc.envoy.binary import envoy_argv
from extproc.envoy.params import EnvoyConfigError, EnvoyParams
from extproc.fleet.backend import BackendSpec
from extproc.ops.processes import NotReady, ProcessGroup, free_port, wait_http_ready
from extproc.ops.up import Stack, StackConfig
from loadtests.bench.cpu import machine_busy_seconds, process_cpu_seconds, self_cpu_seconds
from loadtests.bench.fifo_bootstrap import render_fifo_bootstrap
from loadtests.bench.overhead.eventloop import run_loop
from loadtests.bench.overhead.loadgen import LoadGenerator, concurrency1, settle
from loadtests.bench.overhead.phase import (
    RunResult,
    Usage,
    summarize,
    summarize_concurrency1,
    summarize_overload,
    summarize_recovery,
)
from loadtests.bench.overhead.report import write_report
from loadtests.bench.overhead.scenario import (
    DIRECT,
    HALF_CAPACITY,
    OverheadScenario,
    Rate,
)
from loadtests.bench.overhead.verdicts import evaluate

LOADGEN = (
    "in-process asyncio (uvloop) raw HTTP/1.1 keep-alive client "
    "(loadtests/bench/overhead/loadgen.py LoadGenerator), one core; open loop at fixed rates "
    "and in the overload (no coordinated omission), closed loop at saturation and at "
    "concurrency 1"
)
BACKEND = (
    "loadtests/bench/overhead/backend.py instant backend (1-token completion, no delay, uvloop)"
)


def _log(message: str) -> None:
    print(f"fairlane bench overhead: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Started:
    """A running arm: Envoy's client port, the backend's port, the pids by process name."""

    port: int
    backend_port: int
    pids: dict[str, int]


def start_backend(group: ProcessGroup, seats: int | None = None) -> BackendSpec:
    port = free_port()
    child = group.start(
        "backend", [sys.executable, "-m", "loadtests.bench.overhead.backend", "--port", str(port)]
    )
    spec = BackendSpec("127.0.0.1", port, "local", seats=seats)
    wait_http_ready(f"{spec.url}/health", child, timeout=30)
    return spec


def start_arm(arm: str, scenario: OverheadScenario, group: ProcessGroup) -> Started:
    """Start ``arm``'s processes in ``group``."""
    spec = scenario.fairlane_arm(arm)
    backend = start_backend(group, spec.seats if spec is not None else None)
    port = free_port()
    if spec is None:
        admin = free_port()
        params = EnvoyParams(listen_port=port, admin_port=admin, backends=(backend,))
        path = group.log_dir / "envoy-direct.yaml"
        path.write_text(yaml.safe_dump(render_fifo_bootstrap(params), sort_keys=False))
        envoy = group.start("envoy", envoy_argv(path))
        wait_http_ready(f"http://127.0.0.1:{admin}/ready", envoy, timeout=30)
    else:
        config = StackConfig(port=port, policy_path=spec.policy, backends=(backend,))
        Stack(config, group).start()
    pids = {child.name: child.popen.pid for child in group.children}
    return Started(port, backend.port, pids)


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
) -> RunResult:
    """One phase: open loop at ``rate``, or closed loop at saturation (``rate`` None)."""
    meter = Meter(pids)
    if rate is not None:
        latencies, errors = await gen.open_loop(rate, scenario.duration_s)
    else:
        latencies, errors = await gen.closed_loop(
            scenario.saturation_connections, scenario.duration_s
        )
    elapsed = time.monotonic() - meter.start
    mode = "rate" if rate is not None else "saturation"
    wall = max(elapsed, scenario.duration_s) if rate is not None else elapsed
    usage = meter.stop(wall)
    result = RunResult(mode, rate, wall, latencies_ms=latencies, errors=errors)
    if rate is not None:
        result.late_ms = gen.late_ms
    result.cpu_s = usage.cpu_s
    result.loadgen_cpu_s = usage.loadgen_cpu_s
    result.machine_busy_fraction = usage.machine_busy_fraction
    return result


def half_capacity(capacity_rps: float | None) -> float | None:
    """The ``half_capacity`` rate of an arm with this saturation req/s (whole req/s)."""
    if not capacity_rps or capacity_rps < 2:
        return None
    return float(round(capacity_rps / 2))


def resolve_rates(
    rates: tuple[Rate, ...], capacity_rps: float | None
) -> list[tuple[float, str | None]]:
    """A fairlane arm's rates as (req/s, label): ``half_capacity`` becomes half its own
    capacity (left out when it has none); a number stays itself."""
    found: list[tuple[float, str | None]] = []
    for rate in rates:
        if isinstance(rate, str):
            half = half_capacity(capacity_rps)
            if half is not None:
                found.append((half, HALF_CAPACITY))
        else:
            found.append((float(rate), None))
    return found


def direct_rates(
    rates: tuple[Rate, ...], halves: dict[str, float]
) -> list[tuple[float, str | None]]:
    """The direct arm's rates: every number, and every fairlane arm's ``half_capacity``
    (labelled with the arms it is half of), sorted, each once."""
    numbers = {float(r): None for r in rates if not isinstance(r, str)}
    labels: dict[float, list[str]] = {}
    if HALF_CAPACITY in rates:
        for arm, rate in halves.items():
            labels.setdefault(rate, []).append(arm)
    merged: dict[float, str | None] = dict(numbers)
    for rate, arms in labels.items():
        if rate not in merged:
            merged[rate] = f"{HALF_CAPACITY} of {', '.join(arms)}"
    return sorted(merged.items())


class Driver:
    """One arm's phases, in order; after each, every process must still be running."""

    def __init__(
        self, arm: str, started: Started, scenario: OverheadScenario, group: ProcessGroup
    ) -> None:
        self.arm, self.started, self.scenario, self.group = arm, started, scenario, group
        spec = scenario.fairlane_arm(arm)
        self.api_key = spec.api_key if spec is not None else "sk-overhead"
        self.gen = LoadGenerator(started.port, api_key=self.api_key)
        self.rows: list[dict[str, Any]] = []

    def _done(self, row: dict[str, Any], phase: str) -> None:
        self.rows.append(row)
        self.group.check_alive(f"arm {self.arm} at {phase}")
        _log(
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

    async def concurrency1(self) -> None:
        count = self.scenario.concurrency1_requests
        if count <= 0:
            return
        backend = LoadGenerator(self.started.backend_port, api_key=self.api_key)
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
            self.started.port, api_key=self.api_key, max_connections=spec.max_connections
        )
        meter = Meter(self.started.pids)
        run, pending = await flood.classified_loop(rate, spec.duration_s, spec.timeout_s)
        usage = meter.stop(run.elapsed_s)
        watch = LoadGenerator(self.started.port, api_key=self.api_key)
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
    """Warm up, then every phase of ``arm``; a fairlane arm's ``half_capacity`` goes into
    ``halves`` (the direct arm, which runs last, reads it)."""
    driver = Driver(arm, started, scenario, group)
    await driver.warm_up()
    capacity = await driver.saturation()
    if arm == DIRECT:
        await driver.rates(direct_rates(scenario.rates, halves))
    else:
        rates = resolve_rates(scenario.rates, capacity)
        half = half_capacity(capacity)
        if half is not None and HALF_CAPACITY in scenario.rates:
            halves[arm] = half
        elif HALF_CAPACITY in scenario.rates:
            _log(f"{arm}: no capacity measured, so no {HALF_CAPACITY} phase")
        await driver.rates(rates)
    await driver.concurrency1()
    if arm != DIRECT:
        await driver.overload(capacity)
    driver.gen.close()
    return driver.rows


def _role(name: str) -> str:
    return "backend" if name.startswith("backend") else name


def run_arm(
    arm: str,
    scenario: OverheadScenario,
    log_dir: Path,
    pids: dict[str, int],
    halves: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Start, drive and stop one arm; ``pids`` gets its processes' ids (by role) as soon as
    they run, so they are known also when the arm fails."""
    with ProcessGroup(log_dir) as group:
        started = start_arm(arm, scenario, group)
        pids.update({_role(n): p for n, p in started.pids.items()})
        _log(f"{arm}: up at http://127.0.0.1:{started.port} ({len(pids)} processes)")
        by_role = Started(started.port, started.backend_port, dict(pids))
        return run_loop(drive(arm, by_role, scenario, group, {} if halves is None else halves))


def scenario_json(scenario: OverheadScenario) -> dict[str, Any]:
    overload = scenario.overload
    return {
        "kind": "overhead",
        "name": scenario.name,
        "description": scenario.description,
        "path": str(scenario.path),
        "policy": os.path.relpath(scenario.policy),
        "fairlane_arms": {
            a.name: {"policy": os.path.relpath(a.policy), "api_key": a.api_key, "seats": a.seats}
            for a in scenario.fairlane_specs
        },
        "rates": list(scenario.rates),
        "duration_s": scenario.duration_s,
        "saturation_connections": scenario.saturation_connections,
        "warmup_requests": scenario.warmup_requests,
        "concurrency1_requests": scenario.concurrency1_requests,
        "overload": None
        if overload is None
        else {**dataclasses.asdict(overload), "recovery_rate": scenario.recovery_rate},
        "arms": list(scenario.arms),
        "run_order": list(scenario.run_order),
        "time_unit": "wall seconds; latencies in wall milliseconds",
    }


def bench_overhead(scenario: OverheadScenario, out: Path) -> dict[str, Any]:
    """Run every arm and write report.md, results.json and the plots; the results."""
    arms: dict[str, list[dict[str, Any]]] = {}
    failed: dict[str, str] = {}
    pids: dict[str, dict[str, int]] = {}
    halves: dict[str, float] = {}
    for arm in scenario.run_order:
        pids[arm] = {}
        try:
            arms[arm] = run_arm(arm, scenario, out / "logs" / arm, pids[arm], halves)
        except (NotReady, EnvoyConfigError, OSError, RuntimeError) as exc:
            # The arm's processes are already stopped (ProcessGroup); report and go on.
            failed[arm] = f"{type(exc).__name__}: {exc}"
            _log(f"{arm}: FAILED: {failed[arm]}")
    results: dict[str, Any] = {
        "scenario": scenario_json(scenario),
        "meta": {
            "loadgen": LOADGEN,
            "backend": BACKEND,
            "cpus": os.cpu_count(),
            "saturation_connections": scenario.saturation_connections,
        },
        "arms": arms,
        "half_capacity_rps": halves,
        "failed_arms": failed,
        "pids": pids,
    }
    results["targets"] = [t.to_json() for t in evaluate(scenario, arms)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    write_report(out, results)
    return results


def print_summary(results: dict[str, Any], out: Path) -> None:
    for name, error in results["failed_arms"].items():
        print(f"{name}: FAILED: {error.splitlines()[0]} (logs under {out / 'logs' / name})")
    print("targets:")
    for t in results["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "N/A"}[t["passed"]]
        sign = "<=" if t["op"] == "max" else ">="
        measured = "-" if t["measured"] is None else f"{t['measured']:g}"
        note = f" ({t['note']})" if t["note"] else ""
        arm = f"[{t['arm']}] " if t.get("arm") else ""
        print(f"  {verdict} {arm}{t['name']}: {measured} {sign} {t['bound']:g}{note}")
    print(f"report: {out / 'report.md'}\nresults: {out / 'results.json'}")


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_scenario(scenario: OverheadScenario, out: Path | None) -> int:
    """Run and report; 0 when every arm ran (targets may fail), 1 otherwise."""
    out = out or (
        Path(tempfile.gettempdir())
        / "fairlane-bench"
        / f"{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        results = bench_overhead(scenario, out)
    except KeyboardInterrupt:
        _log("interrupted; every process was stopped")
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_summary(results, out)
    return 1 if results["failed_arms"] else 0


def run(args: argparse.Namespace, scenario: OverheadScenario) -> int:
    """``fairlane bench`` with a ``kind: overhead`` scenario (options already checked)."""
    return run_scenario(scenario, args.out)
