"""``fairlane bench overhead``: run the overhead scenario's arms and write the report.

Two arms against the same instant backend (:mod:`loadtests.bench.overhead.backend`), one
after the other
(side by side they would steal each other's CPU):

* ``direct``: Envoy without ext_proc straight to the backend
  (:func:`loadtests.bench.fifo_bootstrap.render_fifo_bootstrap`);
* ``fairlane``: the same Envoy with the ext_proc filter and the completion access log, and
  one fairlane service process (:class:`extproc.ops.up.Stack`) with the scenario's policy.

Each arm is warmed up, driven open loop at every rate, then closed loop at saturation; per
phase the latencies, errors and every process's CPU (``loadtests/bench/cpu.py``) are kept.
Every process lives in the arm's :class:`ProcessGroup`, so it is stopped after the arm, also
on failure or Ctrl-C; a process that dies during an arm is named with its exit and log tail
(:class:`ChildExited`) and the arm is reported as failed, the other arm still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
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
from loadtests.bench.overhead.loadgen import LoadGenerator
from loadtests.bench.overhead.phase import RunResult, summarize
from loadtests.bench.overhead.report import write_report
from loadtests.bench.overhead.scenario import OverheadScenario
from loadtests.bench.overhead.verdicts import evaluate

LOADGEN = (
    "in-process asyncio (uvloop) raw HTTP/1.1 keep-alive client "
    "(loadtests/bench/overhead/loadgen.py LoadGenerator), one core; open loop at fixed rates "
    "(no coordinated omission), closed loop at saturation"
)
BACKEND = (
    "loadtests/bench/overhead/backend.py instant backend (1-token completion, no delay, uvloop)"
)


def _log(message: str) -> None:
    print(f"fairlane bench overhead: {message}", file=sys.stderr, flush=True)


def start_backend(group: ProcessGroup) -> BackendSpec:
    port = free_port()
    child = group.start(
        "backend", [sys.executable, "-m", "loadtests.bench.overhead.backend", "--port", str(port)]
    )
    spec = BackendSpec("127.0.0.1", port, "local")
    wait_http_ready(f"{spec.url}/health", child, timeout=30)
    return spec


def start_arm(
    arm: str, scenario: OverheadScenario, group: ProcessGroup
) -> tuple[int, dict[str, int]]:
    """Start ``arm``'s processes in ``group``; (Envoy's client port, pids by role)."""
    backend = start_backend(group)
    port = free_port()
    if arm == "direct":
        admin = free_port()
        params = EnvoyParams(listen_port=port, admin_port=admin, backends=(backend,))
        path = group.log_dir / "envoy-direct.yaml"
        path.write_text(yaml.safe_dump(render_fifo_bootstrap(params), sort_keys=False))
        envoy = group.start("envoy", envoy_argv(path))
        wait_http_ready(f"http://127.0.0.1:{admin}/ready", envoy, timeout=30)
    else:
        config = StackConfig(port=port, policy_path=scenario.policy, backends=(backend,))
        Stack(config, group).start()
    return port, {child.name: child.popen.pid for child in group.children}


async def _measure(
    gen: LoadGenerator,
    pids: dict[str, int],
    scenario: OverheadScenario,
    rate: float | None,
) -> RunResult:
    """One phase: open loop at ``rate``, or closed loop at saturation (``rate`` None)."""
    before = {name: process_cpu_seconds(pid) or 0.0 for name, pid in pids.items()}
    self_before = self_cpu_seconds()
    busy0, total0 = machine_busy_seconds()
    start = time.monotonic()
    if rate is not None:
        latencies, errors = await gen.open_loop(rate, scenario.duration_s)
    else:
        latencies, errors = await gen.closed_loop(
            scenario.saturation_connections, scenario.duration_s
        )
    elapsed = time.monotonic() - start
    busy1, total1 = machine_busy_seconds()
    mode = "rate" if rate is not None else "saturation"
    wall = max(elapsed, scenario.duration_s) if rate is not None else elapsed
    result = RunResult(mode, rate, wall, latencies_ms=latencies, errors=errors)
    if rate is not None:
        result.late_ms = gen.late_ms
    for name, pid in pids.items():
        after = process_cpu_seconds(pid)
        if after is not None:
            result.cpu_s[name] = after - before[name]
    result.loadgen_cpu_s = self_cpu_seconds() - self_before
    result.machine_busy_fraction = (busy1 - busy0) / max(total1 - total0, 1e-9)
    return result


async def drive(
    arm: str, port: int, pids: dict[str, int], scenario: OverheadScenario, group: ProcessGroup
) -> list[dict[str, Any]]:
    """Warm up, then every phase; after each, every process must still be running."""
    gen = LoadGenerator(port)
    for _ in range(scenario.warmup_requests):
        await gen.one()
    group.check_alive(f"arm {arm} (warm-up)")
    phases: list[float | None] = list(scenario.rates)
    if scenario.saturation_connections > 0:
        phases.append(None)
    rows = []
    for rate in phases:
        rows.append(summarize(await _measure(gen, pids, scenario, rate)))
        row = rows[-1]
        phase = f"{rate:g} req/s" if rate is not None else "saturation"
        group.check_alive(f"arm {arm} at {phase}")
        _log(
            f"{arm} {phase}: {row['achieved_rps']} req/s, p50/p99 {row['p50_ms']}/"
            f"{row['p99_ms']} ms, {row['errors']} errors"
        )
    return rows


def _role(name: str) -> str:
    return "backend" if name.startswith("backend") else name


def run_arm(
    arm: str, scenario: OverheadScenario, log_dir: Path, pids: dict[str, int]
) -> list[dict[str, Any]]:
    """Start, drive and stop one arm; ``pids`` gets its processes' ids (by role) as soon as
    they run, so they are known also when the arm fails."""
    with ProcessGroup(log_dir) as group:
        port, started = start_arm(arm, scenario, group)
        pids.update({_role(n): p for n, p in started.items()})
        _log(f"{arm}: up at http://127.0.0.1:{port} ({len(pids)} processes)")
        return run_loop(drive(arm, port, dict(pids), scenario, group))


def scenario_json(scenario: OverheadScenario) -> dict[str, Any]:
    return {
        "kind": "overhead",
        "name": scenario.name,
        "description": scenario.description,
        "path": str(scenario.path),
        "policy": os.path.relpath(scenario.policy),
        "rates": list(scenario.rates),
        "duration_s": scenario.duration_s,
        "saturation_connections": scenario.saturation_connections,
        "warmup_requests": scenario.warmup_requests,
        "arms": list(scenario.arms),
        "time_unit": "wall seconds; latencies in wall milliseconds",
    }


def bench_overhead(scenario: OverheadScenario, out: Path) -> dict[str, Any]:
    """Run every arm and write report.md, results.json and the plots; the results."""
    arms: dict[str, list[dict[str, Any]]] = {}
    failed: dict[str, str] = {}
    pids: dict[str, dict[str, int]] = {}
    for arm in scenario.arms:
        pids[arm] = {}
        try:
            arms[arm] = run_arm(arm, scenario, out / "logs" / arm, pids[arm])
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
        print(f"  {verdict} {t['name']}: {measured} {sign} {t['bound']:g}{note}")
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
