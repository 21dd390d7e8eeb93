"""The fleet's DNS: resolving ``dns://`` backends again and again, and sweeping drained ones.

Each name is resolved (A and AAAA, at once) when its last answer's TTL runs out, between
``MIN_INTERVAL_S`` and ``max_interval_s`` (a TTL of 0 must not become a busy loop, nor a TTL
of an hour hide a scale-down for an hour), or every ``interval_s`` when one is given. The
answers go to ``extproc.fleet.membership.Membership``, which turns them into joins and
drains; ``on_change`` then lets the server tell Envoy (EDS) and release what removed
backends held. A timeout, no server answering and NXDOMAIN (a Service deleted by mistake, or a
typo, must not drain a working fleet at once) are failures that keep the last known set; a
name that exists with no address (a headless Service scaled to zero) is an empty set. The
system's resolver configuration is used (search domains too, so ``vllm`` finds the Service in
a pod) unless ``--dns-server`` names one; dnspython's cache is off, since the TTL is honoured
by resolving when it runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
from collections.abc import Callable
from pathlib import Path

import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver

from extproc.fleet.discovery import DnsBackendSpec
from extproc.fleet.membership import Changes, Membership

log = logging.getLogger("fairlane.fleet")

MIN_INTERVAL_S = 0.5
"""The shortest time between two resolutions of one name, whatever its TTL."""
DEFAULT_MAX_INTERVAL_S = 5.0
"""The longest time between two resolutions of one name, whatever its TTL: how long a new
engine may stay unknown (Kubernetes' CoreDNS answers with a TTL of 5 s)."""
LOOKUP_TIMEOUT_S = 2.0
"""How long one resolution may take (every server, every retry) before it fails."""
SWEEP_INTERVAL_S = 0.1
"""How often draining backends are checked for their last request in flight."""
NAMESERVER_SYNTAX = "IP[:PORT]"


class DnsError(Exception):
    """A resolution that failed: the last known set stays."""


def parse_nameserver(text: str) -> tuple[str, int]:
    """``IP[:PORT]`` (``[IPv6]:PORT`` for IPv6 with a port) -> (ip, port); port 53 by
    default. ``ValueError`` with the expected syntax otherwise."""
    host, port = text.strip(), 53
    if host.startswith("["):
        inside, _, rest = host[1:].partition("]")
        host = inside
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise ValueError(f"dns server {text!r}: expected {NAMESERVER_SYNTAX}")
            port = int(rest[1:])
    elif host.count(":") == 1:
        host, _, port_text = host.partition(":")
        if not port_text.isdigit():
            raise ValueError(f"dns server {text!r}: expected {NAMESERVER_SYNTAX}")
        port = int(port_text)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"dns server {text!r}: expected {NAMESERVER_SYNTAX} with an IP address"
        ) from None
    if not 1 <= port <= 65535:
        raise ValueError(f"dns server {text!r}: expected {NAMESERVER_SYNTAX}, a port in [1, 65535]")
    return host, port


HOSTS_FILE = Path("/etc/hosts")


def hosts_addresses(text: str, name: str) -> frozenset[str]:
    """``name``'s addresses in a hosts file (``IP NAME [ALIAS...]`` lines, ``#`` comments),
    as the system's resolver (getaddrinfo) finds them before asking DNS."""
    wanted = name.rstrip(".").lower()
    found = set()
    for line in text.splitlines():
        fields = line.partition("#")[0].split()
        if len(fields) >= 2 and wanted in (field.lower() for field in fields[1:]):
            with contextlib.suppress(ValueError):
                found.add(str(ipaddress.ip_address(fields[0])))
    return frozenset(found)


class DnsLookup:
    """A name's addresses and their TTL, from the system's resolvers or ``nameserver``.

    With the system's resolvers, the hosts file is read first, as getaddrinfo does: a name
    only it knows (``localhost`` where the DNS server answers NXDOMAIN for it) resolves
    too, with no TTL (resolved again at the longest interval)."""

    def __init__(
        self,
        nameserver: tuple[str, int] | None = None,
        timeout_s: float = LOOKUP_TIMEOUT_S,
        hosts_file: Path | None = HOSTS_FILE,
    ) -> None:
        self._hosts_file = hosts_file if nameserver is None else None
        if nameserver is None:
            try:
                resolver = dns.asyncresolver.Resolver()
            except dns.resolver.NoResolverConfiguration:
                raise DnsError(
                    "no DNS servers in /etc/resolv.conf; give one with --dns-server IP[:PORT]"
                ) from None
            resolver.use_search_by_default = True
        else:
            resolver = dns.asyncresolver.Resolver(configure=False)
            resolver.nameservers = [nameserver[0]]
            resolver.port = nameserver[1]
        resolver.cache = None
        resolver.lifetime = timeout_s
        self._resolver = resolver

    async def resolve(self, name: str) -> tuple[frozenset[str], float]:
        """Every A and AAAA address of ``name`` and the smaller TTL of the two answers
        (``DnsError`` when the lookup failed)."""
        if self._hosts_file is not None:
            with contextlib.suppress(OSError):
                known = hosts_addresses(self._hosts_file.read_text(errors="replace"), name)
                if known:
                    return known, math.inf  # no TTL: the longest interval
        answers = await asyncio.gather(
            self._query(name, dns.rdatatype.A),
            self._query(name, dns.rdatatype.AAAA),
            return_exceptions=True,
        )
        addresses: set[str] = set()
        ttls: list[float] = []
        errors: list[BaseException] = []
        for answer in answers:
            if isinstance(answer, BaseException):
                errors.append(answer)
                continue
            found, ttl = answer
            addresses |= found
            if ttl is not None:
                ttls.append(ttl)
        if errors and not addresses:
            raise DnsError(_reason(errors[0]))
        return frozenset(addresses), min(ttls, default=0.0)

    async def _query(
        self, name: str, rdtype: dns.rdatatype.RdataType
    ) -> tuple[frozenset[str], float | None]:
        answer = await self._resolver.resolve(name, rdtype, raise_on_no_answer=False)
        if answer.rrset is None:
            return frozenset(), None
        return frozenset(r.address for r in answer.rrset), float(answer.rrset.ttl)


def _reason(error: BaseException) -> str:
    if isinstance(error, dns.resolver.NXDOMAIN):
        return "no such name (NXDOMAIN)"
    if isinstance(error, dns.exception.Timeout):
        return "no answer in time"
    if isinstance(error, dns.resolver.NoNameservers):
        return "no DNS server answered (SERVFAIL, REFUSED or unreachable)"
    if isinstance(error, DnsError):
        return str(error)
    return str(error) or type(error).__name__


def next_interval(ttl_s: float, interval_s: float | None, max_interval_s: float) -> float:
    """When to resolve a name again: ``interval_s`` if given, else its TTL, within
    [``MIN_INTERVAL_S``, ``max_interval_s``]."""
    if interval_s is not None:
        return max(MIN_INTERVAL_S, interval_s)
    return min(max_interval_s, max(MIN_INTERVAL_S, ttl_s))


class DnsWatcher:
    """Resolves every ``dns://`` backend on its schedule and sweeps drained backends."""

    def __init__(
        self,
        membership: Membership,
        lookup: DnsLookup,
        on_change: Callable[[Changes], None],
        clock: Callable[[], float],
        interval_s: float | None = None,
        max_interval_s: float = DEFAULT_MAX_INTERVAL_S,
    ) -> None:
        self.membership = membership
        self.lookup = lookup
        self.on_change = on_change
        self.clock = clock
        self.interval_s = interval_s
        self.max_interval_s = max(MIN_INTERVAL_S, max_interval_s)
        self._delays: dict[DnsBackendSpec, float] = {}

    async def refresh(self, source: DnsBackendSpec) -> float:
        """Resolve ``source`` once and apply the answer; the seconds until the next time."""
        delay = self._delays[source] = await self._resolve(source)
        return delay

    async def _resolve(self, source: DnsBackendSpec) -> float:
        try:
            addresses, ttl = await self.lookup.resolve(source.name)
        except DnsError as exc:
            self.membership.failed(source, str(exc))
            return next_interval(0.0, self.interval_s, self.max_interval_s)
        except (dns.exception.DNSException, OSError, ValueError) as exc:
            self.membership.failed(source, _reason(exc))
            return next_interval(0.0, self.interval_s, self.max_interval_s)
        changes = self.membership.update(source, addresses, self.clock())
        if changes:
            self.on_change(changes)
        return next_interval(ttl, self.interval_s, self.max_interval_s)

    async def refresh_all(self) -> None:
        """Resolve every name once, at once (the service's start)."""
        await asyncio.gather(*(self.refresh(s) for s in self.membership.sources))

    async def run(self) -> None:
        """Resolve each name forever on its own schedule, and sweep; cancel to stop."""
        tasks = [asyncio.create_task(self._follow(s)) for s in self.membership.sources]
        try:
            while True:
                changes = self.membership.sweep(self.clock())
                if changes:
                    self.on_change(changes)
                for task in tasks:
                    if task.done():
                        task.result()  # a bug in a name's loop ends the service's loop
                await asyncio.sleep(SWEEP_INTERVAL_S)
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, source: DnsBackendSpec) -> None:
        delay = self._delays.get(source, 0.0)  # after ``refresh_all``: the first answer's TTL
        while True:
            await asyncio.sleep(delay)
            delay = await self.refresh(source)
