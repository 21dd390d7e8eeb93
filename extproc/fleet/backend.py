"""The backend pool: which vLLM servers exist, whether they are healthy, what they carry.

The pool is the gateway's own view of the fleet, without any I/O: ``extproc.fleet.poller``
polls each backend's ``/health`` and vLLM ``/metrics`` and records what it saw here. Load is
the gateway's count of requests it released to each backend and has not yet seen finish, plus
the engine's own numbers (waiting, running, KV-cache use, inter-token latency) for the
admission gates. A backend is usable (``healthy``) only while its ``/health`` answers and its
last scrape succeeded (an engine whose metrics cannot be read cannot be gated), each loop
with its own flag so neither flips the other's verdict; and a backend whose completions keep
failing is set aside for ``COOL_OFF_S`` (the gateway's counterpart of Envoy's outlier
ejection, since ``/health`` can answer while requests fail). Each backend also carries the
picker's model of its prefix cache (``extproc.fleet.prefix_cache``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol
from urllib.parse import urlsplit

from extproc.fleet.kv_events import KVBlockIndex
from extproc.fleet.models import (
    MAX_NAME_CHARS,
    NOTHING_LOADABLE,
    Loadable,
    ServedModels,
    may_serve,
    several_models,
)
from extproc.fleet.prefix_cache import DEFAULT_BLOCK_SIZE, DEFAULT_CAPACITY_BLOCKS, PrefixLRU
from extproc.fleet.seats import Seats, restarted
from extproc.fleet.shared_scrape import SharedScrape
from extproc.fleet.vllm_metrics import OPTIONAL, EngineMetrics, interval_itl

log = logging.getLogger("fairlane.backends")

DEFAULT_REGION = "default"
FAILURES_TO_COOL_OFF = 3
"""Failed completions in a row after which a backend is set aside."""
SEATS_PER_FILL = 16
"""A tier that waits for an empty engine queue (batch) fills free seats one grant per this
many seats between scrapes (``Backend.fill_per_scrape``)."""
COOL_OFF_S = 10.0
"""How long a backend whose completions kept failing is left out of picks."""
Membership = Literal["serving", "warming", "draining"]
"""Where a backend stands in a fleet that changes (``extproc.fleet.membership``): a new
address is ``warming`` (scraped, no traffic) until its first good scrape; one that left the
fleet is ``draining`` (no new requests) until its requests in flight finish."""
MARKS_KEPT = 128
"""Marks of the grant and completion totals a backend keeps (``Backend.mark``): at one per
20 ms exchange, 2.5 s of history, far more than a shared scrape's age."""

Mark = tuple[float, int, int, int, int, int]
"""(when, granted_total, completed_total, kv_tokens_total, peer_in_flight,
peer_kv_tokens_total): a backend's totals at one moment (``Backend.mark``)."""


def check_endpoint_fields(
    port: int, region: str, weight: int, seats: int | None, credential: str | None
) -> None:
    """What a static backend and a ``dns://`` one must both get right: ``ValueError``
    naming the field otherwise."""
    if not 1 <= port <= 65535:
        raise ValueError(f"backend port must be in [1, 65535], got {port}")
    if not region:
        raise ValueError("backend region must not be empty")
    if weight < 1:
        raise ValueError(f"backend weight must be >= 1, got {weight}")
    if seats is not None and seats < 1:
        raise ValueError(f"backend seats must be >= 1, got {seats}")
    if credential is not None and not is_secret_reference(credential):
        raise ValueError(
            "backend key must be env:NAME or file:PATH (where the key is read from, never "
            "the key itself)"
        )


@dataclass(frozen=True, slots=True)
class KVEventPorts:
    """Where an engine publishes its KV events (``--kv-events-config``), on its own host:
    the PUB socket's port, and the replay ROUTER's when it has one."""

    port: int
    replay_port: int | None = None

    def __post_init__(self) -> None:
        for port in (self.port, self.replay_port):
            if port is not None and not 1 <= port <= 65535:
                raise ValueError(f"KV events port must be in [1, 65535], got {port}")

    def engine_config(self) -> str:
        """The engine's ``--kv-events-config`` publishing on these ports (vLLM's PUB and
        replay ROUTER bind when the endpoint names ``*``; the gateway connects to them)."""
        config: dict[str, object] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.port}",
            "topic": "",
        }
        if self.replay_port is not None:
            config["replay_endpoint"] = f"tcp://*:{self.replay_port}"
        return json.dumps(config)


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """What may follow a backend's ``#``: ``seats=N``, ``key=REF``, ``kv-events=PORT``,
    ``kv-replay=PORT`` (each optional, in any order)."""

    seats: int | None = None
    credential: str | None = None
    kv_events: KVEventPorts | None = None
    models: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """A backend as configured: ``[REGION=]http://IP:PORT[#seats=N]`` on the command line
    (``parse_backend``), or ``{url, region, weight, seats}`` in the deployment file.

    ``host`` must be an IP address: Envoy's override_host matches the service's ``ip:port``
    strings against the cluster's host addresses, so a DNS name would never match.

    ``seats`` is optional because vLLM does not export its ``--max-num-seqs``: without it the
    gateway learns the count from the engine's scrapes (``extproc.fleet.seats``), which takes a
    moment of load that queues in the engine. Declare it when the engine's flags are known
    (or it never queues while KV has room, so nothing can be learned); a declared count
    wins over anything observed, so it must be right.

    ``credential`` is where the engine's API key lives (``env:NAME`` or ``file:PATH``, never
    the key itself): the service reads it once at startup and sends it as the upstream
    ``authorization`` (``extproc.transport.credentials``).
    """

    host: str
    port: int
    region: str = DEFAULT_REGION
    weight: int = 1
    """Envoy's load-balancing weight for this endpoint (used when Envoy picks, e.g. on a
    retry after the listed endpoints ran out)."""
    seats: int | None = None
    """Requests the engine runs at once (its ``--max-num-seqs``), when the deployment says;
    otherwise learned from its scrapes (``extproc.fleet.seats``)."""
    credential: str | None = None
    """``env:NAME`` or ``file:PATH``: where the engine's ``--api-key`` is read from (None:
    the engine wants none)."""
    kv_events: KVEventPorts | None = None
    """Where the engine publishes its KV events (None: it does not, or they are not used;
    prefix affinity is then approximate for it)."""
    models: tuple[str, ...] = ()
    """The model names the engine serves, as the deployment declares them: what requests
    are routed by until its ``/v1/models`` is read (which then wins), and while it cannot be
    read. Empty: only what the engine says."""

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise ValueError(
                f"backend host {self.host!r} must be an IP address (override_host matches "
                "'ip:port' strings against cluster hosts)"
            ) from None
        check_endpoint_fields(self.port, self.region, self.weight, self.seats, self.credential)

    @property
    def address(self) -> str:
        """``ip:port`` as Envoy prints it (IPv6 in brackets)."""
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


BACKEND_SYNTAX = (
    "[REGION=]http://IP:PORT[#seats=N][,key=env:NAME|file:PATH][,kv-events=PORT[,kv-replay=PORT]]"
    "[,models=NAME|NAME...]"
)
"""How a backend is written on the command line (``--backend``)."""

SECRET_PREFIXES = ("env:", "file:")
"""How a secret is referred to: ``env:NAME`` (an environment variable) or ``file:PATH``."""


def is_secret_reference(text: str) -> bool:
    """Whether ``text`` names where a secret lives (``env:NAME``, ``file:PATH``) rather than
    being one: configuration files and command lines must not carry keys."""
    prefix, sep, rest = text.partition(":")
    return bool(sep) and f"{prefix}:" in SECRET_PREFIXES and bool(rest.strip())


def parse_backend(text: str) -> BackendSpec:
    """Parse ``[REGION=]http://IP:PORT[#seats=N][,key=env:NAME|file:PATH]``; the host must be
    an IP address (Envoy routes by ``ip:port``).

    ``#seats=N`` declares how many requests the engine runs at once (its ``--max-num-seqs``);
    without it the count is learned from the engine. ``key=`` says where the engine's API key
    is read from (``env:NAME``, ``file:PATH``). The options are a URL fragment, so they can
    never be mistaken for part of the address, and are split off before the region's ``=``.
    """
    region, url, options = split_backend_argument(text)
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # a port that is not a number, or out of range
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None:
        raise ValueError(f"backend {text!r}: expected {BACKEND_SYNTAX}")
    try:
        return BackendSpec(
            parts.hostname,
            port,
            region.strip() or DEFAULT_REGION,
            seats=options.seats,
            credential=options.credential,
            kv_events=options.kv_events,
            models=options.models,
        )
    except ValueError as exc:
        raise ValueError(f"backend {text!r}: {exc}") from None


class ConfiguredBackend(Protocol):
    """What a ``--backend`` value says: a fixed backend (``BackendSpec``) or a DNS name
    (``extproc.fleet.discovery.DnsBackendSpec``)."""

    @property
    def region(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def seats(self) -> int | None: ...
    @property
    def credential(self) -> str | None: ...
    @property
    def kv_events(self) -> KVEventPorts | None: ...
    @property
    def models(self) -> tuple[str, ...]: ...


def backend_argument(spec: ConfiguredBackend) -> str:
    """``spec`` as ``--backend`` takes it (``parse_backend`` or ``parse_dns_backend`` reads
    it back unchanged), so ``fairlane up`` and the rendered Kubernetes workload hand the
    service its backends with their declared seats and key references."""
    options = []
    if spec.seats is not None:
        options.append(f"seats={spec.seats}")
    if spec.credential is not None:
        options.append(f"key={spec.credential}")
    if spec.kv_events is not None:
        options.append(f"kv-events={spec.kv_events.port}")
        if spec.kv_events.replay_port is not None:
            options.append(f"kv-replay={spec.kv_events.replay_port}")
    if spec.models:
        options.append(f"models={'|'.join(spec.models)}")
    fragment = f"#{','.join(options)}" if options else ""
    return f"{spec.region}={spec.url}{fragment}"


def split_backend_argument(text: str) -> tuple[str, str, BackendOptions]:
    """A ``--backend`` value's parts, URL unchecked: (region as written, or the default one
    when none is; URL; the options after ``#``)."""
    address, hash_sign, options = text.partition("#")
    parsed = _backend_options(text, options) if hash_sign else BackendOptions()
    region, sep, url = address.partition("=")
    if not sep:
        region, url = DEFAULT_REGION, address
    return region, url, parsed


def _backend_options(text: str, options: str) -> BackendOptions:
    """The options of a backend's ``#seats=N,key=REF,kv-events=PORT,kv-replay=PORT``."""
    seats: int | None = None
    credential: str | None = None
    kv_port: int | None = None
    replay_port: int | None = None
    models: tuple[str, ...] = ()
    for option in options.split(","):
        key, sep, value = option.partition("=")
        name = key.strip()
        if name == "seats" and sep:
            seats = _seats_option(text, value)
        elif name in ("kv-events", "kv-replay") and sep:
            port = _port_option(text, name, value)
            kv_port, replay_port = (port, replay_port) if name == "kv-events" else (kv_port, port)
        elif name == "models" and sep:
            models = tuple(m.strip() for m in value.split("|"))
            if not all(models) or any(len(m) > MAX_NAME_CHARS for m in models):
                raise ValueError(
                    f"backend {text!r}: models must be names separated by '|' (at most "
                    f"{MAX_NAME_CHARS} characters each)"
                )
        elif name == "key" and sep:
            credential = value.strip()
            if not is_secret_reference(credential):
                raise ValueError(
                    f"backend {text!r}: key must be env:NAME or file:PATH (where the engine's "
                    "API key is read from, never the key itself)"
                )
        else:
            raise ValueError(
                f"backend {text!r}: unknown option {option!r} after '#' (expected seats=N, the "
                "requests the engine runs at once, key=env:NAME|file:PATH, "
                "kv-events=PORT and kv-replay=PORT, where it publishes its KV events, or "
                "models=NAME|NAME, what it serves)"
            )
    if replay_port is not None and kv_port is None:
        raise ValueError(f"backend {text!r}: kv-replay needs kv-events (the stream it replays)")
    kv_events = KVEventPorts(kv_port, replay_port) if kv_port is not None else None
    return BackendOptions(seats, credential, kv_events, models)


def _port_option(text: str, name: str, value: str) -> int:
    try:
        port = int(value.strip())
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise ValueError(f"backend {text!r}: {name} must be a port in [1, 65535], got {value!r}")
    return port


def _seats_option(text: str, value: str) -> int:
    try:
        seats = int(value.strip())
    except ValueError:
        raise ValueError(
            f"backend {text!r}: seats must be a whole number >= 1, got {value!r}"
        ) from None
    if seats < 1:
        raise ValueError(f"backend {text!r}: seats must be a whole number >= 1, got {seats}")
    return seats


class Backend:
    """One backend's live state, as the gateway sees it.

    ``healthy`` is what the picker reads: ``/health`` answered (``health_ok``) and the last
    ``/metrics`` scrape succeeded (``scrape_ok``). Assigning ``healthy`` sets ``health_ok``
    (the health poller's and the tests' way to mark a backend down or up); both flags start
    true so a pool that does not scrape behaves as before.

    ``metrics`` is the last good scrape (None until one succeeds); a failed scrape keeps it,
    so its ``scraped_at`` ages and the gates see it as stale. ``granted_since_scrape``
    counts grants the engine cannot have counted yet: they are added to its waiting queue
    (``effective_waiting``) so a burst between two scrapes cannot overfill it.

    ``healthy`` is also false while the backend cools off after failed completions
    (``note_outcome``); ``clock`` (the pool's) times the cool-off. ``prefix_cache`` holds
    the block hashes of what was sent here, in blocks of ``block_size`` tokens.

    When replicas share state, another replica may scrape this engine for the fleet
    (``extproc.fleet.shared_scrape``): ``scrape_here`` says whether this replica's poller
    scrapes it, and ``adopt_scrape`` records the other's scrape.
    """

    __slots__ = (
        "_clock",
        "_marks",
        "block_size",
        "completed_since_scrape",
        "completed_total",
        "cool_off_until",
        "failures",
        "granted_since_scrape",
        "granted_total",
        "health_ok",
        "in_flight",
        "in_flight_by_priority",
        "in_flight_by_rank",
        "itl_s",
        "kv_committed_tokens",
        "kv_index",
        "kv_tokens_since_scrape",
        "kv_tokens_total",
        "membership",
        "metrics",
        "models",
        "models_expected",
        "models_read_at",
        "no_loads_until",
        "peer_in_flight",
        "peer_in_flight_at_scrape",
        "peer_in_flight_by_rank",
        "peer_kv_tokens_at_scrape",
        "peer_kv_tokens_total",
        "prefix_cache",
        "scrape_error",
        "scrape_here",
        "scrape_ok",
        "seats",
        "spec",
        "timeouts",
    )

    def __init__(self, spec: BackendSpec, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.health_ok = True
        self.scrape_ok = True
        self.scrape_error: str | None = None  # why the last scrape failed (the poller's word)
        self.in_flight = 0
        self.in_flight_by_rank: Counter[int] = Counter()
        self.in_flight_by_priority: Counter[int] = Counter()
        """This replica's requests in flight here by the vLLM priority they were sent with
        (``waiting_ahead_of``); the others' are known by rank only."""
        self.peer_in_flight = 0
        self.peer_in_flight_by_rank: Counter[int] = Counter()
        # The others' requests in flight here when the last scrape was taken: what they
        # granted (or finished) since is the difference (``_since_scrape``).
        self.peer_in_flight_at_scrape = 0
        # The others' KV tokens sent here, a running total (``ReplicaReport.kv_tokens``), and
        # its value at the last scrape: the growth is KV the scrape could not show.
        self.peer_kv_tokens_total = 0
        self.peer_kv_tokens_at_scrape = 0
        self.metrics: EngineMetrics | None = None
        self.itl_s: float | None = None
        self.granted_since_scrape = 0
        self.completed_since_scrape = 0
        self.kv_tokens_since_scrape = 0
        # What this gateway's requests in flight here will hold once they have generated
        # their output (``final_kv_usage``).
        self.kv_committed_tokens = 0
        # Cumulative twins of the three counters above, and marks of them in time: what a
        # scrape taken elsewhere at some moment can have seen (``adopt_scrape``).
        self.granted_total = 0
        self.completed_total = 0
        self.kv_tokens_total = 0
        self._marks: deque[Mark] = deque(maxlen=MARKS_KEPT)
        self.scrape_here = True
        self.timeouts = 0
        self.failures = 0
        self.cool_off_until: float | None = None
        self.block_size = DEFAULT_BLOCK_SIZE
        self.prefix_cache = PrefixLRU(DEFAULT_CAPACITY_BLOCKS)
        # What the engine says it holds, from its KV events (``extproc.fleet.kv_subscriber``
        # fills it); None when it publishes none: ``prefix_cache`` models it instead.
        self.kv_index: KVBlockIndex | None = KVBlockIndex() if spec.kv_events else None
        self.seats = Seats(declared=spec.seats)
        self.models: ServedModels | None = (
            ServedModels(frozenset(spec.models)) if spec.models else None
        )
        """What the engine answers to: its ``/v1/models`` once read, the deployment's
        declared names until then; None when neither says: any model."""
        self.models_read_at = -math.inf
        self.models_expected = False
        """Joined a fleet whose models were known: no request until its own are read."""
        self.no_loads_until = -math.inf
        """Until then no runtime adapter is loaded here: its last load failed (LoRA or
        runtime updating off, a bad path); tried again after a while, as it may be fixed."""
        self.membership: Membership = "serving"
        self._clock = clock

    @property
    def healthy(self) -> bool:
        return (
            self.health_ok
            and self.scrape_ok
            and self.membership == "serving"
            and not self.cooling_off
        )

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self.health_ok = value

    @property
    def cooling_off(self) -> bool:
        """Set aside after failed completions, until ``cool_off_until``."""
        until = self.cool_off_until
        if until is None:
            return False
        if self._clock() < until:
            return True
        self.cool_off_until = None
        log.warning("backend %s cool-off over; picking it again", self.address)
        return False

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def region(self) -> str:
        return self.spec.region

    @property
    def fleet_in_flight(self) -> int:
        """Requests in flight here from this replica and, when replicas share state, from
        the others as of their last report (``peer_in_flight``, 0 when alone)."""
        return self.in_flight + self.peer_in_flight

    def note_peers(self, by_rank: Counter[int], kv_tokens_total: int = 0) -> None:
        """The other replicas' requests in flight here, by rank, and the KV tokens of all
        they sent here (a running total), as their reports say."""
        self.peer_in_flight_by_rank = by_rank
        self.peer_in_flight = sum(by_rank.values())
        self.peer_kv_tokens_total = kv_tokens_total

    def note_grant(
        self,
        kv_tokens: int = 0,
        rank: int = 0,
        committed_tokens: int = 0,
        priority: int | None = None,
    ) -> None:
        """Admission sent one request here: count it in flight and as not yet scraped, with
        the ``kv_tokens`` (prompt plus expected output) it will hold in the KV cache and the
        ``rank`` (tier, lower = more urgent) it runs as. ``committed_tokens`` is what it will
        hold at its end beyond what the cache already shares with it (``final_kv_usage``);
        the same number goes back with ``note_completion``, and so does the vLLM
        ``priority`` it was sent with."""
        self.kv_committed_tokens += committed_tokens
        self.in_flight += 1
        self.in_flight_by_rank[rank] += 1
        if priority is not None:
            self.in_flight_by_priority[priority] += 1
        self.granted_since_scrape += 1
        self.kv_tokens_since_scrape += kv_tokens
        self.granted_total += 1
        self.kv_tokens_total += kv_tokens

    def waiting_ahead_of(self, rank: int, priority: int | None = None) -> float:
        """The engine's waiting requests that a request of ``rank`` (sent with the vLLM
        ``priority``, when known) would wait behind.

        vLLM with priority scheduling orders its waiting queue by priority, so the requests
        this gateway sent as less urgent never hold a more urgent one back: they are taken
        off the queue count (as many as are in flight here, since the gateway cannot see
        which of its requests the engine has seated). Under a batch flood the engine's
        queue is often a few batch requests waiting for the step's token budget; counting
        them would hold chat in the gateway while vLLM would have seated it first. Within
        a tier the same holds for the continuous priority: a light user's first request
        passes a power user's queued fifth one in vLLM (``extproc.core.priority``), so it
        need not wait here for the power user's requests to leave the engine's queue.
        """
        return max(0.0, self.effective_waiting() - self._behind(rank, priority))

    def _behind(self, rank: int, priority: int | None = None) -> int:
        """Requests in flight here, from every replica, less urgent than a request of
        ``rank``: this replica's by their vLLM priority (larger numbers run later; an equal
        one arrived first, so it is ahead) when ``priority`` is given, else by rank; the
        other replicas' by rank, all they report."""
        if priority is None:
            behind = sum(n for r, n in self.in_flight_by_rank.items() if r > rank)
        else:
            behind = sum(n for p, n in self.in_flight_by_priority.items() if p > priority)
        return behind + sum(n for r, n in self.peer_in_flight_by_rank.items() if r > rank)

    def queue_room(self, max_waiting: int, rank: int, most: int, unseen: int = 0) -> int:
        """How many more requests of ``rank`` this engine's queue gate (``max_waiting``)
        lets through now, at most ``most``: each counts into ``effective_waiting`` as
        ``passes`` would see it after the ones before it. Replicas take that room in turns
        (``extproc.core.peers.turn``) rather than each taking all of it.

        ``unseen`` other replicas may be taking the same room with demand no report shows
        yet (``PeerView.unseen``): each is counted as adding to the engine's queue what this
        replica has since the scrape (its grants less its completions) and would now, so N
        replicas that see demand at once share the gate's room instead of each filling it.
        Net of completions, because a replica whose requests arrive one at a time at a
        steady rate sees every one of them fresh: counting its grants alone would hold all
        but the first per scrape for an exchange."""
        bound = max(max_waiting, 1)
        behind = self._behind(rank)
        own = max(0, self.granted_since_scrape - self.completed_since_scrape)
        room = 0
        while room < most:
            guessed = unseen * (own + room)
            if self.effective_waiting(extra=room + guessed) - behind >= bound:
                break
            room += 1
        return room

    def projected_kv_usage(self) -> float:
        """KV-cache use as last scraped plus what the grants since will take (0..1+).

        An engine whose cache size is unknown gets only the scraped figure; its gates then
        lean on the waiting queue, which every grant since the scrape counts into
        (``effective_waiting``).
        """
        metrics = self.metrics
        if metrics is None:
            return 1.0
        capacity = self.kv_capacity_tokens()
        if capacity is None:
            return metrics.kv_cache_usage
        # The others' grants since the scrape too: each of N replicas filling the KV gate's
        # headroom between two scrapes would fill it N times over (as ``_since_scrape``).
        peers = max(0, self.peer_kv_tokens_total - self.peer_kv_tokens_at_scrape)
        return metrics.kv_cache_usage + (self.kv_tokens_since_scrape + peers) / capacity

    def final_kv_usage(self) -> float:
        """KV-cache use once the requests in flight here have grown to their end (0..1+):
        the larger of ``projected_kv_usage`` and what this gateway's requests in flight
        were granted to hold at their end (prompt beyond a shared prefix, plus output).

        A running request's cache grows by a block every ``block_size`` tokens it
        generates, so a KV bound checked against the use *now* lets a less urgent tier fill
        the headroom a more urgent one needs: on a KV-bound fleet, batch admitted at 85 %
        grew to a full cache, and chat's prompt then waited for blocks (vLLM admits a
        waiting request only into free blocks). Other gateways' requests and any prefix
        sharing the gateway cannot see are in the scraped figure, hence the maximum.
        """
        projected = self.projected_kv_usage()
        capacity = self.kv_capacity_tokens()
        if capacity is None:
            return projected
        return max(projected, self.kv_committed_tokens / capacity)

    def kv_capacity_tokens(self) -> int | None:
        """Tokens the engine's KV cache holds, from ``cache_config_info`` (None if unknown)."""
        metrics = self.metrics
        if metrics is None or metrics.num_gpu_blocks is None or metrics.block_size is None:
            return None
        return metrics.num_gpu_blocks * metrics.block_size

    def note_completion(
        self, rank: int = 0, committed_tokens: int = 0, priority: int | None = None
    ) -> None:
        """A request sent here finished: its seat is free before the next scrape shows it,
        and the KV it was granted (``note_grant``'s ``committed_tokens``) with it."""
        self.kv_committed_tokens -= committed_tokens
        self.in_flight -= 1
        self.in_flight_by_rank[rank] -= 1
        if priority is not None:
            left = self.in_flight_by_priority[priority] - 1
            if left > 0:
                self.in_flight_by_priority[priority] = left
            else:  # one key per priority in use, not per priority ever sent
                del self.in_flight_by_priority[priority]
        self.completed_since_scrape += 1
        self.completed_total += 1

    def note_completion_elsewhere(self) -> None:
        """Another replica's request finished here (every replica gets every completion):
        the seat is free for the next scrape's arithmetic, as after one of ours. Its lease
        leaves the fleet's in-flight count with that replica's next report."""
        self.completed_since_scrape += 1
        self.completed_total += 1

    def note_outcome(self, ok: bool) -> None:
        """A completion from this backend succeeded (``ok``) or failed (5xx, dead link).

        ``FAILURES_TO_COOL_OFF`` failures in a row set the backend aside for ``COOL_OFF_S``:
        the picker then neither chooses nor lists it, so Envoy's retries and hedges go
        elsewhere. Any success resets the count; failures that keep coming during a
        cool-off (requests sent before it) extend it.
        """
        if ok:
            self.failures = 0
            return
        self.failures += 1
        if self.failures < FAILURES_TO_COOL_OFF:
            return
        self.failures = 0
        if self.cool_off_until is None:
            log.warning(
                "backend %s failed %d completions in a row; cooling off for %gs",
                self.address,
                FAILURES_TO_COOL_OFF,
                COOL_OFF_S,
            )
        self.cool_off_until = self._clock() + COOL_OFF_S

    def effective_waiting(self, extra: int = 0) -> float:
        """The engine's waiting queue as it is now, by the last scrape and what we saw since
        (and ``extra`` grants more, for ``queue_room``).

        Each grant since the scrape may be waiting in the engine (conservative: one the
        engine seats at once never waits, but the gateway cannot know that until the next
        scrape). Each completion since the scrape freed a seat, which took one waiting
        request or is free for the next. So a tier gated on an empty queue (batch) refills
        a freed seat at once, but fills free seats a few grants per scrape: a burst of batch
        prefills in one engine step slows every request in that step, chat's first token
        included (measured: batch-flood's chat p99 went from 1.6 to 2.1 x and its batch
        goodput from 67 to 58 % of FIFO's when grants filled free seats at once). How many
        is ``fill_per_scrape``: one on engines of up to 31 seats, more on big ones, which
        would otherwise take minutes to fill after a lull.
        """
        waiting = self.metrics.waiting if self.metrics is not None else 0.0
        granted, completed = self._since_scrape()
        granted += extra
        if not waiting:  # free seats at the scrape: the first few grants take them
            granted = max(0, granted - (self.fill_per_scrape() - 1))
        return max(0.0, waiting + granted - completed)

    def _since_scrape(self) -> tuple[int, int]:
        """Requests sent here and finished here since the last scrape, by every replica.

        This replica counts its own as they happen; the others' show as the change in their
        leases since the scrape (``peer_in_flight_at_scrape``), up to an exchange late, and
        net of their completions, so a fall counts as finished. Without them each of N
        replicas let the engine queue fill to the gate's bound between two scrapes, N times
        over: measured on ``power-user-x5`` with three replicas, the fleet filled 18-23 of
        its 32 seats in the first two simulated seconds where one process filled 11, the
        engines queued, the gate shut until the first requests finished, and the rest were
        sent in one burst.
        Every request being as long, the fleet then finished in bursts 4-5 s apart (a light
        tenant's request waited for the next burst: p95 1.8-1.9 x its latency alone,
        against 1.3-1.5 x for one process, whose gate fills the fleet over several scrapes)."""
        peers = self.peer_in_flight - self.peer_in_flight_at_scrape
        return (
            self.granted_since_scrape + max(0, peers),
            self.completed_since_scrape + max(0, -peers),
        )

    def fill_per_scrape(self) -> int:
        """Grants between two scrapes that a tier gated on an empty queue may put into free
        seats: one per ``SEATS_PER_FILL`` seats, at least one. A 256-seat engine then fills
        16 seats a scrape (the whole engine in 16 scrapes, 1.6 s at the default interval)
        where one a scrape took 26 s; an engine of 16 seats still fills one a scrape."""
        return max(1, self.seats.count // SEATS_PER_FILL)

    def busy_seats(self) -> float:
        """Seats taken or claimed now: the gateway's own requests in flight, or what the
        engine last showed running and waiting (plus grants and minus completions since),
        whichever is more, so traffic that bypasses the gateway counts too."""
        metrics = self.metrics
        ours = float(self.fleet_in_flight)
        if metrics is None:
            return ours
        granted, completed = self._since_scrape()
        return max(ours, metrics.running + metrics.waiting + granted - completed)

    def free_seats(self) -> float:
        """Seats no request holds or waits for (may be negative: requests queued in vLLM)."""
        return self.seats.count - self.busy_seats()

    def record_scrape(
        self,
        metrics: EngineMetrics,
        granted_before: int,
        completed_before: int = 0,
        kv_tokens_before: int = 0,
        peers_before: int | None = None,
        peer_kv_before: int | None = None,
    ) -> None:
        """A scrape sent when the since-scrape counters were ``granted_before`` and
        ``completed_before``, and the other replicas had ``peers_before`` requests in flight
        here and had sent ``peer_kv_before`` KV tokens in all (default: as now), succeeded.

        Only the grants and completions made before the scrape was sent can be in its
        numbers; the ones made while it was in flight stay counted. ``itl_s`` becomes the
        mean inter-token latency since the previous scrape; with no token in between it
        keeps its value while requests run (a step longer than the scrape interval, or a
        stalled engine, must not read as fast) and becomes None when the engine is idle
        (nothing to protect) or its page has no ITL histogram (nothing to measure with: the
        ITL bounds are off for it, and the first such page says so in the log).
        """
        itl = interval_itl(self.metrics, metrics)
        if itl is not None:
            self.itl_s = itl
        elif metrics.running == 0 or metrics.itl_count is None:
            self.itl_s = None
        if metrics.absent or (self.metrics is not None and self.metrics.absent):
            _note_absent(self.address, self.metrics, metrics)
        if self.metrics is None and self.seats.source == "fallback":
            log.info(
                "backend %s: seat count not declared and not learned yet; planning with %d "
                "(more as it is seen running more) until requests wait for a seat",
                self.address,
                self.seats.count,
            )
        if self.metrics is not None and restarted(self.metrics, metrics):
            # Another engine process at this address: its prefix cache starts empty.
            self.prefix_cache.clear()
        before = (self.seats.count, self.seats.source)
        self.seats.observe(self.metrics, metrics)
        if (self.seats.count, self.seats.source) != before and self.seats.source == "learned":
            log.info(
                "backend %s runs %d requests at once (learned: requests waited while KV had room)",
                self.address,
                self.seats.count,
            )
        self.metrics = metrics
        self._size_prefix_cache(metrics)
        self.granted_since_scrape = max(0, self.granted_since_scrape - granted_before)
        self.completed_since_scrape = max(0, self.completed_since_scrape - completed_before)
        self.kv_tokens_since_scrape = max(0, self.kv_tokens_since_scrape - kv_tokens_before)
        self.peer_in_flight_at_scrape = (
            self.peer_in_flight if peers_before is None else peers_before
        )
        self.peer_kv_tokens_at_scrape = (
            self.peer_kv_tokens_total if peer_kv_before is None else peer_kv_before
        )
        self.scrape_ok = True
        if self.membership == "warming":
            self.membership = "serving"
            log.info("backend %s %s: first good scrape; serving", self.region, self.address)

    @property
    def kv_events_live(self) -> bool:
        """The engine's KV events say what it holds: configured, and followed from a point
        where its whole cache was known."""
        return self.kv_index is not None and self.kv_index.live

    def precise_prefix(self, keys: Iterable[int]) -> int | None:
        """How many leading blocks of ``keys`` (the engine's block keys of a prompt, read
        only up to the first one it lacks) the engine holds or was just sent; None while its
        KV events cannot tell."""
        if self.kv_index is None or not self.kv_index.live:
            return None
        return self.kv_index.match(keys, self._clock())

    def expect_blocks(self, keys: Sequence[int]) -> None:
        """``keys`` were just sent here: count them as held until the events confirm them."""
        if self.kv_index is not None:
            self.kv_index.expect(keys, self._clock())

    def mark(self, now: float) -> None:
        """Remember the grant, completion and KV totals and the others' leases as of ``now``
        (the replica loop marks every backend once per exchange), so ``adopt_scrape`` can
        tell which of them a scrape taken elsewhere could have seen."""
        self._marks.append(
            (
                now,
                self.granted_total,
                self.completed_total,
                self.kv_tokens_total,
                self.peer_in_flight,
                self.peer_kv_tokens_total,
            )
        )

    def adopt_scrape(self, shared: SharedScrape, taken_at: float) -> bool:
        """Record a scrape another replica took at ``taken_at`` (on this replica's clock) as
        if it were ours; True when it was newer than what we had.

        Of the grants and completions since our last scrape, those made after the latest
        mark before ``taken_at`` stay counted as unseen by the engine: conservative, they
        can only make the engine look busier, by at most one exchange period of grants.
        With no such mark (the scrape is older than every mark), none are taken off.
        A scraper whose scrape failed makes the engine unscrapable here too.
        """
        if not shared.ok:
            if self.scrape_ok:
                log.warning(
                    "backend %s metrics unreadable by the replica that scrapes it; treating "
                    "it as saturated",
                    self.address,
                )
            self.scrape_ok = False
            return False
        current = self.metrics
        if current is not None and taken_at <= current.scraped_at:
            return False
        granted = completed = kv_tokens = 0
        peers: int | None = None
        peer_kv: int | None = None
        mark = self._mark_before(taken_at)
        if mark is not None:
            _, granted_at, completed_at, kv_tokens_at, peers, peer_kv = mark
            granted = self.granted_since_scrape - (self.granted_total - granted_at)
            completed = self.completed_since_scrape - (self.completed_total - completed_at)
            kv_tokens = self.kv_tokens_since_scrape - (self.kv_tokens_total - kv_tokens_at)
        if not self.scrape_ok:
            log.warning("backend %s metrics are readable again", self.address)
        metrics = shared.metrics
        if metrics.scraped_at != taken_at:
            metrics = replace(metrics, scraped_at=taken_at)
        self.record_scrape(
            metrics, max(0, granted), max(0, completed), max(0, kv_tokens), peers, peer_kv
        )
        return True

    def _mark_before(self, at: float) -> Mark | None:
        """The latest mark at or before ``at`` (marks are few: a reverse scan is enough)."""
        for mark in reversed(self._marks):
            if mark[0] <= at:
                return mark
        return None

    def _size_prefix_cache(self, metrics: EngineMetrics) -> None:
        """Follow the engine's ``cache_config_info``: a new block size makes every recorded
        hash meaningless (the blocks are cut differently), a new block count only resizes."""
        if metrics.block_size is not None and metrics.block_size != self.block_size:
            self.block_size = metrics.block_size
            self.prefix_cache.clear()
        blocks = metrics.num_gpu_blocks
        if blocks is not None and blocks != self.prefix_cache.capacity:
            self.prefix_cache.resize(blocks)

    def __repr__(self) -> str:
        state = "up" if self.healthy else "down"
        return f"<Backend {self.address} {self.region} {state} in_flight={self.in_flight}>"


def _note_absent(address: str, before: EngineMetrics | None, after: EngineMetrics) -> None:
    """Log the optional series a backend's ``/metrics`` lacks when that changes: once per
    backend, not once per scrape (ten a second), and again when a restarted engine
    exports them or stops."""
    was = () if before is None else before.absent
    for name in after.absent:
        if name not in was:
            log.warning("backend %s: /metrics has no %s; %s", address, name, OPTIONAL[name])
    for name in was:
        if name not in after.absent:
            log.warning("backend %s: /metrics has %s again", address, name)


SERVING_MEMORY = 256
"""Models whose serving backends a pool remembers at once (``BackendPool.serving``)."""


class BackendPool:
    """All backends, in configured order (the first region named is the local one).

    A fleet found through DNS changes while the service runs (``extproc.fleet.membership``
    calls ``add`` and ``remove``). Each change builds a new ``backends`` list and
    ``by_address`` map rather than editing them, so a loop that awaits between reading and
    using them (the health poller) keeps a consistent snapshot. ``regions`` is fixed at
    start (``regions``, then the specs' regions): backends stay ordered by region, local
    first, whenever they joined, because the picker takes the first backend's region as
    the local one and breaks ties in list order. ``dynamic``: the pool may start empty
    (its names have not resolved yet).
    """

    def __init__(
        self,
        specs: Sequence[BackendSpec],
        clock: Callable[[], float] = time.monotonic,
        regions: Sequence[str] = (),
        dynamic: bool = False,
    ) -> None:
        if not specs and not dynamic:
            raise ValueError("at least one backend is needed")
        self.clock = clock  # stamps EngineMetrics.scraped_at; gates compare against it
        self.backends = [Backend(spec, clock) for spec in specs]
        self.by_address = {b.address: b for b in self.backends}
        self.regions = list(dict.fromkeys([*regions, *(b.region for b in self.backends)]))
        self.models_version = int(any(b.models is not None for b in self.backends))
        """Bumped whenever an engine's models change (``set_models``, a declared backend
        joining): 0 while none is known."""
        self._serving: dict[tuple[str, int, int], list[Backend]] = {}
        self._fleet_version = 0
        """Bumped when a backend joins or leaves: what ``serving`` remembers is per fleet."""
        self._pools: dict[tuple[str, int, int], str] = {}
        self.loadable: Loadable = NOTHING_LOADABLE
        """The policy's runtime adapters (``set_loadable``): they may go where their base
        is served."""

    def set_models(self, backend: Backend, models: ServedModels) -> None:
        """What ``backend`` serves now (its ``/v1/models``)."""
        backend.models = models
        self.models_version += 1
        self._serving.clear()
        self._pools.clear()

    def set_loadable(self, loadable: Loadable) -> None:
        """The runtime adapters of a (re)loaded policy: adapter name -> base model."""
        if dict(loadable) != dict(self.loadable):
            self.loadable = dict(loadable)
            self._serving.clear()
            self._pools.clear()

    def serving(self, model: str | None) -> list[Backend]:
        """The backends a request for ``model`` may go to (``extproc.fleet.models.may_serve``),
        in pool order; remembered until models or membership change, so asking costs a
        lookup per request, not a walk of the fleet."""
        if model is None or not self.models_version:
            return self.backends
        key = (model, self.models_version, self._fleet_version)
        found = self._serving.get(key)
        if found is None:
            if len(self._serving) >= SERVING_MEMORY:  # clients may name any model: bounded
                self._serving.clear()
            loadable = self.loadable
            found = self._serving[key] = [b for b in self.backends if may_serve(b, model, loadable)]
        return found

    def pool_of(self, model: str | None) -> str:
        """The pool of engines ``model`` runs on, named by the smallest base name they list
        (an adapter runs on its base's pool); "" while the fleet serves one model, or the
        model's engines are not known: the tier's one band (``extproc.core.bands``)."""
        if model is None or not self.models_version:
            return ""
        key = (model, self.models_version, self._fleet_version)
        pool = self._pools.get(key)
        if pool is None:
            if len(self._pools) >= SERVING_MEMORY:
                self._pools.clear()
            pool = self._pools[key] = self._find_pool(model)
        return pool

    def _find_pool(self, model: str) -> str:
        if not several_models(self.backends):
            return ""
        for backend in self.serving(model):
            if backend.models is not None:
                return backend.models.pool_name(model)
        return ""

    def add(self, spec: BackendSpec) -> Backend:
        """A new backend, ``warming`` until its first good scrape, placed after the others
        of its region."""
        if spec.address in self.by_address:
            raise ValueError(f"backend {spec.address} is already in the pool")
        backend = Backend(spec, self.clock)
        backend.membership = "warming"
        if backend.models is not None:
            self.models_version += 1
        elif self.models_version:
            backend.models_expected = True
        if spec.region not in self.regions:
            self.regions = [*self.regions, spec.region]
        rank = {region: i for i, region in enumerate(self.regions)}
        self.backends = sorted([*self.backends, backend], key=lambda b: rank[b.region])
        self.by_address = {**self.by_address, spec.address: backend}
        self._fleet_version += 1
        return backend

    def remove(self, address: str) -> Backend | None:
        """Take ``address`` out of the pool (None if it was not in it): nothing refers to
        it any more but the records of requests still in flight there."""
        backend = self.by_address.get(address)
        if backend is None:
            return None
        self.backends = [b for b in self.backends if b is not backend]
        self.by_address = {a: b for a, b in self.by_address.items() if b is not backend}
        self._fleet_version += 1
        return backend

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]
