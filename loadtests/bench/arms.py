"""Starting and stopping one arm's processes: an Envoy-only baseline, a peer gateway or fairlane.

Every arm gets the same simulated fleet (count, profile, the models each backend serves,
flags, per-backend overrides unless the arm is ``balanced``, speedup); what differs is what
sits in front of it and the engines' scheduling policy, as it would in production: a plain
Envoy with vLLM's default ``fcfs`` (``fifo``, ``least-request``, ``random``), the engine's
own priority queue with no gateway (``vllm-priority``), another gateway (the peers), or
fairlane with the engines on ``priority``. ``start_arm`` describes each. With ``--backend``
the arms target existing engines instead: nothing is simulated, and the engines' scheduling
policy is theirs for every arm. Every process is started in the caller's ``ProcessGroup``,
which stops them all, also on failure.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.envoy.binary import envoy_argv
from extproc.envoy.params import EnvoyParams
from extproc.fleet.backend import BackendSpec, KVEventPorts
from extproc.ops.processes import ProcessGroup, free_port, wait_http_ready
from extproc.ops.up import Stack, StackConfig
from extproc.state.replica import PERIOD_S
from extproc.transport.server import BUILTIN_TOKENIZER
from loadtests.bench.fifo_bootstrap import FIFO_CLUSTER, render_fifo_bootstrap
from loadtests.bench.peers.kinds import PEER_ARMS
from loadtests.bench.peers.start import start_peer
from loadtests.bench.scenario import ENVOY_ONLY_KINDS, Arm, Scenario

REGION = "local"  # one region: the whole fleet is equally near, as in the FIFO baseline
SCHEDULING = {
    "fifo": "fcfs",
    "vllm-priority": "priority",
    "least-request": "fcfs",
    "random": "fcfs",
    "fairlane": "priority",
    **{kind: peer.scheduling for kind, peer in PEER_ARMS.items()},
}
_LB = "type.googleapis.com/envoy.extensions.load_balancing_policies."
# Envoy's load-balancing extension per Envoy-only arm kind (typed_extension_config).
# (fifo keeps render_fifo_bootstrap's round-robin as it is.)
LB_POLICIES: dict[str, dict[str, Any]] = {
    "least-request": {
        "name": "envoy.load_balancing_policies.least_request",
        "typed_config": {"@type": _LB + "least_request.v3.LeastRequest"},
    },
    "random": {
        "name": "envoy.load_balancing_policies.random",
        "typed_config": {"@type": _LB + "random.v3.Random"},
    },
}


@dataclass
class RunningArm:
    """Where to send the load, and which processes to account CPU for."""

    name: str
    url: str
    pids: dict[str, int] = field(default_factory=dict)
    backend_urls: tuple[str, ...] = ()
    """The simulators' base URLs (their /metrics give the prefix-cache counters)."""
    service_metrics: dict[str, str] = field(default_factory=dict)
    """Each service process (replica id, or its name) -> its ``/metrics`` URL (what the
    gateway counted: ``loadtests.bench.gateway_metrics``); empty for Envoy-only arms."""
    replicated: bool = False
    """The service runs as replicas sharing state (which replica decided what matters)."""


def sim_argv(
    scenario: Scenario, port: int, scheduling: str, index: int = 0, balanced: bool = False
) -> list[str]:
    """``fairlane sim`` for backend ``index``: the model(s) it serves (``backends.models``,
    in every arm), then its override (e.g. ``--profile``) last, so it wins over the
    scenario-wide value."""
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
        *scenario.backends.model_argv(index, scenario.model),
        *scenario.backends.flags_of(index, balanced),
    ]


def start_simulators(
    scenario: Scenario,
    group: ProcessGroup,
    scheduling: str,
    balanced: bool = False,
    kv_events: bool = False,
) -> tuple[BackendSpec, ...]:
    """The scenario's simulators; with ``kv_events`` each publishes its KV events and its
    spec names the ports (``#kv-events=PORT,kv-replay=PORT``)."""
    started = []
    for i in range(scenario.backends.count):
        port = free_port()
        argv = sim_argv(scenario, port, scheduling, i, balanced)
        events = None
        if kv_events:
            events = KVEventPorts(free_port(), free_port())
            argv += ["--kv-events-config", events.engine_config()]
        child = group.start(f"sim-{i}", argv)
        started.append((BackendSpec("127.0.0.1", port, REGION, kv_events=events), child))
    for spec, child in started:
        wait_http_ready(f"{spec.url}/health", child, timeout=30)
    return tuple(spec for spec, _ in started)


def completion_flush_s(speedup: float) -> float:
    """How far apart Envoy may batch completions in an arm at ``speedup``: completions 10 ms
    apart would be 10 x speedup simulated ms late (Envoy takes whole milliseconds)."""
    return max(0.001, EnvoyParams.completion_flush_s / max(1.0, speedup))


def state_period_ms(speedup: float) -> float:
    """How often replicas exchange in an arm at ``speedup``: 20 ms of wall time would be
    20 x speedup simulated ms of staleness; at least 2 ms (each exchange costs ~0.3 ms of a
    replica's CPU, so faster would measure the machine)."""
    return max(2.0, PERIOD_S * 1000 / max(1.0, speedup))


def precise_flags(scenario: Scenario) -> tuple[str, ...]:
    """The service flags of a precise arm: the engines' tokenizer (the simulators' own unless
    ``--tokenizer`` names one) and their hash settings."""
    return ("--tokenizer", scenario.tokenizer or BUILTIN_TOKENIZER, *scenario.kv_hash_flags)


def start_arm(
    scenario: Scenario,
    arm: Arm,
    group: ProcessGroup,
    external: tuple[BackendSpec, ...] = (),
    policy: Path | None = None,
) -> RunningArm:
    """Start ``arm``'s processes in ``group`` and wait until they serve. With ``external``
    backends (``--backend``) no simulator is started: the arm's Envoy (and service) point at
    them, and their scheduling policy is whatever they run. ``policy``: the file the
    gateway reads; by default the scenario's (for ``policy: default`` its copy rescaled to
    the speedup, written into the arm's log directory).

    The arms:

    * ``fifo``, ``least-request``, ``random``: a plain Envoy straight to the engines, with
      round-robin, least-request (Envoy's default: power of two choices over active requests) or
      random load balancing, and vLLM's default ``fcfs``. These arms send no priority, so under
      ``priority`` every request would have the same one and the engine would order by arrival
      anyway; ``fcfs`` keeps them what a stock deployment runs. Envoy does not read the body: on
      a fleet of several models (``backends.models``) these arms, and ``vllm-priority``, send a
      request to any engine, and one that does not serve its model answers 404, as behind a
      stock Envoy in front of such a fleet.
    * ``vllm-priority``: what the engine alone does with priorities, no gateway: Envoy
      round-robin as in ``fifo``, engines on ``priority``, and each request carries its tier's
      priority from the scenario's policy in its body (the client sets it, as a client of a bare
      vLLM fleet would). The reference for what fairlane adds beyond vLLM's own priority queue.
    * ``fairlane``: the gateway, engines on ``priority`` so the priority it injects means
      something.
    * the peers (``vllm-router``, ``vllm-router-cache``, ``vllm-router-kv``, ``litellm``,
      ``litellm-priority``): another gateway in front of the same engines, engines on
      ``priority`` where its clients send priorities (``loadtests.bench.peers``).
    """
    precise = arm.prefix_index == "precise"
    peer = PEER_ARMS.get(arm.kind)
    kv_events = precise or (peer is not None and peer.kv_events)
    backends = external or start_simulators(
        scenario, group, SCHEDULING[arm.kind], arm.balanced, kv_events=kv_events
    )
    service_metrics: dict[str, str] = {}
    replicated = False
    if arm.kind in ENVOY_ONLY_KINDS:
        url = _start_envoy_only(backends, group, arm.kind)
    elif peer is not None:
        url = start_peer(arm.kind, backends, group, scenario.model).url
    else:
        policy_path = policy or scenario.policy_file(group.log_dir)
        config = StackConfig(
            port=free_port(),
            policy_path=policy_path,
            backends=backends,
            completion_flush_s=completion_flush_s(scenario.speedup),
            replicas=scenario.replicas,
            shared_state=scenario.shared_state or None,
            service_args=(
                "--state-period-ms",
                f"{state_period_ms(scenario.speedup):g}",
                *(precise_flags(scenario) if precise else ()),
            ),
        )
        stack = Stack(config, group).start()
        url = stack.url
        if stack.services is not None:
            replicated = stack.services.replicated
            service_metrics = {
                p.replica_id or p.child.name: p.metrics_url for p in stack.services.processes
            }
    pids = {child.name: child.popen.pid for child in group.children}
    backend_urls = tuple(b.url for b in backends)
    return RunningArm(arm.name, url, pids, backend_urls, service_metrics, replicated)


def envoy_only_bootstrap(params: EnvoyParams, kind: str) -> dict[str, Any]:
    """The FIFO baseline's bootstrap (:func:`render_fifo_bootstrap`) with the
    backend cluster's load balancing replaced by ``kind``'s: the same listener, timeouts
    and cluster limits, so the arms differ in the picking only."""
    bootstrap = render_fifo_bootstrap(params)
    if kind in ("fifo", "vllm-priority"):
        return bootstrap
    clusters = bootstrap["static_resources"]["clusters"]
    cluster = next(c for c in clusters if c["name"] == FIFO_CLUSTER)
    cluster.pop("lb_policy", None)  # load_balancing_policy wins only if lb_policy is unset
    cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": LB_POLICIES[kind]}]}
    return bootstrap


def _start_envoy_only(backends: tuple[BackendSpec, ...], group: ProcessGroup, kind: str) -> str:
    port, admin_port = free_port(), free_port()
    params = EnvoyParams(listen_port=port, admin_port=admin_port, backends=backends)
    path = group.log_dir / f"envoy-{kind}.yaml"
    path.write_text(yaml.safe_dump(envoy_only_bootstrap(params, kind), sort_keys=False))
    envoy = group.start("envoy", envoy_argv(path))
    wait_http_ready(f"http://127.0.0.1:{admin_port}/ready", envoy, timeout=30)
    return f"http://127.0.0.1:{port}"
