"""The backends' host set the service serves to Envoy (EDS): one truth about the fleet.

With ``dns://`` backends the fleet changes while both run, and Envoy's ``override_host``
only routes to an ``ip:port`` its backends' cluster holds. So the service, which resolves
the names and follows the members (``extproc.fleet.membership``), also tells Envoy the set,
over the Endpoint Discovery Service on its gRPC port (``servicer.EndpointDiscovery``): the
cluster holds exactly the pool's backends, warming and draining ones included (a draining
backend's requests in flight still go through Envoy's host; it leaves Envoy's set when it
leaves the pool). Regions are priority levels, in the order first configured, as in the
static cluster; a region with no backend at the moment is an empty level, so the levels
keep their numbers.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from extproc.fleet.backend import BackendPool
from extproc.wire import BACKEND_CLUSTER


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One host of the backends' cluster."""

    host: str
    port: int
    weight: int


@dataclass(frozen=True, slots=True)
class Level:
    """One region: its Envoy priority and its hosts."""

    region: str
    priority: int
    endpoints: tuple[Endpoint, ...]


def levels_of(pool: BackendPool) -> tuple[Level, ...]:
    """The pool as Envoy's priority levels: every configured region, in order."""
    return tuple(
        Level(
            region,
            priority,
            tuple(
                Endpoint(b.spec.host, b.spec.port, b.spec.weight)
                for b in pool.backends
                if b.region == region
            ),
        )
        for priority, region in enumerate(pool.regions)
    )


class EndpointSet:
    """The host set as last published, with a version that changes whenever it does."""

    def __init__(self, cluster: str = BACKEND_CLUSTER) -> None:
        self.cluster = cluster
        self.version = 0
        self.levels: tuple[Level, ...] = ()
        self._changed = asyncio.Event()

    def publish(self, levels: tuple[Level, ...]) -> bool:
        """Make ``levels`` the set; subscribed Envoys get it only when it changed (True)."""
        if levels == self.levels and self.version:
            return False
        self.levels = levels
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return True

    async def changed_since(self, version: int) -> None:
        """Return once the set's version differs from ``version``."""
        while self.version == version:
            await self._changed.wait()
