"""Backend credentials: the API key each engine wants (vLLM's ``--api-key``), read once at
startup and sent as the upstream ``authorization`` of every request released to it.

Keys are configured by reference only, per backend (``--backend URL#key=env:NAME``) or per
region (``--region-key REGION=file:PATH``; a backend's own key wins), and held only in this
process's memory: never in a configuration file, a log line or a metric. The service injects
them, not Envoy: the backends are one Envoy cluster routed by ``override_host``, and Envoy
adds request headers per route or per cluster, not per host (per-host metadata would put the
keys in Envoy's config and its ``/config_dump``); the service knows which endpoint it picked,
and already removes the client's ``authorization``. Envoy replays the same headers on every
retry or hedge, so a request's alternates are only backends that take the first one's key
(``BackendCredentials.apply``): with a key per region, retries stay in the region.
Backends found through DNS take their name's key, or their region's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from extproc.core.decisions import Forward
from extproc.fleet.backend import BackendSpec, is_secret_reference
from extproc.fleet.discovery import DnsBackendSpec
from extproc.wire import HEDGE_ON_TIMEOUT_HEADER, MAX_RETRIES_HEADER, PER_TRY_TIMEOUT_HEADER

log = logging.getLogger("fairlane.credentials")

AUTHORIZATION = "authorization"
REGION_KEY_SYNTAX = "REGION=env:NAME|file:PATH"
"""How a region's key is written on the command line (``--region-key``)."""


class CredentialError(ValueError):
    """A key reference that cannot be read; the message names the reference, never a key."""


def read_secret(reference: str) -> str:
    """The secret ``reference`` (``env:NAME`` or ``file:PATH``) points at, read now.

    Raises :class:`CredentialError` when it is malformed, missing or empty: an engine that
    wants a key must not be sent requests without one.
    """
    if not is_secret_reference(reference):
        raise CredentialError(f"{reference!r} is not env:NAME or file:PATH")
    kind, _, where = reference.partition(":")
    where = where.strip()
    if kind == "env":
        value = os.environ.get(where)
        if value is None:
            raise CredentialError(f"{reference}: environment variable {where} is not set")
    else:
        try:
            value = Path(where).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc)
            raise CredentialError(f"{reference}: cannot read {where} ({reason})") from None
    value = value.strip()
    if not value:
        raise CredentialError(f"{reference} is empty")
    if any(ch in value for ch in "\r\n\0"):
        raise CredentialError(f"{reference}: the key spans several lines")
    return value


def parse_region_key(text: str) -> tuple[str, str]:
    """``REGION=env:NAME|file:PATH`` -> (region, reference)."""
    region, sep, reference = text.partition("=")
    region, reference = region.strip(), reference.strip()
    if not sep or not region or not is_secret_reference(reference):
        raise CredentialError(f"region key {text!r}: expected {REGION_KEY_SYNTAX}")
    return region, reference


class BackendCredentials:
    """Which ``authorization`` each backend gets, and the forwarding rule that keeps a
    request's retries on backends that take the same key.

    **Retries and hedges.** Envoy replays the same request headers on every attempt, to the
    alternates the service listed in ``x-gateway-destination-endpoint``. A request can carry
    only one key, so ``apply`` keeps only the alternates that take the first endpoint's key and
    lowers ``x-envoy-max-retries`` to match (Envoy's fallback load balancer, which picks any
    host once the list runs out, is never reached). With one key for the whole fleet nothing
    changes; with a key per region, retries and hedges stay inside the first endpoint's region.
    Give the regions the same key to keep cross-region failover.

    **Backends found through DNS** (``dns://NAME:PORT#key=...``) take their name's key, or their
    region's: the key is read at startup like the others (an unreadable one stops the service
    before it serves), and each address the name resolves to gets it when it joins (``add``) and
    loses it when it leaves (``forget``).

    ``file:PATH`` keys are read with surrounding whitespace dropped, as a Kubernetes or compose
    secret file ends with a newline.
    """

    __slots__ = ("_by_address", "_by_reference", "_by_region", "_uniform")

    def __init__(self, header_by_address: Mapping[str, str | None]) -> None:
        self._by_address = dict(header_by_address)
        self._by_reference: dict[str, str] = {}
        """Each key reference read, as its ``authorization`` value (for members to come)."""
        self._by_region: dict[str, str] = {}
        self._uniform = len(set(self._by_address.values())) <= 1
        """Every backend takes the same key: no alternate ever needs dropping."""

    def __repr__(self) -> str:  # never the keys
        return f"BackendCredentials({len(self._by_address)} backends, uniform={self._uniform})"

    @classmethod
    def load(
        cls,
        backends: Sequence[BackendSpec],
        region_keys: Iterable[tuple[str, str]] = (),
        dynamic: Sequence[DnsBackendSpec] = (),
    ) -> BackendCredentials | None:
        """Read every configured key now; None when no backend wants one (nothing to do
        per request). Raises :class:`CredentialError` for a key that cannot be read or a
        region key naming no backend's region. ``dynamic``: the DNS names whose addresses
        will join (``add``), their keys read now too."""
        by_region = dict(region_keys)
        regions = {b.region for b in backends} | {d.region for d in dynamic}
        unknown = sorted(set(by_region) - regions)
        if unknown:
            raise CredentialError(f"--region-key for {', '.join(unknown)}: no backend there")
        references = {b.address: b.credential or by_region.get(b.region) for b in backends}
        later = sorted({ref for d in dynamic if (ref := d.credential or by_region.get(d.region))})
        if not any(references.values()) and not later:
            return None
        read: dict[str, str] = {}  # one read per reference
        for name_reference in later:
            read[name_reference] = f"Bearer {read_secret(name_reference)}"
        headers: dict[str, str | None] = {}
        for address, reference in references.items():
            if reference is None:
                headers[address] = None
                continue
            if reference not in read:
                read[reference] = f"Bearer {read_secret(reference)}"
            headers[address] = read[reference]
        credentials = cls(headers)
        credentials._by_reference = read
        credentials._by_region = {r: ref for r, ref in by_region.items() if r in regions}
        for backend in backends:
            log.info(
                "backend %s %s: authorization from %s",
                backend.region,
                backend.address,
                references[backend.address] or "nowhere (the engine wants no key)",
            )
        if not credentials._uniform:
            log.info(
                "backends take different keys: a request's retries and hedges go only to "
                "alternates that take its first endpoint's key"
            )
        return credentials

    def add(self, spec: BackendSpec) -> None:
        """A backend joined (from DNS): it takes its own key, or its region's (read at
        startup, ``load``)."""
        reference = spec.credential or self._by_region.get(spec.region)
        header = None if reference is None else self._by_reference.get(reference)
        if reference is not None and header is None:  # not read at startup: read it now
            header = self._by_reference[reference] = f"Bearer {read_secret(reference)}"
        self._by_address[spec.address] = header
        self._uniform = len(set(self._by_address.values())) <= 1

    def forget(self, address: str) -> None:
        """A backend left the fleet."""
        self._by_address.pop(address, None)
        self._uniform = len(set(self._by_address.values())) <= 1

    def header_for(self, address: str) -> str | None:
        """The ``authorization`` value ``address`` gets (None: none)."""
        return self._by_address.get(address)

    def apply(self, forward: Forward) -> Forward:
        """``forward`` with its first endpoint's key as ``authorization`` and only the
        alternates that take the same key (``x-envoy-max-retries`` and hedging to match)."""
        endpoints = forward.endpoints
        if not endpoints:
            return forward
        by_address = self._by_address
        header = by_address.get(endpoints[0])
        set_headers = dict(forward.set_headers)
        remove = forward.remove_headers
        if header is not None:
            set_headers[AUTHORIZATION] = header
            # The client's copy is in the strip list: one mutation must not set and remove.
            remove = tuple(name for name in remove if name != AUTHORIZATION)
        if not self._uniform:
            endpoints = tuple(e for e in endpoints if by_address.get(e) == header)
            retries = len(endpoints) - 1
            # Also when the gateway left retries to the route: past the listed endpoints,
            # Envoy's fallback load balancer could pick a backend with another key.
            set_headers[MAX_RETRIES_HEADER] = str(retries)
            if retries == 0:
                set_headers.pop(PER_TRY_TIMEOUT_HEADER, None)
                set_headers.pop(HEDGE_ON_TIMEOUT_HEADER, None)
        return dataclasses.replace(
            forward, endpoints=endpoints, set_headers=set_headers, remove_headers=remove
        )
