"""The runtime layer the service serves to Envoy (RTDS): values Envoy reads per request.

The service is the only one that knows when it is overloaded, and Envoy is the only place
where turning a request away costs the service nothing. So the service serves one runtime
layer over Envoy's Runtime Discovery Service, on its gRPC port
(``servicer.RuntimeDiscovery``), and every Envoy subscribed to it (the bootstrap's
``layered_runtime``) sees a new value within milliseconds of its publication here. Today
the layer holds one value: the share of new requests the overload routes turn away
(``extproc.wire.SHED_RUNTIME_KEY``).
"""

from __future__ import annotations

import asyncio

from extproc.wire import RUNTIME_LAYER


class RuntimeLayer:
    """The layer's current values, with a version that changes whenever they do."""

    def __init__(self, name: str = RUNTIME_LAYER) -> None:
        self.name = name
        self.version = 0
        self._values: dict[str, float] = {}
        self._changed = asyncio.Event()

    @property
    def values(self) -> dict[str, float]:
        return dict(self._values)

    def publish(self, key: str, value: float) -> None:
        """Set ``key``; subscribed Envoys get the new layer only when a value changed."""
        if self._values.get(key) == value:
            return
        self._values[key] = value
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def changed_since(self, version: int) -> None:
        """Return once the layer's version differs from ``version``."""
        while self.version == version:
            await self._changed.wait()
