"""The backend pool: which vLLM servers exist, whether they are healthy, what they carry.

The pool is the gateway's own view of the fleet. Health comes from polling each backend's
``/health``; load is the gateway's count of requests it released to each backend and has
not yet seen finish (completion events from Envoy's access log release them).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

log = logging.getLogger("fairlane.backends")

DEFAULT_REGION = "default"


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """A backend as configured: ``[REGION=]http://IP:PORT``.

    ``host`` must be an IP address: Envoy's override_host matches the service's ``ip:port``
    strings against the cluster's host addresses, so a DNS name would never match.
    """

    host: str
    port: int
    region: str = DEFAULT_REGION

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise ValueError(
                f"backend host {self.host!r} must be an IP address (override_host matches "
                "'ip:port' strings against cluster hosts)"
            ) from None
        if not 1 <= self.port <= 65535:
            raise ValueError(f"backend port must be in [1, 65535], got {self.port}")
        if not self.region:
            raise ValueError("backend region must not be empty")

    @property
    def address(self) -> str:
        """``ip:port`` as Envoy prints it (IPv6 in brackets)."""
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


def parse_backend(text: str) -> BackendSpec:
    """Parse ``[REGION=]URL``; the host must be an IP address (Envoy routes by ``ip:port``)."""
    region, sep, url = text.partition("=")
    if not sep:
        region, url = DEFAULT_REGION, text
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise ValueError(f"backend {text!r}: expected [REGION=]http://IP:PORT")
    try:
        return BackendSpec(parts.hostname, parts.port, region.strip() or DEFAULT_REGION)
    except ValueError as exc:
        raise ValueError(f"backend {text!r}: {exc}") from None


class Backend:
    """One backend's live state, as the gateway sees it."""

    __slots__ = ("healthy", "in_flight", "spec")

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.healthy = True
        self.in_flight = 0

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def region(self) -> str:
        return self.spec.region

    def __repr__(self) -> str:
        state = "up" if self.healthy else "down"
        return f"<Backend {self.address} {self.region} {state} in_flight={self.in_flight}>"


class BackendPool:
    """All backends, in configured order (the first region named is the local one)."""

    def __init__(self, specs: Sequence[BackendSpec]) -> None:
        if not specs:
            raise ValueError("at least one backend is needed")
        self.backends = [Backend(spec) for spec in specs]
        self.by_address = {b.address: b for b in self.backends}
        self.regions = list(dict.fromkeys(b.region for b in self.backends))
        self._listeners: list[Callable[[], None]] = []

    def on_capacity(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever a backend may have gained room (release, recovery)."""
        self._listeners.append(callback)

    def capacity_changed(self) -> None:
        for callback in self._listeners:
            callback()

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    async def watch_health(self, interval_s: float = 1.0, timeout_s: float = 1.0) -> None:
        """Poll every backend's ``/health`` forever; a failed poll marks it down."""
        client_timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=client_timeout) as session:
            while True:
                results = await asyncio.gather(*(self._probe(session, b) for b in self.backends))
                gained = False
                for backend, ok in zip(self.backends, results, strict=True):
                    if ok != backend.healthy:
                        log.warning("backend %s is now %s", backend.address, "up" if ok else "down")
                        gained = gained or ok
                        backend.healthy = ok
                if gained:
                    self.capacity_changed()
                await asyncio.sleep(interval_s)

    @staticmethod
    async def _probe(session: aiohttp.ClientSession, backend: Backend) -> bool:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            async with session.get(f"{backend.spec.url}/health") as response:
                return response.status == 200
        return False
