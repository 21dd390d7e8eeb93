"""Backends found through DNS: ``[REGION=]dns://NAME:PORT``, one backend per address.

A fleet that autoscales or rolls (Kubernetes pods behind a headless Service, compose
replicas behind a service name) has no fixed addresses: the name is the stable thing, and
what it resolves to is the fleet at that moment. A :class:`DnsBackendSpec` is such a name;
every address it resolves to becomes a :class:`~extproc.fleet.backend.BackendSpec` of its
own (``member``), with its own metrics polling, seats, prefix index and health, named
``ip:port`` like a static backend, because Envoy's ``override_host`` matches ``ip:port``
strings against its hosts (the service tells Envoy the same set over EDS).

:class:`FleetSpec` is the whole configured fleet, static and DNS backends mixed, with the
regions in the order first named (the first is the local one, Envoy's priority 0). Parsing
is pure; resolving is :mod:`extproc.fleet.resolver`'s, following the set is
:mod:`extproc.fleet.membership`'s.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from extproc.fleet.backend import (
    BACKEND_SYNTAX,
    DEFAULT_REGION,
    BackendSpec,
    KVEventPorts,
    check_endpoint_fields,
    parse_backend,
    split_backend_argument,
)

DNS_SCHEME = "dns"
DNS_BACKEND_SYNTAX = (
    "[REGION=]dns://NAME:PORT[#seats=N][,key=env:NAME|file:PATH][,kv-events=PORT[,kv-replay=PORT]]"
    "[,models=NAME|NAME...]"
)
"""How a backend found through DNS is written on the command line (``--backend``)."""
ANY_BACKEND_SYNTAX = f"{BACKEND_SYNTAX} or {DNS_BACKEND_SYNTAX}"

_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")


def _name_problem(name: str) -> str | None:
    """Why ``name`` is not a DNS name to resolve (None when it is one)."""
    if not name:
        return "the name is empty"
    try:
        ipaddress.ip_address(name)
    except ValueError:
        pass
    else:
        return "that is an IP address, not a name: write http://IP:PORT for a fixed backend"
    if len(name.rstrip(".")) > 253:
        return "a DNS name has at most 253 characters"
    labels = name.lower().rstrip(".").split(".")
    if not all(_LABEL.match(label) for label in labels):
        return (
            "not a DNS name (labels of letters, digits, '-' or '_', 1 to 63 characters, "
            "separated by '.')"
        )
    return None


@dataclass(frozen=True, slots=True)
class DnsBackendSpec:
    """A DNS name whose A/AAAA records are backends, all on ``port``, in ``region``.

    ``weight``, ``seats`` and ``credential`` are what each address gets (``member``): the
    engines behind one name are one Deployment, so one flag set.
    """

    name: str
    port: int
    region: str = DEFAULT_REGION
    weight: int = 1
    seats: int | None = None
    credential: str | None = None
    kv_events: KVEventPorts | None = None
    models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problem = _name_problem(self.name)
        if problem is not None:
            raise ValueError(f"dns backend name {self.name!r}: {problem}")
        check_endpoint_fields(self.port, self.region, self.weight, self.seats, self.credential)

    @property
    def url(self) -> str:
        """``dns://NAME:PORT``, as written and as logs and metrics name it."""
        return f"{DNS_SCHEME}://{self.name}:{self.port}"

    def member(self, ip: str) -> BackendSpec:
        """The backend at ``ip``, one of the addresses the name resolved to."""
        return BackendSpec(
            ip,
            self.port,
            self.region,
            weight=self.weight,
            seats=self.seats,
            credential=self.credential,
            kv_events=self.kv_events,
            models=self.models,
        )


def is_dns_backend(text: str) -> bool:
    """Whether a ``--backend`` value names a DNS backend (``[REGION=]dns://...``)."""
    address = text.partition("#")[0]
    _, sep, url = address.partition("=")
    return (url if sep else address).strip().lower().startswith(f"{DNS_SCHEME}://")


def parse_dns_backend(text: str) -> DnsBackendSpec:
    """Parse ``DNS_BACKEND_SYNTAX``."""
    region, url, options = split_backend_argument(text)
    rest = url.strip()[len(DNS_SCHEME) + 3 :]
    name, colon, port_text = rest.rpartition(":")
    if not colon or not port_text.isdigit() or "/" in rest:
        raise ValueError(f"backend {text!r}: expected {DNS_BACKEND_SYNTAX} (the port is required)")
    try:
        return DnsBackendSpec(
            name,
            int(port_text),
            region.strip() or DEFAULT_REGION,
            seats=options.seats,
            credential=options.credential,
            kv_events=options.kv_events,
            models=options.models,
        )
    except ValueError as exc:
        raise ValueError(f"backend {text!r}: {exc}") from None


@dataclass(frozen=True)
class FleetSpec:
    """The configured fleet: fixed backends and DNS names, and the regions in the order first
    named (the index is the region's Envoy priority; the first is the local region)."""

    static: tuple[BackendSpec, ...] = ()
    dns: tuple[DnsBackendSpec, ...] = ()
    regions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        named = dict.fromkeys(
            [*self.regions, *(s.region for s in self.static), *(d.region for d in self.dns)]
        )
        object.__setattr__(self, "regions", tuple(named))
        urls = [s.url for s in self.dns]
        for url in urls:
            if urls.count(url) > 1:
                raise ValueError(f"backend {url} is listed twice")

    @property
    def dynamic(self) -> bool:
        """Whether any backend comes from DNS (the set can change while the service runs)."""
        return bool(self.dns)

    @classmethod
    def parse(cls, texts: Iterable[str]) -> FleetSpec:
        """``--backend`` values, each static (``http://IP:PORT``) or ``dns://NAME:PORT``;
        regions keep the order they were first named in, whichever kind named them."""
        static: list[BackendSpec] = []
        dns: list[DnsBackendSpec] = []
        regions: list[str] = []
        for text in texts:
            if is_dns_backend(text):
                name = parse_dns_backend(text)
                dns.append(name)
                regions.append(name.region)
            else:
                spec = parse_backend(text)
                static.append(spec)
                regions.append(spec.region)
        return cls(tuple(static), tuple(dns), tuple(regions))
