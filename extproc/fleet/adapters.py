"""Loading a policy's runtime LoRA adapters onto engines, through vLLM's own route.

An engine started with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` loads
an adapter on ``POST /v1/load_lora_adapter``. When the picker sends a request for an adapter
of ``models.adapters`` to an engine that does not list it yet, the transport awaits this
load first. One load per engine and adapter runs at a time; the requests that arrive
meanwhile wait for it. A success adds the adapter to what the engine serves at once (its
``/v1/models`` says so at the next read). A failure leaves the engine out of loads for
``RETRY_AFTER_S``: LoRA or runtime updating may be off there, or the path wrong.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from extproc.fleet.backend import Backend, BackendPool
from extproc.fleet.models import with_adapter

log = logging.getLogger("fairlane.adapters")

LOAD_PATH = "/v1/load_lora_adapter"
TIMEOUT_S = 60.0
"""A load reads the adapter's weights from disk (or a resolver): seconds, not minutes."""
RETRY_AFTER_S = 60.0
"""How long an engine whose load failed is left out of loads."""
ALREADY_LOADED = "has already been loaded"
"""vLLM's 400 for a name it holds (loaded by another gateway replica, say): a success."""


class AdapterLoader:
    """Runs the loads the gateway's forwards ask for (``extproc.core.decisions.AdapterLoad``)."""

    def __init__(
        self,
        pool: BackendPool,
        authorization: Callable[[Backend], str | None] = lambda backend: None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.pool = pool
        self.authorization = authorization
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._loading: dict[tuple[str, str], asyncio.Future[str | None]] = {}

    async def load(self, address: str, name: str, base: str, path: str) -> str | None:
        """Load adapter ``name`` (of ``base``, from ``path``) onto the engine at ``address``;
        None once it is there, else why not."""
        key = (address, name)
        running = self._loading.get(key)
        if running is None:
            running = asyncio.ensure_future(self._load(address, name, base, path))
            self._loading[key] = running
            running.add_done_callback(lambda _: self._loading.pop(key, None))
        return await asyncio.shield(running)

    async def _load(self, address: str, name: str, base: str, path: str) -> str | None:
        backend = self.pool.by_address.get(address)
        if backend is None:
            return "the engine left the fleet"
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        headers = {}
        if (authorization := self.authorization(backend)) is not None:
            headers["authorization"] = authorization
        body = {"lora_name": name, "lora_path": path}
        try:
            url = f"{backend.spec.url}{LOAD_PATH}"
            async with self._session.post(url, json=body, headers=headers) as response:
                text = (await response.text())[:300]
                ok = response.status == 200 or (response.status == 400 and ALREADY_LOADED in text)
                reason = None if ok else f"HTTP {response.status}: {text.strip()}"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            reason = str(exc)[:200] or type(exc).__name__
        if reason is not None:
            backend.no_loads_until = self.pool.clock() + RETRY_AFTER_S
            log.warning(
                "backend %s: could not load adapter %s from %s (%s); no loads there for %gs",
                address,
                name,
                path,
                reason,
                RETRY_AFTER_S,
            )
            return reason
        if backend.models is not None:
            self.pool.set_models(backend, with_adapter(backend.models, name, base))
        log.info("backend %s: loaded adapter %s (on %s)", address, name, base)
        return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
