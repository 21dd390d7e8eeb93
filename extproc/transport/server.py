"""``fairlane serve``: the ext_proc and access-log gRPC services in one process.

The servicers run on ``extproc.transport.h2grpc``, a gRPC server in the event loop's own
thread (why not grpc.aio: its module docstring; the overhead benchmark measures the two),
with limits sized from the policy (``extproc.transport.limits``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.runtime.v3 import rtds_pb2_grpc

from extproc.core.admission import Admission
from extproc.core.blockhash import HASH_ALGOS, BlockHasher
from extproc.core.gateway import Gateway
from extproc.core.overload import OverloadControl
from extproc.core.prefix import EngineHashing, PromptTokenizer
from extproc.core.prompt import BuiltinTokenizer
from extproc.fleet.adapters import AdapterLoader
from extproc.fleet.backend import Backend, BackendPool, BackendSpec
from extproc.fleet.discovery import ANY_BACKEND_SYNTAX, DnsBackendSpec, FleetSpec
from extproc.fleet.membership import Changes, Membership
from extproc.fleet.poller import Poller
from extproc.fleet.resolver import (
    DEFAULT_MAX_INTERVAL_S,
    NAMESERVER_SYNTAX,
    DnsError,
    DnsLookup,
    DnsWatcher,
    parse_nameserver,
)
from extproc.fleet.tokenizer import EngineTokenizer, TokenizerError
from extproc.policy import DEFAULT_POLICY_PATH, Policy, PolicyStore
from extproc.state.exchange import RedisExchange
from extproc.state.replica import PERIOD_S, SharedState
from extproc.transport.credentials import (
    REGION_KEY_SYNTAX,
    BackendCredentials,
    CredentialError,
    parse_region_key,
)
from extproc.transport.endpoints import EndpointSet, levels_of
from extproc.transport.h2grpc import GrpcServer
from extproc.transport.held import HeldRequests
from extproc.transport.kv_feeds import KVEventFeeds
from extproc.transport.limits import ServerLimits
from extproc.transport.overload import Ages, watch_overload
from extproc.transport.prometheus import GatewayCollector, start_metrics_server
from extproc.transport.read_later import read_later
from extproc.transport.runtime import RuntimeLayer
from extproc.transport.servicer import (
    AccessLog,
    EndpointDiscovery,
    ExternalProcessor,
    RuntimeDiscovery,
    add_external_processor,
)

log = logging.getLogger("fairlane.server")


@dataclass(frozen=True)
class ServiceConfig:
    backends: tuple[BackendSpec, ...]
    policy_path: Path = DEFAULT_POLICY_PATH
    host: str = "127.0.0.1"
    port: int = 50051
    health_interval_s: float = 1.0
    completion_timeout_s: float = 1800.0
    """A request whose completion event never arrives frees its slot after this long."""
    metrics_port: int | None = None
    """Serve the gateway's Prometheus metrics on this port (0: any free port)."""
    drain_s: float = 10.0
    """On SIGTERM, how long held requests may still be granted before the rest get a 503."""
    state_url: str | None = None
    """``redis://HOST:PORT[/DB]``: be one of N replicas sharing state there (None: alone)."""
    replica_id: str | None = None
    """This replica's name among the others (default: ``HOST:PORT`` of its gRPC port)."""
    state_period_s: float = PERIOD_S
    """How often a replica exchanges state (the bench shortens it by its speedup)."""
    region_keys: tuple[tuple[str, str], ...] = ()
    """(region, ``env:NAME``/``file:PATH``): the API key of that region's engines, for the
    backends that name no key of their own (``extproc.transport.credentials``)."""
    dns_backends: tuple[DnsBackendSpec, ...] = ()
    """``dns://NAME:PORT`` backends: every address each name resolves to is a backend
    (``extproc.fleet.membership``), and Envoy learns the set over EDS."""
    regions: tuple[str, ...] = ()
    """The regions in the order first named (default: the backends', then the names')."""
    dns_server: tuple[str, int] | None = None
    """Where names are resolved (None: the system's resolvers, /etc/resolv.conf)."""
    dns_interval_s: float | None = None
    """Resolve every name this often (None: when its answer's TTL runs out)."""
    dns_max_interval_s: float = DEFAULT_MAX_INTERVAL_S
    """The longest time between two resolutions of a name, whatever its TTL."""
    max_connections: int = ServerLimits.max_connections
    """Connections the gRPC port serves at once (``extproc.transport.limits``)."""
    tokenizer: str | None = None
    """The served model's directory (``tokenizer.json``, ``tokenizer_config.json``), or
    ``builtin`` (fairlane's simulated engines): with it, prompts are matched against the
    blocks engines report in their KV events."""
    kv_hash_algo: str = "sha256"
    """The engines' ``--prefix-caching-hash-algo``."""
    kv_hash_seed: str | None = None
    """The engines' ``PYTHONHASHSEED``, when they set one (their block hashes start from it)."""


class Service:
    """The running service: gateway state plus the gRPC server and its background tasks."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.policies = PolicyStore(config.policy_path)
        regions = config.regions or FleetSpec(config.backends, config.dns_backends).regions
        self.pool = BackendPool(config.backends, regions=regions, dynamic=bool(config.dns_backends))
        self.admission = Admission(self.pool, self.policies.current)
        self.admission.engine = engine_hashing(config)
        self.policies.on_change(self._policy_changed)
        self.overload = OverloadControl()
        self.runtime = RuntimeLayer()
        self.ages = Ages()
        self.gateway = Gateway(self.policies, self.admission, overload=self.overload)
        self.held = HeldRequests(self.gateway)
        # Read once, here: a key that cannot be read stops the service before it serves.
        self.credentials = BackendCredentials.load(
            config.backends, config.region_keys, config.dns_backends
        )
        self.poller = Poller(
            self.pool,
            on_change=self.held.dispatch,
            authorization=self._engine_authorization,
        )
        self.endpoints = EndpointSet()
        self.endpoints.publish(levels_of(self.pool))
        self.membership = Membership(
            self.pool, config.dns_backends, drain_timeout_s=config.completion_timeout_s
        )
        self.dns: DnsWatcher | None = None
        if config.dns_backends:
            self.dns = DnsWatcher(
                self.membership,
                DnsLookup(config.dns_server),
                self._fleet_changed,
                self.pool.clock,
                config.dns_interval_s,
                config.dns_max_interval_s,
            )
        self.server = GrpcServer(
            ServerLimits.for_policy(self.policies.current, config.max_connections)
        )
        self.adapters = AdapterLoader(self.pool, authorization=self._engine_authorization)
        add_external_processor(
            ExternalProcessor(self.held, self.ages, self.credentials, self.adapters),
            self.server,
        )
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLog(self.held), self.server)
        rtds_pb2_grpc.add_RuntimeDiscoveryServiceServicer_to_server(
            RuntimeDiscovery(self.runtime), self.server
        )
        eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(
            EndpointDiscovery(self.endpoints), self.server
        )
        self.port = self.server.add_insecure_port(f"{config.host}:{config.port}")
        self._tasks: list[asyncio.Task[None]] = []
        self._syncs: set[asyncio.Task[None]] = set()
        self.failed: asyncio.Future[str] | None = None
        """Set to why, when a background loop (scraping, health, shared state...) ended with
        an error: the service would go on answering but blind or cut off, so ``serve`` stops
        it and exits non-zero for its supervisor to restart (crash-only)."""
        self._scrape: asyncio.Task[None] | None = None
        self._scrape_interval_s = 0.0
        self._metrics: web.AppRunner | None = None
        self.metrics_port: int | None = None
        self.kv_feeds: KVEventFeeds | None = None
        publishing = [b.kv_events for b in config.backends]
        publishing += [d.kv_events for d in config.dns_backends]
        if any(publishing) and self.admission.engine is not None:
            # Without the engines' hashing (no --tokenizer) no prompt can be matched against
            # the events: following them would only cost CPU (a replay of the engines' whole
            # buffer at start), so they are not followed (``engine_hashing`` warns).
            self.kv_feeds = KVEventFeeds(self.pool)
        self.state: SharedState | None = None
        if config.state_url is not None:
            replica = config.replica_id or f"{config.host}:{self.port}"
            store = RedisExchange(config.state_url, replica)
            self.state = SharedState(
                self.admission, store, self.held.apply_peers, period_s=config.state_period_s
            )

    def _engine_authorization(self, backend: Backend) -> str | None:
        """The ``authorization`` an engine's ``/v1/models`` wants (its vLLM ``--api-key``)."""
        return None if self.credentials is None else self.credentials.header_for(backend.address)

    def _fleet_changed(self, changes: Changes) -> None:
        """Backends joined, drained or left: keys for the new, release what the removed
        held, and tell Envoy the new host set."""
        for address in changes.joined:
            if self.credentials is not None:
                self.credentials.add(self.pool.by_address[address].spec)
        for backend in changes.removed:
            if self.credentials is not None:
                self.credentials.forget(backend.address)
            self.held.forget_backend(backend.address)
        self.endpoints.publish(levels_of(self.pool))
        if self.kv_feeds is not None and (changes.joined or changes.removed):
            task = asyncio.create_task(self.kv_feeds.sync(), name="kv-events-sync")
            self._syncs.add(task)
            task.add_done_callback(self._syncs.discard)

    async def start(self) -> None:
        await self.server.start()
        if self.dns is not None:
            # Before anything is asked of the pool; a name that fails is retried by the loop.
            await self.dns.refresh_all()
        if self.config.metrics_port is not None:
            collector = GatewayCollector(
                self.admission,
                self.gateway.stats,
                self.policies,
                self.overload,
                self.state,
                self.membership,
                self.kv_feeds,
                self.server,
            )
            self._metrics, self.metrics_port = await start_metrics_server(
                collector, self.config.host, self.config.metrics_port
            )
        self._tasks = [
            asyncio.create_task(watch_policy(self.policies), name="policy-watch"),
            asyncio.create_task(
                self.poller.watch_health(self.config.health_interval_s), name="health"
            ),
            asyncio.create_task(self._expire_lost_completions(), name="expire"),
            asyncio.create_task(
                watch_overload(self.overload, self.runtime, self.ages), name="overload"
            ),
        ]
        if self.state is not None:
            self._tasks.append(asyncio.create_task(self.state.run(), name="shared-state"))
        if self.dns is not None:
            self._tasks.append(asyncio.create_task(self.dns.run(), name="dns"))
        if self.kv_feeds is not None:
            self._tasks.append(asyncio.create_task(self.kv_feeds.run(), name="kv-events"))
        engine = self.admission.engine
        if engine is not None:
            reading = read_later(engine.tokenizer, self.overload)
            self._tasks.append(asyncio.create_task(reading, name="read-later"))
        self.failed = asyncio.get_running_loop().create_future()
        for task in self._tasks:
            task.add_done_callback(self._background_ended)
        self._scrape = self._start_scraping()
        log.info("fairlane ext_proc service on %s:%d", self.config.host, self.port)

    def _start_scraping(self) -> asyncio.Task[None]:
        interval = self.policies.current.backpressure.scrape_interval_s
        self._scrape_interval_s = interval
        task = asyncio.create_task(self.poller.watch_metrics(interval), name="scrape")
        task.add_done_callback(self._background_ended)
        return task

    def _background_ended(self, task: asyncio.Task[None]) -> None:
        if self.failed is not None:
            record_failure(task, self.failed)

    def _policy_changed(self, policy: Policy) -> None:
        self.held.configure(policy)
        if self._scrape is not None and (
            policy.backpressure.scrape_interval_s != self._scrape_interval_s
        ):
            self._scrape.cancel()
            self._scrape = self._start_scraping()

    async def stop(self, drain_s: float = 0.0) -> None:
        """Shut down without dropping held requests on the floor.

        New ext_proc streams are refused at once (Envoy then answers per its failure mode).
        Held requests may still be granted for up to ``drain_s`` while completions keep
        arriving on the open access-log stream; whatever is still queued after that gets a
        503 with ``retry-after`` instead of a cut stream. Then the open streams are closed.
        """
        closing = asyncio.create_task(self.server.stop(drain_s + 5.0), name="grpc-stop")
        deadline = asyncio.get_running_loop().time() + drain_s
        while len(self.admission.scheduler) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        turned_away = self.held.turn_away(
            "the gateway is restarting; retry", "gateway_restarting", retry_after_s=1
        )
        if turned_away:
            log.warning("shutting down: %d held requests answered 503", turned_away)
            await asyncio.sleep(0.2)  # let their streams write the answer
        await self.server.stop(0)  # the access-log streams stay open forever: cut them
        await closing
        if self._scrape is not None:
            self._tasks.append(self._scrape)
        for task in self._tasks:
            task.cancel()
        # A loop that failed was logged when it did (``_background_ended``).
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.kv_feeds is not None:
            await self.kv_feeds.stop()
        await self.adapters.close()
        if self._metrics is not None:
            await self._metrics.cleanup()

    async def _expire_lost_completions(self) -> None:
        interval = min(10.0, self.config.completion_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            self.held.expire(self.config.completion_timeout_s)


BUILTIN_TOKENIZER = "builtin"
"""``--tokenizer builtin``: the simulator's tokenizer (``extproc.core.prompt``)."""


def engine_hashing(config: ServiceConfig) -> EngineHashing | None:
    """The engines' tokenizer and hash chain, when precise prefix routing is configured;
    ``TokenizerError``/``ValueError`` (stopping the service before it serves) when the
    configuration is wrong, a warning when it is half there."""
    with_events = [b.address for b in config.backends if b.kv_events is not None]
    with_events += [d.url for d in config.dns_backends if d.kv_events is not None]
    if config.tokenizer is None:
        if with_events:
            log.warning(
                "backends %s publish KV events, but no --tokenizer names the model's "
                "tokenizer: their events are not followed, prefix affinity stays approximate",
                ", ".join(with_events),
            )
        return None
    tokenizer: PromptTokenizer = (
        BuiltinTokenizer()
        if config.tokenizer == BUILTIN_TOKENIZER
        else EngineTokenizer.from_dir(config.tokenizer)
    )
    engine = EngineHashing(tokenizer, BlockHasher(config.kv_hash_algo, config.kv_hash_seed))
    if not with_events:
        log.warning(
            "--tokenizer given, but no backend names its kv-events port: prefix affinity "
            "stays approximate"
        )
    return engine


async def watch_policy(store: PolicyStore) -> None:
    """Re-read the policy file every ``store.poll_interval_s``, forever (cancel to stop); a
    stat per poll when unchanged.

    The stat, read, parse and validation run in a thread of their own (100,000 tenants take
    seconds to parse, and every request would wait for them on the loop); only the commit,
    the listeners and the swap, runs on the loop, where the state they touch lives. The
    thread still shares the GIL, so requests are slowed while it parses, never stopped: the
    interpreter hands the GIL back to the loop every ``sys.getswitchinterval()`` (5 ms).
    One thread, so loads never overlap; a load cut short by cancelling finishes unseen."""
    loop = asyncio.get_running_loop()
    loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy-load")
    try:
        while True:
            await asyncio.sleep(store.poll_interval_s)
            store.commit(await loop.run_in_executor(loader, store.load_if_changed))
    finally:
        loader.shutdown(wait=False, cancel_futures=True)


def record_failure(task: asyncio.Task[None], failed: asyncio.Future[str]) -> None:
    """A background loop's done-callback. Every such loop runs forever, so one that ended
    with an error is logged now, with its traceback, and ``failed`` learns why (the first
    failure wins); a cancelled one is a stop. Logged at once, not at shutdown: a scrape loop
    once died silently and its replica held requests until their deadline."""
    if task.cancelled() or (error := task.exception()) is None:
        return
    log.error("background task %r failed", task.get_name(), exc_info=error)
    if not failed.done():
        failed.set_result(f"background task {task.get_name()!r} failed: {error!r}")


STOP_MARGIN_S = 15.0
"""How much longer than its drain a stop may take (the gRPC server's own grace is the
drain plus 5 s) before the process exits regardless."""


async def serve(config: ServiceConfig) -> None:
    """Run until SIGINT/SIGTERM; a second signal while stopping exits at once."""
    service = Service(config)
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    assert service.failed is not None
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait((stopping, service.failed), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    log.info("stopping: draining held requests for up to %gs", config.drain_s)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: exit_now("a second signal while stopping"))
    await stop_within(service.stop(config.drain_s), config.drain_s + STOP_MARGIN_S)
    if service.failed.done():
        exit_now(service.failed.result())


async def stop_within(
    stopping: Coroutine[object, object, None],
    timeout_s: float,
    exit: Callable[[str], None] | None = None,
) -> None:
    """Await the service's stop, but at most ``timeout_s``: a stop that hangs must not
    leave the process behind (seen once: a replica stopped 0.4 s after its start stayed
    "draining" for 80 minutes, its loop idle, until SIGKILL). ``exit`` ends the process
    (``exit_now``; a test passes its own)."""
    try:
        await asyncio.wait_for(stopping, timeout_s)
    except TimeoutError:
        (exit or exit_now)(f"the stop did not finish within {timeout_s:g}s")


def exit_now(why: str) -> None:
    """Leave at once, whatever the loop still awaits (the logs are flushed first)."""
    log.error("exiting now: %s", why)
    logging.shutdown()
    os._exit(1)


def add_policy_argument(parser: argparse.ArgumentParser) -> None:
    """``--policy``, shared by ``serve`` and ``up``."""
    parser.add_argument(
        "--policy",
        type=Path,
        default=DEFAULT_POLICY_PATH,
        help="policy YAML, reloaded when it changes (default: the embedded default policy)",
    )


SEATS_HELP = (
    "; #seats=N declares how many requests the engine runs at once (its --max-num-seqs), "
    "otherwise learned from its /metrics; #key=env:NAME or #key=file:PATH says where its "
    "API key (vLLM --api-key) is read from (both: #seats=N,key=...)"
)
"""What every ``--backend`` help says about ``#seats=N``."""


def add_backend_argument(parser: argparse.ArgumentParser, required: bool, help: str) -> None:
    """``--backend [REGION=]http://IP:PORT[#seats=N]`` (repeatable), shared by ``serve`` and
    ``up``; ``help`` says what the option means to that command, the seat syntax is added."""
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar=ANY_BACKEND_SYNTAX,
        required=required,
        help=help + SEATS_HELP,
    )


def add_region_key_argument(parser: argparse.ArgumentParser) -> None:
    """``--region-key REGION=env:NAME|file:PATH`` (repeatable), shared by ``serve`` and
    ``up``."""
    parser.add_argument(
        "--region-key",
        action="append",
        default=[],
        metavar=REGION_KEY_SYNTAX,
        help="where the API key of a region's engines (vLLM --api-key) is read from, for "
        "its backends without a key=... of their own; sent to them as authorization, never "
        "logged (repeatable)",
    )


def region_keys_from_args(values: Sequence[str]) -> tuple[tuple[str, str], ...]:
    try:
        return tuple(parse_region_key(v) for v in values)
    except CredentialError as exc:
        raise SystemExit(f"fairlane: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (default %(default)s)")
    add_policy_argument(parser)
    add_backend_argument(
        parser,
        required=True,
        help="a vLLM server, e.g. region-a=http://10.0.0.5:8000 or "
        "region-a=http://10.0.0.5:8000#seats=64, or every address of a DNS name, e.g. "
        "region-a=dns://vllm.default.svc.cluster.local:8000 (repeatable; the first region "
        "named is the local one)",
    )
    add_region_key_argument(parser)
    add_dns_arguments(parser)
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the gateway's Prometheus metrics at /metrics on this port",
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=10.0,
        help="on SIGTERM, keep granting held requests this long, then answer the rest 503 "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--state",
        metavar="redis://HOST:PORT[/DB]",
        default=None,
        help="run as one of N active-active replicas sharing state in this Redis (default: "
        "alone, state in this process)",
    )
    parser.add_argument(
        "--replica-id",
        default=None,
        help="this replica's name among the others (default: HOST:PORT of its gRPC port)",
    )
    parser.add_argument(
        "--state-period-ms",
        type=float,
        default=PERIOD_S * 1000,
        help="how often a replica exchanges state with the others: how stale its view of "
        "them may be (default %(default)g)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=ServerLimits.max_connections,
        help="connections the gRPC port serves at once; more are closed at once (default "
        "%(default)s; Envoy opens a few per worker)",
    )
    add_kv_event_arguments(parser)
    parser.add_argument("--log-level", default="INFO")


def add_kv_event_arguments(parser: argparse.ArgumentParser) -> None:
    """How the engines hash their KV blocks, for precise prefix routing (backends that
    name their ``kv-events`` port)."""
    group = parser.add_argument_group(
        "precise prefix routing (backends with #kv-events=PORT)",
        "match prompts against the blocks engines report in their KV events; needs the "
        "served model's tokenizer and the engines' hash settings",
    )
    group.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR|builtin",
        help="the served model's directory (tokenizer.json, tokenizer_config.json), or "
        "builtin: the tokenizer of fairlane's simulated engines (fairlane sim)",
    )
    group.add_argument(
        "--prefix-caching-hash-algo",
        choices=HASH_ALGOS,
        default="sha256",
        help="the engines' --prefix-caching-hash-algo (default %(default)s, vLLM 0.32's)",
    )
    group.add_argument(
        "--kv-hash-seed",
        default=None,
        metavar="SEED",
        help="the engines' PYTHONHASHSEED, if they set one (default: none, vLLM's fixed seed)",
    )


def kv_event_arguments(args: argparse.Namespace) -> tuple[str, ...]:
    """``add_kv_event_arguments``' values as ``fairlane serve`` flags (``fairlane up``
    passes them on)."""
    tokenizer = () if args.tokenizer is None else ("--tokenizer", str(args.tokenizer))
    return (*tokenizer, *kv_hash_arguments(args))


def kv_hash_arguments(args: argparse.Namespace) -> tuple[str, ...]:
    """The engines' hash settings among ``add_kv_event_arguments``' values, as ``fairlane
    serve`` flags (empty for vLLM's defaults)."""
    flags: list[str] = []
    if args.prefix_caching_hash_algo != "sha256":
        flags += ["--prefix-caching-hash-algo", args.prefix_caching_hash_algo]
    if args.kv_hash_seed is not None:
        flags += ["--kv-hash-seed", args.kv_hash_seed]
    return tuple(flags)


def add_dns_arguments(parser: argparse.ArgumentParser) -> None:
    """How ``dns://`` backends are resolved, shared by ``serve`` and ``up``."""
    parser.add_argument(
        "--dns-server",
        metavar=NAMESERVER_SYNTAX,
        default=None,
        help="resolve dns:// backends at this DNS server (default: the system's, from "
        "/etc/resolv.conf, with its search domains)",
    )
    parser.add_argument(
        "--dns-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="resolve each dns:// backend this often (default: when its answer's TTL runs out)",
    )
    parser.add_argument(
        "--dns-max-interval",
        type=float,
        default=DEFAULT_MAX_INTERVAL_S,
        metavar="SECONDS",
        help="resolve each dns:// backend at least this often, whatever its TTL (default "
        "%(default)g)",
    )


def dns_server_from_args(args: argparse.Namespace) -> tuple[str, int] | None:
    """``--dns-server``, checked, and the intervals with it (a bad value exits with why)."""
    intervals = (
        ("--dns-interval", args.dns_interval),
        ("--dns-max-interval", args.dns_max_interval),
    )
    for flag, value in intervals:
        if value is not None and not value > 0:
            raise SystemExit(f"fairlane: {flag} must be > 0, not {value}")
    if args.dns_server is None:
        return None
    try:
        return parse_nameserver(args.dns_server)
    except ValueError as exc:
        raise SystemExit(f"fairlane: {exc}") from None


def dns_arguments(args: argparse.Namespace) -> tuple[str, ...]:
    """The ``--dns-*`` flags given to ``up``, for the service processes it starts."""
    flags: list[str] = []
    if args.dns_server is not None:
        flags += ["--dns-server", args.dns_server]
    if args.dns_interval is not None:
        flags += ["--dns-interval", str(args.dns_interval)]
    if args.dns_max_interval != DEFAULT_MAX_INTERVAL_S:
        flags += ["--dns-max-interval", str(args.dns_max_interval)]
    return tuple(flags)


def fleet_from_args(values: Sequence[str]) -> FleetSpec:
    """``--backend`` values, static and ``dns://`` mixed; a bad one exits with why."""
    try:
        return FleetSpec.parse(values)
    except ValueError as exc:
        raise SystemExit(f"fairlane: {exc}") from None


def backends_from_args(values: Sequence[str]) -> tuple[BackendSpec, ...]:
    """Static ``--backend`` values only (``fleet_from_args`` takes DNS names too)."""
    fleet = fleet_from_args(values)
    if fleet.dns:
        raise SystemExit(f"fairlane: {fleet.dns[0].url}: a DNS backend is not accepted here")
    return fleet.static


def state_url(value: str | None) -> str | None:
    """``--state``, checked: only Redis (``redis://``, or ``rediss://`` for TLS) is known."""
    if value is None:
        return None
    if not value.startswith(("redis://", "rediss://")):
        raise SystemExit(f"fairlane: --state must be redis://HOST:PORT[/DB], not {value!r}")
    return value


def run(args: argparse.Namespace) -> int:
    if not args.state_period_ms > 0:
        raise SystemExit(f"fairlane: --state-period-ms must be > 0, not {args.state_period_ms}")
    if args.max_connections < 1:
        raise SystemExit(f"fairlane: --max-connections must be >= 1, not {args.max_connections}")
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    fleet = fleet_from_args(args.backend)
    config = ServiceConfig(
        backends=fleet.static,
        dns_backends=fleet.dns,
        regions=fleet.regions,
        policy_path=args.policy,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        drain_s=args.drain_seconds,
        state_url=state_url(args.state),
        replica_id=args.replica_id,
        state_period_s=args.state_period_ms / 1000,
        region_keys=region_keys_from_args(args.region_key),
        dns_server=dns_server_from_args(args),
        dns_interval_s=args.dns_interval,
        dns_max_interval_s=args.dns_max_interval,
        max_connections=args.max_connections,
        tokenizer=args.tokenizer,
        kv_hash_algo=args.prefix_caching_hash_algo,
        kv_hash_seed=args.kv_hash_seed,
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(serve(config))
    except (CredentialError, DnsError, TokenizerError) as exc:  # raised before anything listens
        raise SystemExit(f"fairlane: {exc}") from None
    return 0
