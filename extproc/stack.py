"""``fairlane up``: Envoy, the ext_proc service and (by default) two simulated vLLM backends.

The same ``Stack`` is what the integration tests and benchmarks start, so what a user runs
is what is tested. Every process lives in a ``ProcessGroup``: Ctrl-C, SIGTERM, a failed
start or a child that dies stops all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from extproc import envoy_config
from extproc.backends import BackendSpec
from extproc.policy import DEFAULT_POLICY_PATH, load_policy
from extproc.processes import (
    Child,
    ProcessGroup,
    ensure_port_free,
    free_port,
    wait_http_ready,
    wait_port_open,
)
from extproc.server import add_backend_argument, add_policy_argument, backends_from_args

DEFAULT_SIM_REGIONS = ("region-a", "region-b")


@dataclass
class StackConfig:
    port: int = 8080
    policy_path: Path = DEFAULT_POLICY_PATH
    backends: tuple[BackendSpec, ...] = ()
    """Real backends; empty starts simulated ones."""
    sim_regions: tuple[str, ...] = DEFAULT_SIM_REGIONS
    sim_args: tuple[str, ...] = ("--scheduling-policy", "priority")
    """Extra ``fairlane sim`` flags for every simulated backend."""
    sim_extra_args: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    """More flags for single simulators, by index into ``sim_regions`` (fault injection:
    ``{0: ("--fault-delay-headers-s", "3")}``)."""
    sim_log_requests: bool = False
    """Have each simulator log the requests it receives (tests read them)."""
    admin_port: int = 0
    service_port: int = 0
    metrics_port: int = 0
    envoy_log_level: str = "warn"


@dataclass
class Stack:
    """A running gateway: where to reach it and its parts."""

    config: StackConfig
    group: ProcessGroup
    backends: tuple[BackendSpec, ...] = ()
    service_port: int = 0
    metrics_port: int = 0
    admin_port: int = 0
    request_logs: dict[str, Path] = field(default_factory=dict)
    """Backend address -> the simulator's request log (when ``sim_log_requests``)."""
    simulators: dict[str, Child] = field(default_factory=dict)
    """Backend address -> its running simulator process (none for real backends)."""
    _sim_argv: dict[str, list[str]] = field(default_factory=dict, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self) -> Stack:
        config = self.config
        policy = load_policy(config.policy_path)  # fail before starting anything
        self._check_fixed_ports()
        self.backends = config.backends or self._start_simulators()
        self.service_port = config.service_port or free_port()
        self.metrics_port = config.metrics_port or free_port()
        service = self.group.start(
            "service",
            [
                sys.executable,
                "-m",
                "extproc",
                "serve",
                "--port",
                str(self.service_port),
                "--metrics-port",
                str(self.metrics_port),
                "--policy",
                str(config.policy_path),
                *[arg for b in self.backends for arg in ("--backend", f"{b.region}={b.url}")],
            ],
        )
        wait_port_open(self.service_port, service)
        self.admin_port = config.admin_port or free_port()
        longest_hold = max(t.queue_deadline_s for t in policy.tiers)
        params = envoy_config.EnvoyParams(
            listen_port=config.port,
            admin_port=self.admin_port,
            extproc_port=self.service_port,
            backends=self.backends,
            max_body_bytes=policy.max_body_bytes,
            longest_hold_s=min(envoy_config.MAX_MESSAGE_TIMEOUT_S, longest_hold + 10),
            max_held_requests=sum(t.queue_limit for t in policy.tiers),
        )
        bootstrap = envoy_config.write_bootstrap(
            params, self.group.log_dir / "envoy.yaml", check=False
        )
        envoy = self.group.start(
            "envoy", envoy_config.envoy_argv(bootstrap, log_level=config.envoy_log_level)
        )
        wait_http_ready(f"{self.admin_url}/ready", envoy, timeout=30)
        return self

    def _check_fixed_ports(self) -> None:
        """The ports a user fixed must be free now: a clear "port N (Envoy's listener,
        --port) is already in use" beats Envoy dying with a bind error in its log."""
        fixed = (
            (self.config.port, "Envoy's client listener, --port"),
            (self.config.admin_port, "Envoy's admin interface, --admin-port"),
            (self.config.service_port, "the ext_proc service"),
            (self.config.metrics_port, "the service's metrics"),
        )
        for port, what in fixed:
            if port:
                ensure_port_free(port, what)

    def _start_simulators(self) -> tuple[BackendSpec, ...]:
        specs = []
        for index, region in enumerate(self.config.sim_regions):
            port = free_port()
            argv = [
                sys.executable,
                "-m",
                "extproc",
                "sim",
                "--port",
                str(port),
                *self.config.sim_args,
                *self.config.sim_extra_args.get(index, ()),
            ]
            spec = BackendSpec("127.0.0.1", port, region)
            if self.config.sim_log_requests:
                log_path = self.group.log_dir / f"requests-{port}.jsonl"
                argv += ["--log-requests", str(log_path)]
                self.request_logs[spec.address] = log_path
            child = self.group.start(f"sim-{region}-{port}", argv)
            self.simulators[spec.address] = child
            self._sim_argv[spec.address] = argv
            specs.append((spec, child))
        for spec, child in specs:
            wait_http_ready(f"{spec.url}/health", child, timeout=30)
        return tuple(spec for spec, _ in specs)

    def kill_simulator(self, address: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop the simulator of ``address`` abruptly (a crashed backend) and reap it.

        SIGKILL (the default) closes its sockets at once: open connections are reset or
        cut mid-response and new ones are refused.
        """
        child = self.simulators[address]
        if child.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.popen.pid, sig)
        child.popen.wait(10)

    def restart_simulator(self, address: str, timeout: float = 30) -> Child:
        """Start the (stopped) simulator of ``address`` again, same port and flags; wait
        until its ``/health`` answers. Its request log goes on in the same file; the dead
        process's output log is kept as ``NAME.log.N``."""
        old = self.simulators[address]
        if old.alive():
            raise RuntimeError(f"simulator {address} is still running")
        generation = 1
        while old.log_path.with_name(f"{old.log_path.name}.{generation}").exists():
            generation += 1
        with contextlib.suppress(OSError):
            old.log_path.rename(old.log_path.with_name(f"{old.log_path.name}.{generation}"))
        if old in self.group.children:
            self.group.children.remove(old)
        child = self.group.start(old.name, self._sim_argv[address])
        self.simulators[address] = child
        wait_http_ready(f"http://{address}/health", child, timeout=timeout)
        return child


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8080, help="client port (default %(default)s)")
    add_policy_argument(parser)
    add_backend_argument(
        parser,
        required=False,
        help="a real vLLM server (repeatable); without any, two simulated ones are started",
    )
    parser.add_argument("--admin-port", type=int, default=0, help="Envoy admin (default: free)")
    parser.add_argument("--log-dir", type=Path, default=None, help="where process logs go")


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    config = StackConfig(
        port=args.port,
        policy_path=args.policy,
        backends=backends_from_args(args.backend),
        admin_port=args.admin_port,
    )
    signal.signal(signal.SIGTERM, _raise_interrupt)
    with ProcessGroup(args.log_dir) as group:
        try:
            stack = Stack(config, group).start()
            _print_banner(stack)
            while all(child.alive() for child in group.children):
                time.sleep(0.5)
            dead = [c for c in group.children if not c.alive()]
            for child in dead:
                print(
                    f"fairlane: {child.name} exited ({child.popen.returncode}):\n"
                    f"{child.log_tail()}",
                    file=sys.stderr,
                )
            return 1
        except KeyboardInterrupt:
            print("\nfairlane: stopping", file=sys.stderr)
            return 0
        except Exception as exc:
            print(f"fairlane: {exc}", file=sys.stderr)
            return 1


def _print_banner(stack: Stack) -> None:
    lines: Sequence[str] = [
        f"fairlane is up: OpenAI API on {stack.url}",
        *[f"  backend {b.address} ({b.region})" for b in stack.backends],
        f"  ext_proc service 127.0.0.1:{stack.service_port}, Envoy admin {stack.admin_url}",
        f"  gateway metrics http://127.0.0.1:{stack.metrics_port}/metrics",
        f"  logs in {stack.group.log_dir}",
        "",
        "try:",
        f"  curl -s {stack.url}/v1/chat/completions -H 'Authorization: Bearer sk-chat-demo' \\",
        "    -H 'content-type: application/json' \\",
        '    -d \'{"model": "sim-llama-8b", "messages": [{"role": "user", "content": "Hi"}]}\'',
        "",
        "Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)
