"""``fairlane bench SCENARIO``: run every arm of a scenario, one after the other, and report.

Arms run sequentially on the same machine (never side by side: they would steal each
other's CPU), each in its own :class:`ProcessGroup`, so its processes are stopped before the
next arm starts, also when a run fails or is interrupted. The exit code says whether the
benchmark *ran* (0) or could not (1); targets that fail are reported, not an error, because
the harness is used to measure schedulers that do not meet them yet.

A ``kind: overhead`` scenario (``overhead.yaml``) goes to :mod:`loadtests.bench.overhead.runner`;
``--backend`` runs the arms against existing engines instead of simulators, ``--engine``
against real engines the bench starts (:mod:`loadtests.bench.engine`); both pin the engines
and the gateway's side to separate cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from extproc.envoy.params import EnvoyConfigError
from extproc.fleet.backend import BackendSpec
from extproc.ops.processes import NotReady, ProcessGroup
from extproc.policy import load_policy
from extproc.transport.server import add_kv_event_arguments, kv_hash_arguments
from loadtests.bench import cpu, report
from loadtests.bench.arms import start_arm
from loadtests.bench.cachestats import window_hit_rate
from loadtests.bench.client import RequestRecord, run_load
from loadtests.bench.engine import EngineError, Placement, check_arguments, run_placement
from loadtests.bench.engine import add_arguments as add_engine_arguments
from loadtests.bench.external import (
    RESET_NEEDS,
    BackendError,
    check_precise,
    external_backends,
    reset_prefix_caches,
)
from loadtests.bench.gateway_metrics import predicted_tokens, prefix_matches, scrape_all
from loadtests.bench.pinning import PinningError, affinities, cpu_list_text
from loadtests.bench.replica_flows import placement, replica_flows
from loadtests.bench.results import ArmResult, BenchResults
from loadtests.bench.scenario import (
    Document,
    Scenario,
    ScenarioError,
    load_scenario,
    read_document,
)
from loadtests.bench.stats import arm_summary
from loadtests.bench.targets import evaluate, mark_suspect


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="a name under loadtests/scenarios/ or a path")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: $TMPDIR/fairlane-bench/NAME-TIMESTAMP)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="simulated seconds (overrides the scenario's duration_s; for overhead: wall "
        "seconds per phase)",
    )
    parser.add_argument(
        "--speedup",
        type=float,
        default=None,
        help="simulated seconds per wall second (overrides the scenario)",
    )
    parser.add_argument(
        "--arms", default=None, help="comma-separated subset of the scenario's arms (default: all)"
    )
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="an existing OpenAI-compatible engine (e.g. a real vLLM at http://IP:PORT; "
        "repeatable): the arms target these instead of starting simulators, and their "
        "scheduling policy is theirs for every arm",
    )
    parser.add_argument(
        "--model", default=None, help="the model name to send (overrides the scenario's model)"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="run every fairlane arm's service as N replicas sharing state in a local Redis "
        "(default 1: one process, state in memory)",
    )
    parser.add_argument(
        "--shared-state",
        action="store_true",
        help="put the service's state in a local Redis even with one replica (to weigh "
        "shared against in-process state)",
    )
    # The precise arms' matching, as `fairlane serve` takes it: with --backend, the engines'
    # tokenizer and hash settings (simulators: their builtin tokenizer, vLLM's defaults).
    add_kv_event_arguments(parser)
    add_engine_arguments(parser)


def raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _log(message: str) -> None:
    print(f"fairlane bench: {message}", file=sys.stderr, flush=True)


def run_arm(
    scenario: Scenario,
    arm_name: str,
    log_dir: Path,
    external: tuple[BackendSpec, ...] = (),
    policy: Path | None = None,
    placed: Placement | None = None,
) -> tuple[list[RequestRecord], ArmResult]:
    """Start the arm, play the workload, stop everything; records and the arm's summary.
    ``policy``: the file the gateway reads (default: the scenario's, see ``start_arm``);
    ``placed``: the engines the bench started and the cores it pinned (their CPU counted).

    A process of the arm that dies ends the load early and fails the arm with
    :class:`ChildExited` (which process, its exit, its log's last lines); the group still
    stops the others."""
    arm = scenario.arm(arm_name)
    started = time.monotonic()
    with ProcessGroup(log_dir) as group:
        running = start_arm(scenario, arm, group, external, policy)
        _log(
            f"{arm.name}: up at {running.url} ({len(running.pids)} processes); "
            f"{scenario.wall_duration_s:.1f} s of load"
        )
        where = placed or Placement(external)
        pids = {**running.pids, **where.engine_pids()}
        core_sets = where.core_sets()
        before = cpu.sample(pids, core_sets)
        load = run_load(
            scenario,
            arm.name,
            scenario.groups_of(arm),
            running.url,
            running.backend_urls,
            healthy=lambda: all(child.alive() for child in group.children) and where.alive(),
        )
        group.check_alive(f"arm {arm.name}")
        where.check_alive(f"arm {arm.name}")
        after = cpu.sample(pids, core_sets)
        allowed = affinities({**pids, cpu.LOADGEN: os.getpid()}) if core_sets else {}
        gateway = scrape_all(running.service_metrics)
    replicas = replica_flows(gateway) if running.replicated else {}
    texts = list(gateway.values())
    matches, predicted = prefix_matches(texts), predicted_tokens(texts)
    records, capped = load.records, load.capped
    usage = cpu.usage(before, after, {n: cpu_list_text(c) for n, c in core_sets.items()})
    usage.affinity = allowed
    usage.loop_lag_max_s, usage.machine_peak = load.loop_lag_max_s, load.machine_peak
    usage.speedup = scenario.speedup
    usage.warnings = cpu.warnings(usage)
    summary = dataclasses.replace(
        arm_summary(scenario, records), prefix_cache=window_hit_rate(*load.prefix_window)
    )
    total = summary.total
    _log(
        f"{arm.name}: {total.ok} ok of {total.sent} sent, "
        f"{total.unfinished} unfinished, {time.monotonic() - started:.1f} s wall"
    )
    if replicas:
        _log(f"{arm.name}: flows by replica: {placement(replicas)}")
    for warning in usage.warnings:
        _log(f"{arm.name}: {warning}")
    return records, ArmResult(
        kind=arm.kind,
        balanced=arm.balanced,
        groups=[g.name for g in scenario.groups_of(arm)],
        pids=pids,
        capped=capped,
        wall_s=time.monotonic() - started,
        cpu=usage,
        summary=summary,
        replica_flows=replicas,
        prefix_matches=matches,
        prefix_predicted_tokens=predicted,
    )


def scenario_json(
    scenario: Scenario,
    external: tuple[BackendSpec, ...] = (),
    policy_file: Path | None = None,
    caches_kept: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """The scenario as run (overrides applied), for ``results.json`` and the report:
    ``policy`` is the file named, ``policy_scale`` what its durations were divided by
    (null: used as written), ``policy_file`` the file the gateway read, and with
    ``--backend`` the engines whose prefix cache an arm started on (``caches_kept``)."""
    return {
        "name": scenario.name,
        "description": scenario.description,
        "path": str(scenario.path),
        "seed": scenario.seed,
        "duration_s": scenario.duration_s,
        "warmup_s": scenario.warmup_s,
        "drain_s": scenario.drain_s,
        "speedup": scenario.speedup,
        "max_requests": scenario.max_requests,
        "model": scenario.model,
        "backends": {
            "count": scenario.backends.count,
            "profile": scenario.backends.profile,
            "flags": list(scenario.backends.flags),
            "overrides": {str(i): list(f) for i, f in scenario.backends.overrides},
            "models": [list(names) for names in scenario.backends.models],
            "external": [b.url for b in external],
            "prefix_caches_kept": caches_kept or {},
        },
        "groups": {
            g.name: {"tier": g.tier, "tenant": g.tenant, "model": scenario.model_of(g)}
            for g in scenario.groups
        },
        "policy": os.path.relpath(scenario.policy),
        "policy_scale": scenario.policy_scale,
        "policy_file": _shown(policy_file or scenario.policy),
        "replicas": scenario.replicas,
        "shared_state": scenario.shared_state or scenario.replicas > 1,
        "time_unit": "simulated seconds (wall seconds x speedup)",
    }


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it (a file of the
    checkout), else absolute (a run's output under /tmp)."""
    relative = os.path.relpath(path)
    return str(path.resolve()) if relative.startswith("..") else relative


def bench(
    scenario: Scenario,
    out: Path,
    external: tuple[BackendSpec, ...] = (),
    placed: Placement | None = None,
) -> BenchResults:
    """Run every arm and write the report; the results (also written to ``out``).
    ``external``: existing backends (``--backend``) instead of simulated ones; ``placed``:
    the engines the bench started (``--engine``, their backends are ``external``) and how
    the run was pinned."""
    records: dict[str, list[RequestRecord]] = {}
    arms: dict[str, ArmResult] = {}
    failed: dict[str, str] = {}
    # ``policy: default``: the rescaled copy, written once next to the report.
    policy_file = scenario.policy_file(out)
    caches_kept: dict[str, list[str]] = {}
    for arm in scenario.arms:
        if external:
            kept = reset_prefix_caches(external)
            if kept:
                caches_kept[arm.name] = kept
                _log(
                    f"{arm.name}: prefix cache not emptied on {', '.join(kept)}: the arm "
                    f"starts on the cache the arms before it warmed ({RESET_NEEDS})"
                )
        try:
            records[arm.name], arms[arm.name] = run_arm(
                scenario, arm.name, out / "logs" / arm.name, external, policy_file, placed
            )
        except (NotReady, EnvoyConfigError, OSError, RuntimeError) as exc:
            # The arm's processes are already stopped (ProcessGroup); the other arms still
            # tell something, so carry on and report the failure instead of losing them all.
            failed[arm.name] = f"{type(exc).__name__}: {exc}"
            _log(f"{arm.name}: FAILED: {failed[arm.name]}")
    weights = {t.name: t.weight for t in load_policy(scenario.policy).tenants}
    summaries = {name: arm.summary for name, arm in arms.items()}
    targets = evaluate(scenario.targets, summaries, weights)
    described = scenario_json(scenario, external, policy_file, caches_kept)
    if placed is not None and placed.pinning is not None:
        described["pinning"] = placed.pinning.to_json()
    results = BenchResults(
        scenario=described,
        arms=arms,
        failed_arms=failed,
        targets=[mark_suspect(t, arms) for t in targets],
    )
    report.write(out, results, records)
    return results


def _print_arm(name: str, arm: ArmResult, groups: list[str]) -> None:
    """One arm's figures per tier (and per group for ``groups``: those that share a tier
    with another), the fleet's, and its CPU."""
    fmt = report.fmt
    print(f"{name}:")
    rows = [*arm.summary.by_tier.items()]
    rows += [(g, arm.summary.by_group[g]) for g in groups if g in arm.summary.by_group]
    for label, s in rows:
        errors = f", errors {report.errors_text(s.errors)}" if s.errors else ""
        print(
            f"  {label:>12}: TTFT p50/p90/p99 {fmt(s.ttft_p50)}/{fmt(s.ttft_p90)}/"
            f"{fmt(s.ttft_p99)} s, e2e p95 {fmt(s.e2e_p95)} s, goodput {fmt(s.goodput)} "
            f"tok/s, wait max {fmt(s.wait_max)} s, ok {s.ok}{errors}, unfinished "
            f"{s.unfinished}"
        )
    total = arm.summary.total
    cache = arm.summary.prefix_cache
    rate = None if cache is None else cache.hit_rate
    print(
        f"  {'fleet':>12}: {fmt(total.throughput)} req/s, {fmt(total.goodput)} output tok/s, "
        f"TTFT p50/p90/p99 {fmt(total.ttft_p50)}/{fmt(total.ttft_p90)}/"
        f"{fmt(total.ttft_p99)} s, e2e p99 {fmt(total.e2e_p99)} s, "
        f"prefix-cache hit rate {'-' if rate is None else f'{rate:.1%}'}"
    )
    cores = ", ".join(f"{p} {c:.2f}" for p, c in arm.cpu.cores.items())
    print(f"  CPU cores: {cores}; machine {arm.cpu.machine_cores:.2f}")
    for warning in arm.cpu.warnings:
        print(f"  {warning}")


def print_summary(results: BenchResults, out: Path) -> None:
    pinning = report.pinning_text(results.scenario)
    if pinning:
        print(pinning)
    external = results.scenario["backends"].get("external")
    if external:
        given = "--engine" if report.engines_started(results.scenario) else "--backend"
        print(
            f"engines: {', '.join(external)} ({given}): their scheduling policy is their "
            "own, the same for every arm (FIFO vs priority is not switched per arm)"
        )
    groups = report.groups_sharing_a_tier(results.scenario)
    for name, arm in results.arms.items():
        _print_arm(name, arm, groups)
    for name, error in results.failed_arms.items():
        print(f"{name}: FAILED: {error.splitlines()[0]} (logs under {out / 'logs' / name})")
    print("targets:")
    for r in results.targets:
        t = r.target
        sign = "<=" if t.op == "max" else ">="
        note = f" ({r.note})" if r.note else ""
        print(f"  {r.verdict} {t.name}: {report.fmt(r.measured)} {sign} {t.bound:g}{note}")
    print(f"report: {out / 'report.md'}\nresults: {out / 'results.json'}")


def run(args: argparse.Namespace) -> int:
    try:
        document = read_document(args.scenario)
        arms = args.arms.split(",") if args.arms else None
        if document.kind == "overhead":
            return _run_overhead(args, document, arms)
        if document.kind == "des":
            return _run_des(args, document)
        scenario = load_scenario(args.scenario).with_overrides(
            duration_s=args.duration,
            speedup=args.speedup,
            arms=arms,
            model=args.model,
            replicas=args.replicas,
            shared_state=args.shared_state,
            tokenizer=args.tokenizer,
            kv_hash_flags=kv_hash_arguments(args),
        )
        scenario = check_arguments(args, scenario)
        external = external_backends(args.backend)
        check_precise(scenario, external)
    except (ScenarioError, BackendError, PinningError) as exc:
        print(f"fairlane bench: {exc}", file=sys.stderr)
        return 1
    note = policy_note(scenario, load_scenario(args.scenario).speedup)
    if note:
        _log(note)
    # Outside the checkout by default: results are not source, and others share the tree.
    out = args.out or (
        Path(tempfile.gettempdir())
        / "fairlane-bench"
        / f"{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        with run_placement(args, scenario, external, out / "logs" / "engines") as placed:
            for line in placed.describe():
                _log(line)
            results = bench(scenario, out, placed.backends, placed)
    except KeyboardInterrupt:
        _log("interrupted; every process was stopped")
        return 1
    except (EngineError, NotReady) as exc:
        _log(f"the engines did not start: {exc}")
        return 1
    except (OSError, ValueError) as exc:
        _log(f"failed: {exc}")
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_summary(results, out)
    return 1 if results.failed_arms else 0


def policy_note(scenario: Scenario, written_for: float) -> str | None:
    """What to say about the policy's time scale before a run (None: nothing to say).

    A hand-written policy is in wall-clock seconds for the speedup its scenario was written
    for: run at another ``--speedup`` its deadlines, aging and scrape intervals mean other
    simulated times, so that is a warning. ``policy: default`` is rescaled to whatever
    speedup the run uses, so there is nothing to warn about, only which scale was used."""
    policy = os.path.relpath(scenario.policy)
    if scenario.policy_scale is not None:
        return (
            f"policy: {policy} with its durations divided by {scenario.policy_scale:g} "
            "(the run's speedup)"
        )
    if scenario.speedup != written_for:
        return (
            f"warning: the policy {policy} is in wall-clock seconds "
            f"for speedup {written_for:g}; at {scenario.speedup:g} its deadlines, aging and "
            "scrape intervals mean different simulated times (see docs/development/scenarios.md)"
        )
    return None


def _run_des(args: argparse.Namespace, document: Document) -> int:
    """A ``kind: des`` scenario: fairlane's core and the engines on a virtual clock, in this
    process (:mod:`loadtests.des`); no arm, no process started."""
    from loadtests.des.model import parse_des
    from loadtests.des.run import bench as run_des

    scenario = parse_des(document)
    if args.duration is not None:
        scenario = dataclasses.replace(scenario, duration_s=args.duration)
    out = args.out or Path(tempfile.gettempdir()) / "fairlane-bench" / (
        f"{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    _log(f"{scenario.name}: discrete-event simulation, {scenario.fleet.engines} engines")
    results = run_des(scenario, out)
    run = results["run"]
    print(f"{scenario.name}: {run['sent']:,} requests, {run['wall_s']:.1f} s wall")
    for tier, t in run["ttft_s"].items():
        print(f"  {tier}: TTFT p50 {t['p50']:.3f} s, p90 {t['p90']:.3f} s, p99 {t['p99']:.3f} s")
    print(
        f"  jain_backlogged {results['jain_backlogged']}, max_batch_wait_s "
        f"{results['max_batch_wait_s']:.1f}"
    )
    for key, us in results["decision_us_per_request"].items():
        print(f"  decision cost {key}: {us:.0f} µs per request")
    print(f"report: {out / 'report.md'}\nresults: {out / 'results.json'}")
    return 0


def _run_overhead(args: argparse.Namespace, document: Document, arms: list[str] | None) -> int:
    """A ``kind: overhead`` scenario: wall-clock time against an instant backend, so the
    fleet options mean nothing there and are refused rather than ignored."""
    from loadtests.bench.overhead import runner
    from loadtests.bench.overhead.scenario import parse_overhead

    scenario = parse_overhead(document).with_overrides(duration_s=args.duration, arms=arms)
    for option, value in (
        ("--speedup", args.speedup),
        ("--backend", args.backend),
        ("--model", args.model),
    ):
        if value:
            print(
                f"fairlane bench: {option}: {scenario.name} runs in wall-clock time against "
                "its own instant backend; the option is for A/B scenarios",
                file=sys.stderr,
            )
            return 1
    return runner.run(args, scenario)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fairlane bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
