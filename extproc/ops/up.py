"""``fairlane up``: Envoy, the ext_proc service and (by default) two simulated vLLM backends.

With ``--replicas N`` the service is N active-active replicas sharing their state in a local
Redis (``extproc.ops.service_replicas``), and Envoy spreads requests over them and moves off a
dead one (``extproc.envoy.replicas``). A service process that exits is restarted on the same
ports, with back-off (``extproc.ops.supervisor``); until it is back Envoy answers new requests
503 ``gateway_unavailable`` with ``retry-after``. Redis dying is reported and the stack goes
on; Envoy or a simulator dying stops the stack. The same ``Stack`` is what the integration
tests and benchmarks start, so what a user runs is what is tested; every process lives in a
``ProcessGroup``, so Ctrl-C, SIGTERM, a failed start or a child that dies for good stops all.
The children's output goes to log files; ``up`` itself prints where everything is and each
backend's seats as the service learns them (``extproc.ops.seat_watch``).
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

from extproc.envoy.binary import envoy_argv, write_bootstrap
from extproc.envoy.params import MAX_MESSAGE_TIMEOUT_S, EnvoyParams
from extproc.fleet.backend import BackendSpec, KVEventPorts, backend_argument
from extproc.fleet.discovery import DnsBackendSpec
from extproc.fleet.models import ServedModels
from extproc.ops.first_request import curl_lines, served_model, served_models
from extproc.ops.processes import (
    Child,
    ProcessGroup,
    ensure_port_free,
    exit_text,
    free_port,
    port_open,
    wait_http_ready,
)
from extproc.ops.redis_server import require_redis_server
from extproc.ops.seat_watch import SeatCount, SeatWatch
from extproc.ops.service_replicas import ServiceProcess, Services, start_services
from extproc.ops.supervisor import Action, Role, Supervisor, action_for, restart_line
from extproc.policy import DEFAULT_POLICY_PATH, load_policy
from extproc.transport.server import (
    BUILTIN_TOKENIZER,
    add_backend_argument,
    add_dns_arguments,
    add_kv_event_arguments,
    add_policy_argument,
    add_region_key_argument,
    dns_arguments,
    dns_server_from_args,
    fleet_from_args,
    kv_event_arguments,
    region_keys_from_args,
)

DEFAULT_SIM_REGIONS = ("region-a", "region-b")
BIND_HOSTS = ("127.0.0.1", "0.0.0.0")
"""Where ``up`` may bind the internal ports: both keep them reachable on loopback, where Envoy
and ``up`` itself talk to them."""


@dataclass
class StackConfig:
    port: int = 8080
    policy_path: Path = DEFAULT_POLICY_PATH
    backends: tuple[BackendSpec, ...] = ()
    """Real backends; empty (and no ``dns_backends``) starts simulated ones."""
    dns_backends: tuple[DnsBackendSpec, ...] = ()
    """Backends found through DNS (``dns://NAME:PORT``): the service resolves them and
    serves Envoy the host set over EDS."""
    regions: tuple[str, ...] = ()
    """The regions in the order first named (default: the backends', then the names')."""
    sim_regions: tuple[str, ...] = DEFAULT_SIM_REGIONS
    sim_args: tuple[str, ...] = ("--scheduling-policy", "priority")
    """Extra ``fairlane sim`` flags for every simulated backend."""
    sim_extra_args: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    """More flags for single simulators, by index into ``sim_regions`` (fault injection:
    ``{0: ("--fault-delay-headers-s", "3")}``)."""
    sim_log_requests: bool = False
    """Have each simulator log the requests it receives (tests read them)."""
    kv_events: bool = True
    """Simulated backends publish their KV events and the service follows them (precise
    prefix routing with the simulator's tokenizer); off, prefix affinity is approximate."""
    admin_port: int = 0
    service_port: int = 0
    metrics_port: int = 0
    envoy_log_level: str = "warn"
    completion_flush_s: float = EnvoyParams.completion_flush_s
    """How far apart Envoy may batch completions; the bench shortens it by its speedup."""
    replicas: int = 1
    """Service processes; above 1, replicas sharing a local Redis (on free ports: a fixed
    ``service_port``/``metrics_port`` is for the one service only)."""
    shared_state: bool | None = None
    """Run the service(s) on a local Redis; default: with more than one replica. The bench
    sets it for one replica, to weigh shared state against in-process state."""
    service_args: tuple[str, ...] = ()
    """Extra ``fairlane serve`` flags for every service process (the bench's
    ``--state-period-ms``)."""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    """TLS on the client listener: PEM certificate chain and key (both or neither)."""
    bind_host: str = "127.0.0.1"
    """Where Envoy's admin, the service's gRPC port and its metrics listen: loopback unless
    something off this machine must reach them (Prometheus elsewhere)."""


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
    services: Services | None = None
    """The service process(es), and with replicas their Redis."""
    _sim_argv: dict[str, list[str]] = field(default_factory=dict, repr=False)

    @property
    def url(self) -> str:
        scheme = "https" if self.config.tls_cert is not None else "http"
        return f"{scheme}://127.0.0.1:{self.config.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self) -> Stack:
        config = self.config
        policy = load_policy(config.policy_path)  # fail before starting anything
        self._check_fixed_ports()
        if config.replicas > 1 or config.shared_state:
            require_redis_server()
        dynamic = bool(config.dns_backends)
        self.backends = config.backends or (() if dynamic else self._start_simulators())
        self.services = start_services(
            self.group,
            config.replicas,
            config.policy_path,
            () if dynamic else self.backends,
            config.service_port,
            config.metrics_port,
            config.shared_state,
            (*self._fleet_args(), *self._service_args()) if dynamic else self._service_args(),
        )
        first = self.services.processes[0]
        self.service_port, self.metrics_port = first.port, first.metrics_port
        self.admin_port = config.admin_port or free_port()
        longest_hold = max(t.queue_deadline_s for t in policy.tiers)
        params = EnvoyParams(
            listen_port=config.port,
            admin_port=self.admin_port,
            extproc_port=self.service_port,
            extproc_replicas=self._replica_addresses(),
            backends=self.backends,
            dns_backends=config.dns_backends,
            region_order=self._regions(),
            max_body_bytes=policy.max_body_bytes,
            longest_hold_s=min(MAX_MESSAGE_TIMEOUT_S, longest_hold + 10),
            max_held_requests=sum(t.queue_limit for t in policy.tiers),
            completion_flush_s=config.completion_flush_s,
            admin_host=config.bind_host,
            tls_cert_path=None if config.tls_cert is None else str(config.tls_cert.resolve()),
            tls_key_path=None if config.tls_key is None else str(config.tls_key.resolve()),
        )
        bootstrap = write_bootstrap(params, self.group.log_dir / "envoy.yaml", check=False)
        envoy = self.group.start("envoy", envoy_argv(bootstrap, log_level=config.envoy_log_level))
        wait_http_ready(f"{self.admin_url}/ready", envoy, timeout=30)
        return self

    def _regions(self) -> tuple[str, ...]:
        named = (*self.config.regions, *(b.region for b in self.backends))
        return tuple(dict.fromkeys((*named, *(d.region for d in self.config.dns_backends))))

    def _fleet_args(self) -> tuple[str, ...]:
        """Every backend, fixed and DNS, as ``--backend`` flags in region order, so the
        service names the same local region as Envoy's priority 0."""
        rank = {region: i for i, region in enumerate(self._regions())}
        specs: list[BackendSpec | DnsBackendSpec] = [*self.backends, *self.config.dns_backends]
        specs.sort(key=lambda spec: rank[spec.region])
        flags: list[str] = []
        for spec in specs:
            flags += ["--backend", backend_argument(spec)]
        return tuple(flags)

    @property
    def tokenizer(self) -> str | None:
        """The tokenizer the service hashes prompts with (``--tokenizer``), if any."""
        args = self._service_args()
        return args[args.index("--tokenizer") + 1] if "--tokenizer" in args[:-1] else None

    def _service_args(self) -> tuple[str, ...]:
        """``fairlane serve``'s extra flags; ``--host`` only off its loopback default; the
        simulator's tokenizer when simulated backends publish KV events (unless the flags
        name one: simulators started with a model's ``--tokenizer`` in ``sim_args``)."""
        config = self.config
        args = config.service_args
        if self.simulators and config.kv_events and "--tokenizer" not in args:
            args = (*args, "--tokenizer", BUILTIN_TOKENIZER)
        if config.bind_host == BIND_HOSTS[0]:
            return args
        return (*args, "--host", config.bind_host)

    def _replica_addresses(self) -> tuple[tuple[str, int], ...]:
        """Every replica's gRPC address for Envoy; empty for the one service (whose config
        stays what it always was)."""
        if self.services is None or not self.services.replicated:
            return ()
        return tuple(("127.0.0.1", p.port) for p in self.services.processes)

    @property
    def service_processes(self) -> tuple[ServiceProcess, ...]:
        return () if self.services is None else self.services.processes

    def kill_replica(self, replica_id: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop one replica abruptly (``r1`` .. ``rN``) and reap it: its held requests are
        lost, the others carry on."""
        if self.services is None:
            raise RuntimeError("the stack is not started")
        child = self.services.find(replica_id).child
        if child.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.popen.pid, sig)
        child.popen.wait(10)

    def role(self, child: Child) -> Role:
        """What ``child`` is to the stack: a service process (restarted when it exits), the
        replicas' Redis (the stack goes on without it) or Envoy or a simulator."""
        services = self.services
        if services is not None and services.holding(child) is not None:
            return Role.SERVICE
        if services is not None and services.redis is not None and child is services.redis:
            return Role.SHARED_STATE
        return Role.ESSENTIAL

    def restart_service(self, child: Child) -> ServiceProcess:
        """Start the service process ``child`` was, which has exited, again: same command,
        so the same gRPC and metrics ports; its output goes to a new log. Returns at once
        (the new process opens its ports in its own time)."""
        if self.services is None or self.services.holding(child) is None:
            raise ValueError(f"{child.label} is not one of the service processes")
        new = self.group.restart(child)
        self.services = self.services.replacing(child, new)
        process = self.services.holding(new)
        assert process is not None
        return process

    def _check_fixed_ports(self) -> None:
        """The ports a user fixed must be free now: a clear "port N (Envoy's listener,
        --port) is already in use" beats Envoy dying with a bind error in its log."""
        if self.config.replicas > 1 and (self.config.service_port or self.config.metrics_port):
            raise ValueError("replicas run on free ports: leave service_port/metrics_port unset")
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
            events = None
            if self.config.kv_events:
                events = KVEventPorts(free_port(), free_port())
                argv += ["--kv-events-config", events.engine_config()]
            spec = BackendSpec("127.0.0.1", port, region, kv_events=events)
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
        help="a real vLLM server, e.g. region-a=http://10.0.0.5:8000, or every address of a "
        "DNS name, e.g. region-a=dns://vllm:8000 (repeatable); without any, two simulated "
        "ones are started",
    )
    add_region_key_argument(parser)
    add_dns_arguments(parser)
    parser.add_argument("--admin-port", type=int, default=0, help="Envoy admin (default: free)")
    parser.add_argument(
        "--bind",
        default="127.0.0.1",
        choices=BIND_HOSTS,
        help="where Envoy's admin, the service's gRPC port and its metrics listen (default "
        "%(default)s: loopback only; 0.0.0.0: every interface, which exposes Envoy's admin, "
        "able to stop it)",
    )
    parser.add_argument(
        "--tls-cert", type=Path, default=None, help="serve clients over TLS: PEM certificate chain"
    )
    parser.add_argument(
        "--tls-key", type=Path, default=None, help="the private key (PEM) of --tls-cert"
    )
    parser.add_argument(
        "--replicas",
        type=_replica_count,
        default=1,
        help="run the ext_proc service as N active-active replicas sharing their state in a "
        "local Redis (redis-server on PATH; scripts/setup-tools installs it); default 1",
    )
    parser.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        help="simulated backends publish no KV events: prefix affinity is approximate (by "
        "default they publish them and the service follows them)",
    )
    add_kv_event_arguments(parser)
    parser.add_argument("--log-dir", type=Path, default=None, help="where process logs go")


def _replica_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return count


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    fleet = fleet_from_args(args.backend)
    dns_server_from_args(args)  # a malformed one stops here, not in the service
    config = StackConfig(
        port=args.port,
        policy_path=args.policy,
        backends=fleet.static,
        dns_backends=fleet.dns,
        regions=fleet.regions,
        admin_port=args.admin_port,
        replicas=args.replicas,
        service_args=(
            *(arg for key in args.region_key for arg in ("--region-key", key)),
            *dns_arguments(args),
            *kv_event_arguments(args),
        ),
        kv_events=args.kv_events,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        bind_host=args.bind,
    )
    region_keys_from_args(args.region_key)  # a malformed one stops here, not in the service
    signal.signal(signal.SIGTERM, _raise_interrupt)
    with ProcessGroup(args.log_dir) as group:
        try:
            stack = Stack(config, group).start()
            policy = load_policy(config.policy_path)
            seats = SeatWatch(f"http://127.0.0.1:{stack.metrics_port}/metrics")
            models = {spec.address: served_models(spec) for spec in stack.backends}
            _print_banner(
                stack,
                seats.first(),
                curl_lines(stack.url, policy, served_model(list(models.values()))),
                models,
            )
            watch = Watch(stack)
            while (fatal := watch.tick()) is None:
                time.sleep(watch.sleep_s())
                seats.metrics_url = _live_metrics_url(stack) or seats.metrics_url
                for line in seats.poll():
                    print(f"fairlane: {line}", flush=True)
            print(
                f"fairlane: {fatal.name} exited ({fatal.popen.returncode}):\n{fatal.log_tail()}",
                file=sys.stderr,
            )
            return 1
        except KeyboardInterrupt:
            print("\nfairlane: stopping", file=sys.stderr)
            return 0
        except Exception as exc:
            print(f"fairlane: {exc}", file=sys.stderr)
            return 1


WATCH_TICK_S = 0.25
"""How often ``up`` looks for a child that exited (at most; sooner when a restart is due)."""


class Watch:
    """``up``'s watch over its children, one :meth:`tick` at a time: a service process
    that exited is restarted when :class:`~extproc.ops.supervisor.Supervisor` says (one
    line each), Redis reported once, anything else ends the watch."""

    def __init__(self, stack: Stack, supervisor: Supervisor | None = None) -> None:
        self.stack = stack
        self.supervisor = supervisor or Supervisor()
        self.reported: list[Child] = []
        self.starting: dict[str, tuple[ServiceProcess, float]] = {}
        """Restarted service processes whose gRPC port is not open yet, and when each
        exited."""
        self._exited_at: dict[str, float] = {}
        for process in stack.service_processes:
            self.supervisor.started(process.child.name)

    def tick(self) -> Child | None:
        """The first child whose exit stops the stack, if one exited; else None, having
        restarted what was due and reported the rest."""
        for child in self.stack.group.children:
            if child.alive() or any(child is seen for seen in self.reported):
                continue
            if self.supervisor.waiting(child.name):
                continue
            action = action_for(self.stack.role(child))
            if action is Action.STOP:
                return child
            if action is Action.REPORT:
                self._report(child)
            else:
                self._schedule(child)
        for due in self.supervisor.due():
            self._restart(due.name)
        for name, (process, exited_at) in list(self.starting.items()):
            if not process.child.alive():
                del self.starting[name]  # found dead on the next tick, and restarted
            elif port_open(process.port, timeout=0.05):
                del self.starting[name]
                child, away_s = process.child, self.supervisor.clock() - exited_at
                _say(
                    f"fairlane: {child.label} is serving again (pid {child.popen.pid}, "
                    f"{away_s:.1f} s after it exited; log: {child.log_path})"
                )
        return None

    def sleep_s(self) -> float:
        """How long to sleep before the next tick."""
        due = self.supervisor.next_due_in()
        return WATCH_TICK_S if due is None else min(WATCH_TICK_S, due)

    def _schedule(self, child: Child) -> None:
        restart = self.supervisor.exited(child.name)
        self._exited_at[child.name] = self.supervisor.clock()
        services = self.stack.services
        others = (
            services is not None
            and services.replicated
            and any(p.child.alive() for p in services.processes if p.child is not child)
        )
        how = exit_text(child.popen.returncode)
        _say(restart_line(child.label, how, restart, child.log_path, others))

    def _restart(self, name: str) -> None:
        dead = next(c for c in self.stack.group.children if c.name == name)
        process = self.stack.restart_service(dead)
        self.supervisor.started(name)
        self.starting[name] = (process, self._exited_at.pop(name, self.supervisor.clock()))

    def _report(self, child: Child) -> None:
        self.reported.append(child)
        _say(
            f"fairlane: {child.name} exited ({exit_text(child.popen.returncode)}); the "
            f"replicas schedule alone until it is back (log: {child.log_path})"
        )


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _live_metrics_url(stack: Stack) -> str | None:
    """A running replica's metrics (seats are read there), or None if none runs."""
    live = stack.services.alive() if stack.services is not None else []
    return live[0].metrics_url if live else None


def _backend_line(spec: BackendSpec, seats: Mapping[str, SeatCount]) -> str:
    """A backend as the banner shows it, with its seats as the service reports them (or as
    declared, if the service has not answered yet)."""
    seat = seats.get(spec.address)
    if seat is not None:
        return seat.line(spec.address)
    if spec.seats is not None:
        return SeatCount(spec.region, spec.seats, "declared").line(spec.address)
    return f"backend {spec.region} {spec.address}: seats learned from the engine"


def _print_banner(
    stack: Stack,
    seats: Mapping[str, SeatCount],
    try_lines: Sequence[str],
    models: Mapping[str, ServedModels | str],
) -> None:
    lines: Sequence[str] = [
        f"fairlane is up: OpenAI API on {stack.url}",
        *[
            f"  {_backend_line(b, seats)}\n    serves {_models_text(models.get(b.address))}"
            for b in stack.backends
        ],
        *[
            f"  backend {d.region} {d.url}: every address it resolves to (as they come and go)"
            for d in stack.config.dns_backends
        ],
        "    (seats: requests each engine runs at once; changes are printed as they are learned)",
        f"  prefix affinity: {_prefix_mode(stack)}",
        *_service_lines(stack),
        f"  logs in {stack.group.log_dir}",
        "",
        *try_lines,
        "",
        "Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)


def _models_text(models: ServedModels | str | None) -> str:
    """A backend's models as the banner says them (the service reads them again later)."""
    if models is None or isinstance(models, str):
        return f"models not read yet ({models or 'no answer'}); any model may go there"
    return models.describe()


def _prefix_mode(stack: Stack) -> str:
    """How the picker knows what each engine's prefix cache holds, as the banner says it."""
    publishing = sum(b.kv_events is not None for b in stack.backends)
    publishing += sum(d.kv_events is not None for d in stack.config.dns_backends)
    if publishing and stack.tokenizer is not None:
        return (
            f"precise, from the KV events of {publishing} engine(s) and the "
            f"{stack.tokenizer} tokenizer "
            "(fairlane_prefix_matches_total{index} shows which index matched)"
        )
    return "approximate (what was sent where; engines' KV events turn on precise routing)"


def _service_lines(stack: Stack) -> list[str]:
    """Where the service is: one process, or each replica and the Redis they share."""
    services = stack.services
    if services is None or not services.replicated:
        return [
            f"  ext_proc service 127.0.0.1:{stack.service_port}, Envoy admin {stack.admin_url}",
            f"  gateway metrics http://127.0.0.1:{stack.metrics_port}/metrics",
        ]
    return [
        f"  ext_proc service: {len(services.processes)} replicas sharing state in "
        f"{services.redis_url}; Envoy admin {stack.admin_url}",
        *[
            f"    replica {p.replica_id}: gRPC {p.grpc_address}, metrics {p.metrics_url}"
            for p in services.processes
        ],
    ]
