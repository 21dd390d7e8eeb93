"""``fairlane up``: Envoy, the ext_proc service and (by default) two simulated vLLM backends.

The same ``Stack`` is what the integration tests and benchmarks start, so what a user runs
is what is tested. Every process lives in a ``ProcessGroup``: Ctrl-C, SIGTERM, a failed
start or a child that dies stops all of them.

The children's output goes to log files, so what the user must see is printed by ``up``
itself: where everything is, and each backend's seats (how many requests its engine runs at
once, which admission plans with). Those are learned by the service after start and change
when an engine restarts with other flags, so ``up`` reads them from the service's own
``fairlane_backend_seats`` gauge every few seconds and prints a line when one changes
(``SeatWatch``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from extproc.envoy.binary import envoy_argv, write_bootstrap
from extproc.envoy.params import MAX_MESSAGE_TIMEOUT_S, EnvoyParams
from extproc.fleet.backend import BackendSpec
from extproc.ops.processes import (
    Child,
    ProcessGroup,
    ensure_port_free,
    free_port,
    wait_http_ready,
    wait_port_open,
)
from extproc.policy import DEFAULT_POLICY_PATH, load_policy
from extproc.transport.server import (
    add_backend_argument,
    add_policy_argument,
    backend_argument,
    backends_from_args,
)

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
    completion_flush_s: float = EnvoyParams.completion_flush_s
    """How far apart Envoy may batch completions; the bench shortens it by its speedup."""


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
                *[arg for b in self.backends for arg in ("--backend", backend_argument(b))],
            ],
        )
        wait_port_open(self.service_port, service)
        self.admin_port = config.admin_port or free_port()
        longest_hold = max(t.queue_deadline_s for t in policy.tiers)
        params = EnvoyParams(
            listen_port=config.port,
            admin_port=self.admin_port,
            extproc_port=self.service_port,
            backends=self.backends,
            max_body_bytes=policy.max_body_bytes,
            longest_hold_s=min(MAX_MESSAGE_TIMEOUT_S, longest_hold + 10),
            max_held_requests=sum(t.queue_limit for t in policy.tiers),
            completion_flush_s=config.completion_flush_s,
        )
        bootstrap = write_bootstrap(params, self.group.log_dir / "envoy.yaml", check=False)
        envoy = self.group.start("envoy", envoy_argv(bootstrap, log_level=config.envoy_log_level))
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


SEATS_POLL_S = 2.0
"""How often ``fairlane up`` reads the service's seat gauges (a scrape costs it ~1 ms)."""
FALLBACK_REPORT_S = 30.0
"""A fallback estimate grows with every request more an engine is seen running: a change of
it alone is printed at most this often per backend, so a load test does not flood the
terminal. A learned or declared count, or a change of source, is printed at once."""
SOURCE_TEXT = {
    "declared": "declared",
    "learned": "learned from the engine",
    "fallback": "fallback: not learned yet",
}

_SEATS_SAMPLE = re.compile(r"^fairlane_backend_seats\{([^}]*)\}[ \t]+(\S+)", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class SeatCount:
    """One backend's seats as the service reports them (``fairlane_backend_seats``)."""

    region: str
    count: int
    source: str

    def line(self, address: str) -> str:
        return f"backend {self.region} {address}: seats {self.count} ({self.describe()})"

    def describe(self) -> str:
        return SOURCE_TEXT.get(self.source, self.source)


def parse_seats(text: str) -> dict[str, SeatCount]:
    """Backend address -> its seats, from the service's ``/metrics`` text."""
    found: dict[str, SeatCount] = {}
    for match in _SEATS_SAMPLE.finditer(text):
        labels = {key: _unescape(value) for key, value in _LABEL.findall(match[1])}
        try:
            count = round(float(match[2]))
        except ValueError:
            continue
        if "backend" in labels:
            found[labels["backend"]] = SeatCount(
                labels.get("region", ""), count, labels.get("source", "")
            )
    return found


def _unescape(value: str) -> str:
    """A label value as written before the exposition escaped ``\\``, ``"`` and newlines."""
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], value)


class SeatWatch:
    """What ``fairlane up`` has told the user about each backend's seats, and what changed.

    ``poll`` reads the service's ``/metrics`` at most every ``SEATS_POLL_S``; ``changes``
    (pure, tested without sockets) decides which differences are worth a line. A failed
    read is skipped quietly: the service may be busy, and a dead one is reported anyway.
    """

    def __init__(self, metrics_url: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics_url = metrics_url
        self.clock = clock
        self.shown: dict[str, SeatCount] = {}
        self.shown_at: dict[str, float] = {}
        self._polled_at = -float("inf")

    def read(self, timeout: float = 1.0) -> dict[str, SeatCount] | None:
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=timeout) as response:
                return parse_seats(response.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def first(self, timeout: float = 5.0) -> dict[str, SeatCount]:
        """The seats at start (the metrics endpoint may open just after the gRPC port);
        empty if the service does not answer in ``timeout``."""
        deadline = self.clock() + timeout
        while True:
            seen = self.read()
            if seen is not None or self.clock() >= deadline:
                break
            time.sleep(0.1)
        now = self.clock()
        self.shown = dict(seen or {})
        self.shown_at = dict.fromkeys(self.shown, now)
        self._polled_at = now
        return self.shown

    def poll(self) -> list[str]:
        """Lines to print now (none between polls or when the service does not answer)."""
        now = self.clock()
        if now - self._polled_at < SEATS_POLL_S:
            return []
        self._polled_at = now
        seen = self.read()
        return [] if seen is None else self.changes(seen, now)

    def changes(self, seen: Mapping[str, SeatCount], now: float) -> list[str]:
        """One line per backend whose seats changed since they were last shown."""
        lines = []
        for address, seat in seen.items():
            shown = self.shown.get(address)
            if shown is not None and (shown.count, shown.source) == (seat.count, seat.source):
                continue
            growing_estimate = shown is not None and shown.source == seat.source == "fallback"
            if growing_estimate and now - self.shown_at.get(address, now) < FALLBACK_REPORT_S:
                continue  # shown later, with the estimate it has grown to by then
            self.shown[address] = seat
            self.shown_at[address] = now
            lines.append(seat.line(address))
        return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8080, help="client port (default %(default)s)")
    add_policy_argument(parser)
    add_backend_argument(
        parser,
        required=False,
        help="a real vLLM server, e.g. region-a=http://10.0.0.5:8000 (repeatable); without "
        "any, two simulated ones are started",
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
            seats = SeatWatch(f"http://127.0.0.1:{stack.metrics_port}/metrics")
            _print_banner(stack, seats.first())
            while all(child.alive() for child in group.children):
                time.sleep(0.5)
                for line in seats.poll():
                    print(f"fairlane: {line}", flush=True)
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


def _backend_line(spec: BackendSpec, seats: Mapping[str, SeatCount]) -> str:
    """A backend as the banner shows it, with its seats as the service reports them (or as
    declared, if the service has not answered yet)."""
    seat = seats.get(spec.address)
    if seat is not None:
        return seat.line(spec.address)
    if spec.seats is not None:
        return SeatCount(spec.region, spec.seats, "declared").line(spec.address)
    return f"backend {spec.region} {spec.address}: seats learned from the engine"


def _print_banner(stack: Stack, seats: Mapping[str, SeatCount]) -> None:
    lines: Sequence[str] = [
        f"fairlane is up: OpenAI API on {stack.url}",
        *[f"  {_backend_line(b, seats)}" for b in stack.backends],
        "    (seats: requests each engine runs at once; changes are printed as they are learned)",
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
