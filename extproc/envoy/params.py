"""What the Envoy config depends on: :class:`EnvoyParams`, its routes, and Envoy's limits.

Almost every Envoy default is wrong for a gateway that holds requests for minutes, so the
settings that matter are derived from these few parameters in one place (the properties of
:class:`EnvoyParams`), each with the reason next to it; the builders only place them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from extproc.fleet.backend import BackendSpec
from extproc.fleet.discovery import DnsBackendSpec
from extproc.wire import BUFFER_HEADROOM_BYTES, EXTPROC_STREAM_HEADROOM

MiB = 1024 * 1024

# Proto limit for ext_proc's max_message_timeout (and thus for one hold per processing state).
MAX_MESSAGE_TIMEOUT_S = 3600.0
# stream_idle_timeout = longest hold + this: a request released at its deadline still has
# time to be forwarded and send response headers before the idle timer can fire.
IDLE_MARGIN_S = 60.0
# Envoy's HTTP/2 defaults (since 1.36) for the stream/connection flow-control windows.
H2_DEFAULT_STREAM_WINDOW = 16 * MiB
H2_DEFAULT_CONNECTION_WINDOW = 24 * MiB
H2_MAX_WINDOW = 2**31 - 1
# Upstream (vLLM) limits: high enough never to be the bottleneck; admission is fairlane's job.
BACKEND_MAX_REQUESTS = 100_000
BACKEND_MAX_RETRIES = 1_000  # Envoy's default of 3 concurrent retries (hedges count) is too low.
# The route's retry policy (see extproc.envoy.routes): which failures are retried, and how
# often. Hedges (per-request, from the service) count against num_retries as well.
RETRY_ON = "connect-failure,refused-stream,reset,gateway-error"
NUM_RETRIES = 2
# Floor for the global downstream connection limit (overload manager).
MIN_DOWNSTREAM_CONNECTIONS = 50_000

CATCH_ALL_ROUTE = "fairlane_llm"


class EnvoyConfigError(RuntimeError):
    """A bad parameter, a missing Envoy binary, or a config Envoy refused (with its message)."""


def _check_port(name: str, port: int, allow_zero: bool) -> None:
    low = 0 if allow_zero else 1
    if not low <= port <= 65535:
        raise EnvoyConfigError(f"{name} must be in [{low}, 65535], got {port}")


@dataclass(frozen=True)
class RouteSpec:
    """An extra route, matched before the catch-all ``/`` route, with its own failure mode.

    Every route goes through the ext_proc service in the same way; what differs is what
    Envoy does when the service is down, wedged or unreachable. Fail-closed (the default,
    and always the ext_proc filter's own setting) answers the client ``status_on_error``
    (503; 504 for a message timeout) and never forwards a request the scheduler did not
    admit. Fail-open (``failure_mode_allow`` via ``ExtProcPerRoute.overrides``) forwards it
    unprocessed: no authentication, no queueing, no vLLM priority, Envoy's fallback load
    balancer picks the backend. That only makes sense for cheap, idempotent paths such as
    ``GET /v1/models`` or a health route, never for generation.
    """

    name: str
    prefix: str | None = None
    path: str | None = None
    failure_mode_allow: bool = False

    def __post_init__(self) -> None:
        if not self.name or self.name == CATCH_ALL_ROUTE:
            raise EnvoyConfigError(f"route name must be set and not {CATCH_ALL_ROUTE!r}")
        if (self.prefix is None) == (self.path is None):
            raise EnvoyConfigError(f"route {self.name}: exactly one of prefix and path")
        match = self.prefix if self.prefix is not None else self.path
        if not match or not match.startswith("/"):
            raise EnvoyConfigError(f"route {self.name}: the match must start with '/'")

    @property
    def match(self) -> dict[str, str]:
        """The Envoy ``RouteMatch``."""
        if self.prefix is not None:
            return {"prefix": self.prefix}
        return {"path": self.path or "/"}


class ServiceReplica(NamedTuple):
    """One replica of the ext_proc service: an IP (a STATIC endpoint) or a DNS name
    (STRICT_DNS), and its gRPC port. A plain ``(host, port)`` tuple is accepted wherever one
    is expected (:attr:`EnvoyParams.service_replicas` converts it)."""

    host: str
    port: int

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


DEFAULT_BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec("127.0.0.1", 8101, "region-a"),
    BackendSpec("127.0.0.1", 8102, "region-b"),
)


@dataclass(frozen=True)
class EnvoyParams:
    """Everything the bootstrap depends on. Defaults give the shipped ``envoy/fairlane.yaml``."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    admin_host: str = "127.0.0.1"  # admin can drain/quit Envoy: keep it on loopback
    admin_port: int = 9901
    extproc_host: str = "127.0.0.1"  # an IP (STATIC cluster) or a DNS name (STRICT_DNS)
    extproc_port: int = 50051
    # Active-active replicas of the service (extproc.envoy.replicas), each (host, port).
    # Empty: the one service at extproc_host:extproc_port, today's config byte for byte.
    # Given: these, and extproc_host/extproc_port only name the service as a whole (the
    # mesh renderers read the Kubernetes Service from them).
    extproc_replicas: tuple[tuple[str, int], ...] = ()
    # The Redis the replicas share (`fairlane serve --state`). Envoy never talks to it; only
    # the workload the mesh renderers write passes it on the service's command line.
    state_url: str | None = None
    # The served model's tokenizer directory for precise prefix routing (`fairlane serve
    # --tokenizer`); like state_url, only the rendered workload passes it on.
    service_tokenizer: str | None = None
    backends: tuple[BackendSpec, ...] = field(default=DEFAULT_BACKENDS)
    # Backends found through DNS (dns://NAME:PORT): the service resolves them and Envoy
    # learns every backend from the service over EDS (extproc.envoy.clusters).
    dns_backends: tuple[DnsBackendSpec, ...] = ()
    # The regions in the order first named, static and DNS backends mixed (default: the
    # static backends' regions, then the names').
    region_order: tuple[str, ...] = ()
    max_body_bytes: int = 8 * MiB
    # The longest a request may be held in fairlane's queues (the largest queue deadline).
    longest_hold_s: float = 600.0
    # The most requests the queues may hold at once, across the whole Envoy.
    max_held_requests: int = 10_000
    message_timeout_s: float = 2.0
    access_log_path: str | None = None
    # Envoy sends finished requests to the service in batches at most this far apart
    # (extproc.envoy.connection_manager.access_logs); the bench divides it by its speedup.
    completion_flush_s: float = 0.01
    # Extra routes before the catch-all, each fail-open or fail-closed (RouteSpec).
    routes: tuple[RouteSpec, ...] = ()
    # The catch-all route's failure mode when the service is down: False = fail-closed
    # (503), the only safe choice for generation (see RouteSpec).
    failure_mode_allow: bool = False
    # TLS on the client listener (extproc.envoy.tls): a PEM certificate chain and its private
    # key, as paths Envoy reads at startup. Both or neither; neither: plain HTTP.
    tls_cert_path: str | None = None
    tls_key_path: str | None = None

    def __post_init__(self) -> None:
        for name in ("listen_port", "admin_port", "extproc_port"):
            _check_port(name, getattr(self, name), allow_zero=name != "extproc_port")
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise EnvoyConfigError("TLS needs both a certificate and a key file, or neither")
        if self.tls_cert_path == "" or self.tls_key_path == "":
            raise EnvoyConfigError("a TLS certificate or key path must not be empty")
        self._check_replicas()
        self._check_backends()
        if self.max_body_bytes <= 0:
            raise EnvoyConfigError("max_body_bytes must be positive")
        if not 0 < self.longest_hold_s <= MAX_MESSAGE_TIMEOUT_S:
            raise EnvoyConfigError(
                f"longest_hold_s must be in (0, {MAX_MESSAGE_TIMEOUT_S:.0f}] (ext_proc's "
                f"max_message_timeout caps one hold), got {self.longest_hold_s}"
            )
        if self.max_held_requests <= 0:
            raise EnvoyConfigError("max_held_requests must be positive")
        if not 0 < self.message_timeout_s <= MAX_MESSAGE_TIMEOUT_S:
            raise EnvoyConfigError(f"message_timeout_s must be in (0, {MAX_MESSAGE_TIMEOUT_S:.0f}]")
        if not 0 < self.completion_flush_s <= 1:
            raise EnvoyConfigError(
                f"completion_flush_s must be in (0, 1], got {self.completion_flush_s}"
            )
        names = [spec.name for spec in self.routes]
        for name in names:
            if names.count(name) > 1:
                raise EnvoyConfigError(f"route {name} is listed twice")

    def _check_replicas(self) -> None:
        seen: set[str] = set()
        for replica in self.service_replicas:
            if not replica.host:
                raise EnvoyConfigError("a service replica needs a host")
            _check_port(f"service replica {replica.host} port", replica.port, allow_zero=False)
            if replica.address in seen:
                raise EnvoyConfigError(f"service replica {replica.address} is listed twice")
            seen.add(replica.address)

    def _check_backends(self) -> None:
        if not self.backends and not self.dns_backends:
            raise EnvoyConfigError("at least one backend is needed")
        seen: set[str] = set()
        for backend in self.backends:
            if backend.address in seen:
                raise EnvoyConfigError(f"backend {backend.address} is listed twice")
            seen.add(backend.address)

    @property
    def service_replicas(self) -> tuple[ServiceReplica, ...]:
        """Every replica of the service Envoy talks to: the listed replicas, or the one
        service at ``extproc_host:extproc_port``."""
        if not self.extproc_replicas:
            return (ServiceReplica(self.extproc_host, self.extproc_port),)
        return tuple(ServiceReplica(host, port) for host, port in self.extproc_replicas)

    @property
    def replicated(self) -> bool:
        """More than one replica: Envoy must fail over between them and send every
        replica every completion (extproc.envoy.replicas)."""
        return len(self.service_replicas) > 1

    @property
    def regions(self) -> tuple[str, ...]:
        """Regions in the order first named; the index is the Envoy priority level."""
        named = [*self.region_order, *(b.region for b in self.backends)]
        return tuple(dict.fromkeys([*named, *(d.region for d in self.dns_backends)]))

    @property
    def dynamic_fleet(self) -> bool:
        """Some backends come from DNS: the backends' cluster is EDS, served by the service."""
        return bool(self.dns_backends)

    @property
    def tls(self) -> bool:
        """Whether the client listener terminates TLS."""
        return self.tls_cert_path is not None

    @property
    def buffer_limit_bytes(self) -> int:
        """Listener/cluster buffer limit: the largest allowed body plus headroom."""
        return self.max_body_bytes + BUFFER_HEADROOM_BYTES

    @property
    def stream_idle_timeout_s(self) -> float:
        """Above the longest hold, because the idle timer keeps ticking while ext_proc holds."""
        return self.longest_hold_s + IDLE_MARGIN_S

    @property
    def extproc_stream_limit(self) -> int:
        """Circuit-breaker limit on the ext_proc cluster: every held request is one stream."""
        return self.max_held_requests + EXTPROC_STREAM_HEADROOM

    @property
    def max_downstream_connections(self) -> int:
        """Global client-connection cap: HTTP/1.1 clients hold one connection per held
        request, so it must sit well above ``max_held_requests``."""
        return max(MIN_DOWNSTREAM_CONNECTIONS, 2 * self.max_held_requests)
