"""Starting and stopping one arm's processes: the FIFO baseline or the fairlane gateway.

Both arms get the same simulated fleet (count, profile, flags, speedup); only the engines'
scheduling policy differs, as it would in production: FIFO runs vLLM's default ``fcfs``,
fairlane runs ``priority`` so the priority it injects means something. Every process is
started in the caller's :class:`ProcessGroup`, which stops them all, also on failure.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import yaml

from extproc import envoy_config
from extproc.backends import BackendSpec
from extproc.processes import ProcessGroup, free_port, wait_http_ready
from extproc.stack import Stack, StackConfig
from loadtests.bench.scenario import Arm, Scenario

REGION = "local"  # one region: the whole fleet is equally near, as in the FIFO baseline
SCHEDULING = {"fifo": "fcfs", "fairlane": "priority"}


@dataclass
class RunningArm:
    """Where to send the load, and which processes to account CPU for."""

    name: str
    url: str
    pids: dict[str, int] = field(default_factory=dict)


def sim_argv(scenario: Scenario, port: int, scheduling: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "extproc",
        "sim",
        "--port",
        str(port),
        "--speedup",
        f"{scenario.speedup:g}",
        "--profile",
        scenario.backends.profile,
        "--scheduling-policy",
        scheduling,
        "--model",
        scenario.model,
        *scenario.backends.flags,
    ]


def start_simulators(
    scenario: Scenario, group: ProcessGroup, scheduling: str
) -> tuple[BackendSpec, ...]:
    started = []
    for i in range(scenario.backends.count):
        port = free_port()
        child = group.start(f"sim-{i}", sim_argv(scenario, port, scheduling))
        started.append((BackendSpec("127.0.0.1", port, REGION), child))
    for spec, child in started:
        wait_http_ready(f"{spec.url}/health", child, timeout=30)
    return tuple(spec for spec, _ in started)


def start_arm(scenario: Scenario, arm: Arm, group: ProcessGroup) -> RunningArm:
    """Start ``arm``'s processes in ``group`` and wait until they serve."""
    backends = start_simulators(scenario, group, SCHEDULING[arm.kind])
    if arm.kind == "fifo":
        url = _start_fifo_envoy(backends, group)
    else:
        config = StackConfig(port=free_port(), policy_path=scenario.policy, backends=backends)
        url = Stack(config, group).start().url
    pids = {child.name: child.popen.pid for child in group.children}
    return RunningArm(arm.name, url, pids)


def _start_fifo_envoy(backends: tuple[BackendSpec, ...], group: ProcessGroup) -> str:
    port, admin_port = free_port(), free_port()
    params = envoy_config.EnvoyParams(listen_port=port, admin_port=admin_port, backends=backends)
    path = group.log_dir / "envoy-fifo.yaml"
    path.write_text(yaml.safe_dump(envoy_config.render_fifo_bootstrap(params), sort_keys=False))
    envoy = group.start("envoy", envoy_config.envoy_argv(path))
    wait_http_ready(f"http://127.0.0.1:{admin_port}/ready", envoy, timeout=30)
    return f"http://127.0.0.1:{port}"
