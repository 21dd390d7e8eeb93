"""``fairlane bench overhead``: run the overhead scenario's arms and write the report.

The arms run one after the other (side by side they would steal each other's CPU), each
against its own instant backend (:mod:`loadtests.bench.overhead.backend`): ``direct`` (Envoy
without ext_proc), every fairlane arm (the same Envoy with the ext_proc filter and one
service process with the arm's policy), and the peers the scenario names (vllm-router
round_robin, the LiteLLM proxy: :mod:`loadtests.bench.peers`) in place of both. The fairlane
arms and the peers run first, in the listed order, ``direct`` last, at every rate they
resolved; :mod:`~loadtests.bench.overhead.driver` runs an arm's phases. Every process lives
in the arm's :class:`ProcessGroup`, so it is stopped after the arm, also on failure or
Ctrl-C; a process that dies during an arm is named with its exit and log tail
(:class:`ChildExited`) and the arm is reported as failed, the other arms still run.
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
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

from extproc.envoy.binary import envoy_argv
from extproc.envoy.params import EnvoyConfigError, EnvoyParams
from extproc.fleet.backend import BackendSpec
from extproc.ops.processes import NotReady, ProcessGroup, free_port, wait_http_ready
from extproc.ops.up import Stack, StackConfig
from loadtests.bench.fifo_bootstrap import render_fifo_bootstrap
from loadtests.bench.overhead.driver import Started, drive, log
from loadtests.bench.overhead.eventloop import run_loop
from loadtests.bench.overhead.gateways import gateway_figures
from loadtests.bench.overhead.loadgen import API_KEY, MODEL
from loadtests.bench.overhead.report import write_report
from loadtests.bench.overhead.scenario import PEERS, OverheadScenario
from loadtests.bench.overhead.verdicts import evaluate
from loadtests.bench.peers.litellm import start_litellm
from loadtests.bench.peers.vllm_router import start_vllm_router

LOADGEN = (
    "in-process asyncio (uvloop) raw HTTP/1.1 keep-alive client "
    "(loadtests/bench/overhead/loadgen.py LoadGenerator), one core; open loop at fixed rates "
    "and in the overload (no coordinated omission), closed loop at saturation and at "
    "concurrency 1"
)
BACKEND = (
    "loadtests/bench/overhead/backend.py instant backend (1-token completion, no delay, uvloop)"
)


def start_backend(group: ProcessGroup, seats: int | None = None) -> BackendSpec:
    port = free_port()
    child = group.start(
        "backend", [sys.executable, "-m", "loadtests.bench.overhead.backend", "--port", str(port)]
    )
    spec = BackendSpec("127.0.0.1", port, "local", seats=seats)
    wait_http_ready(f"{spec.url}/health", child, timeout=30)
    return spec


def start_peer(arm: str, backend: BackendSpec, group: ProcessGroup) -> int:
    """Start a peer gateway (:data:`PEERS`) in front of ``backend``; its port."""
    if arm == "litellm":
        url = start_litellm(group, (backend,), master_key=API_KEY, models=(MODEL,))
    else:
        url = start_vllm_router(group, (backend,), "round_robin")
    return int(url.rsplit(":", 1)[1])


def start_arm(arm: str, scenario: OverheadScenario, group: ProcessGroup) -> Started:
    """Start ``arm``'s processes in ``group``."""
    spec = scenario.fairlane_arm(arm)
    backend = start_backend(group, spec.seats if spec is not None else None)
    port = free_port()
    if arm in PEERS:
        port = start_peer(arm, backend, group)
    elif spec is None:
        admin = free_port()
        params = EnvoyParams(listen_port=port, admin_port=admin, backends=(backend,))
        path = group.log_dir / "envoy-direct.yaml"
        path.write_text(yaml.safe_dump(render_fifo_bootstrap(params), sort_keys=False))
        envoy = group.start("envoy", envoy_argv(path))
        wait_http_ready(f"http://127.0.0.1:{admin}/ready", envoy, timeout=30)
    else:
        config = StackConfig(
            port=port,
            policy_path=spec.policy,
            backends=(backend,),
            replicas=spec.replicas,
            shared_state=spec.shared_state or None,
        )
        Stack(config, group).start()
    pids = {child.name: child.popen.pid for child in group.children}
    return Started(port, backend.port, pids)


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
        log(f"{arm}: up at http://127.0.0.1:{started.port} ({len(pids)} processes)")
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
            a.name: {
                "policy": os.path.relpath(a.policy),
                "api_keys": list(a.api_keys),
                "seats": a.seats,
            }
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
            log(f"{arm}: FAILED: {failed[arm]}")
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
    results["gateways"] = gateway_figures(arms, scenario.numeric_rates)
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
        log("interrupted; every process was stopped")
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_summary(results, out)
    return 1 if results["failed_arms"] else 0


def run(args: argparse.Namespace, scenario: OverheadScenario) -> int:
    """``fairlane bench`` with a ``kind: overhead`` scenario (options already checked)."""
    return run_scenario(scenario, args.out)
