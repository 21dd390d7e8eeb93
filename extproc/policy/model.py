"""The policy's objects: tiers, tenants, rules, model aliases, and the validated ``Policy``
that holds them.

Per-request code only reads these; every lookup it needs (API key -> tenant, word -> tier,
tenant -> most urgent allowed tier) is a dict built once when the ``Policy`` is made.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from extproc.policy.keys import KeyIndex, self_contained_digest

# Metrics older than this are not trusted: ten missed scrapes at the default 100 ms.
DEFAULT_STALE_AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class Gate:
    """The bounds a backend must meet to take a request of one tier (``None``: no bound)."""

    max_waiting: int | None = 3
    max_kv_cache_usage: float | None = 0.95
    max_itl_s: float | None = None
    max_in_flight: int | None = None  # gateway-side per-backend cap for this tier

    def __post_init__(self) -> None:
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        kv = self.max_kv_cache_usage
        if kv is not None and not 0.0 <= kv <= 1.0:
            raise ValueError(f"max_kv_cache_usage must be in [0, 1], got {kv}")
        itl = self.max_itl_s
        if itl is not None and not (itl > 0 and math.isfinite(itl)):
            raise ValueError(f"max_itl_s must be a positive number of seconds, got {itl}")
        if self.max_in_flight is not None and self.max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {self.max_in_flight}")


DEFAULT_GATES: Mapping[str, Gate] = MappingProxyType(
    {
        # Chat may wait inside vLLM, where its priority puts it first, as deep as 8 (TNG
        # dispatches below ~3): when chat alone fills the fleet, that lets a request wait
        # for the engine holding its prompt prefix rather than take whichever seat frees
        # (docs/benchmarks/prefix-routing.md: 90 % of prompt tokens cached against 73 %
        # at 3). Only chat ahead of it counts, so batch never blocks it. No ITL bound.
        "interactive": Gate(max_waiting=8, max_kv_cache_usage=0.95),
        # One step below interactive (see the module docstring), and a little more KV
        # headroom; no ITL bound, as api clients stream too and vLLM priority protects them.
        "api": Gate(max_waiting=2, max_kv_cache_usage=0.90),
        # Only into a free seat, with KV headroom left for the tiers above. No ITL bound by
        # default: what a normal inter-token latency is depends on the engine (an L4-class
        # GPU's prefill steps pass 150 ms, TNG's number, and batch then starved); set
        # max_itl_ms for an engine whose latency you know.
        "batch": Gate(max_waiting=0, max_kv_cache_usage=0.85),
    }
)


DEFAULT_GATE = Gate()
"""The gate of a tier that names none: vLLM's queue below 3, KV cache below 95%."""

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_MODEL_NAME_CHARS = 256
"""The longest model name, glob or alias a policy may write (the fleet keeps names of
engines' ``/v1/models`` up to the same length)."""
EscalationMode = Literal["downgrade", "reject"]


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True, slots=True)
class Tier:
    """A strict priority band; every request is served in exactly one."""

    name: str
    rank: int
    """0 = most urgent; the tier's position in the file."""
    priority: int
    """Base vLLM priority (lower = earlier); the continuous priority adds to it."""
    queue_limit: int
    """How many requests of this tier the gateway may hold before shedding with 429."""
    queue_deadline_s: float
    """How long a request may wait in the gateway before it is shed with 503."""
    slo_ttft_ms: int | None = None
    slo_latency_s: float | None = None
    aliases: tuple[str, ...] = ()
    """Other words a client may ask for this tier with (``high``, ``low``, ...)."""
    aging_rate: float = 0.0
    """Ranks a waiting request climbs per second of waiting (0: no aging)."""
    aging_cap: float = 0.0
    """The most ranks aging can lift a request (bounds how far batch can climb)."""
    reserved_share: float = 0.0
    """The most (0..1) of the fleet's seats that less urgent tiers may not take while this
    tier is active; the reserve itself follows the tier's recent demand
    (``extproc.core.reservations``)."""
    reserved_idle_s: float = 120.0
    """The reservation holds this long after the tier's last request: vLLM never preempts,
    so once batch has taken a seat the next chat request waits for a batch request to
    finish. Its demand is averaged over a quarter of this (``DEMAND_WINDOW_SHARE``), so an
    idle tier shrinks to one reserved seat long before it gives up the last one."""
    gate: Gate = DEFAULT_GATE
    """What a backend's scraped metrics must show for a request of this tier to go there."""
    hedge_after_ms: int | None = None
    """Envoy sends a second copy of the request to the next listed endpoint when the first
    has not answered with headers after this long (None: no hedging). It duplicates GPU
    work and, for streams, covers only the time to response headers."""
    early_shed_from: float | None = None
    """Queue fill (0..1) from which new arrivals are shed with a probability rising
    linearly to 1 at a full queue (RED-style); None: shed only when full."""
    preemptible: bool = False
    """A running non-streamed request of this tier may be cancelled to seat a more urgent
    one (``extproc.core.preemption``): vLLM never preempts for a waiting request, so this
    is how a flood of such work leaves chat its first token without seats kept idle for
    it. The client is answered 503 with ``retry-after`` before any byte of the response,
    and sends it again; more urgent tiers' reserves then bind it only while the gateway
    cannot preempt it."""


@dataclass(frozen=True, slots=True)
class Budget:
    """A rate budget (``extproc.core.budgets``): each limit optional, None for no limit.

    Tokens are a request's input plus its output (estimated as ``max_tokens`` or the
    fairness default when it is admitted, corrected when it completes), counted over the
    last minute; requests are counted over the last minute when they arrive; ``concurrent``
    counts requests submitted and not yet finished (queued or in flight)."""

    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in ("tokens_per_minute", "requests_per_minute", "concurrent"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def empty(self) -> bool:
        return (
            self.tokens_per_minute is None
            and self.requests_per_minute is None
            and self.concurrent is None
        )


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who is calling, as identified by an API key, and which tiers that caller may use."""

    name: str
    api_keys: tuple[str, ...] = field(repr=False)
    """The policy's entries as written: plain keys, ``sha256:HEX``, ``env:NAME`` or
    ``file:PATH`` (``extproc.policy.keys``). Out of ``repr``: a plain key is a secret."""
    tiers: tuple[str, ...]
    """Allowed tier names; asking for anything less urgent than the best of them is fine."""
    default_tier: str
    weight: float = 1.0
    """Fair-share weight of this tenant's flows within a band."""
    budget: Budget | None = None
    """The tenant's rate budget, over all its users (None: none)."""
    user_budget: Budget | None = None
    """The budget of each of the tenant's end users (``RequestClass.user``; None: none)."""
    key_digests: tuple[bytes, ...] = field(default=(), repr=False, compare=False)
    """The SHA-256 of each key, what requests are checked against. The parser passes them
    (it resolves ``env:`` and ``file:`` entries); left empty, they are computed from plain
    and ``sha256:`` entries."""
    models: tuple[str, ...] = ()
    """The models the tenant may use: names or shell-style globs (``llama-*``), matched
    case-sensitively against the whole name; empty: every model
    (``extproc.policy.models.may_use``)."""
    default_model: str | None = None
    """The model a request that names none is given (None: the request goes as it is and
    the engine serves its own default)."""

    def __post_init__(self) -> None:
        if not self.key_digests:
            digests = tuple(self_contained_digest(entry) for entry in self.api_keys)
            object.__setattr__(self, "key_digests", digests)
        elif len(self.key_digests) != len(self.api_keys):
            raise ValueError("key_digests must hold one digest per api_keys entry")


@dataclass(frozen=True, slots=True)
class AliasTarget:
    """One model an alias sends requests to, and its relative weight among the alias's
    targets (90 and 10: nine requests in ten go to the first)."""

    model: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("an alias target needs a model name")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"weight must be a positive number, got {self.weight}")


ModelAliases = Mapping[str, tuple[AliasTarget, ...]]
"""A client's model name -> the served models it stands for (``Policy.model_aliases``)."""

NO_MODEL_ALIASES: ModelAliases = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RuntimeAdapter:
    """A LoRA adapter the gateway may load onto an engine of its base model when a request
    names it and the chosen engine does not hold it (vLLM's ``/v1/load_lora_adapter``)."""

    base: str
    """The served base model the adapter runs on: engines serving it may load it."""
    path: str
    """Where the engine reads the adapter from (its ``lora_path``: a directory on the
    engine's machine, or whatever a LoRA resolver of the engine's understands)."""


RuntimeAdapters = Mapping[str, RuntimeAdapter]
"""An adapter's name -> its base and path (``Policy.runtime_adapters``)."""

NO_RUNTIME_ADAPTERS: RuntimeAdapters = MappingProxyType({})


ConditionOp = Literal["equals", "in", "present", "gt", "ge", "lt", "le", "regex"]


@dataclass(frozen=True, slots=True)
class Condition:
    """One test on a request header or a body field; a rule matches when all of its hold."""

    field: str
    op: ConditionOp
    operand: Any
    """A scalar, a tuple for ``in``, a bool for ``present``, a compiled pattern for ``regex``."""

    def test(self, found: bool, value: Any) -> bool:
        if self.op == "present":
            return found is bool(self.operand)
        if not found:
            return False
        if self.op == "equals":
            return _same(value, self.operand)
        if self.op == "in":
            return any(_same(value, option) for option in self.operand)
        if self.op == "regex":
            return isinstance(value, str) and self.operand.search(value) is not None
        if not _is_number(value):
            return False
        if self.op == "gt":
            return bool(value > self.operand)
        if self.op == "ge":
            return bool(value >= self.operand)
        if self.op == "lt":
            return bool(value < self.operand)
        return bool(value <= self.operand)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _same(value: object, operand: object) -> bool:
    """Equality where ``true`` never equals ``1`` (Python's ``True == 1`` would let it)."""
    if isinstance(value, bool) or isinstance(operand, bool):
        return type(value) is type(operand) and value == operand
    return value == operand


_MISSING = object()


def _body_value(body: Mapping[str, Any], dotted: tuple[str, ...]) -> Any:
    value: Any = body
    for key in dotted:
        if not isinstance(value, Mapping) or key not in value:
            return _MISSING
        value = value[key]
    return value


@dataclass(frozen=True, slots=True)
class Match:
    """What a rule looks at: the path (query string excluded), headers, body fields."""

    path_prefix: str | None = None
    path_regex: re.Pattern[str] | None = None
    headers: tuple[Condition, ...] = ()
    """Header names are lower-case, as Envoy reports them."""
    body: tuple[Condition, ...] = ()
    """Field names may be dotted (``metadata.team``) to reach into nested objects."""

    def matches(self, path: str, headers: Mapping[str, str], body: Mapping[str, Any]) -> bool:
        path = path.partition("?")[0]
        if self.path_prefix is not None and not path.startswith(self.path_prefix):
            return False
        if self.path_regex is not None and self.path_regex.search(path) is None:
            return False
        for cond in self.headers:
            value = headers.get(cond.field)
            if not cond.test(value is not None, value):
                return False
        for cond in self.body:
            value = _body_value(body, tuple(cond.field.split(".")))
            if not cond.test(value is not _MISSING, value):
                return False
        return True


@dataclass(frozen=True, slots=True)
class Rule:
    """Classification by what a request looks like; the first matching rule decides."""

    name: str
    match: Match
    tier: str | None = None
    workload: str | None = None
    strip_path_prefix: str | None = None
    """Removed from the front of the path before it goes upstream."""
    add_path_prefix: str | None = None
    """Put in front of the (stripped) path: strip ``/v1/batch`` + add ``/v1`` turns
    ``/v1/batch/chat/completions`` into ``/v1/chat/completions``."""

    @property
    def rewrites_path(self) -> bool:
        return self.strip_path_prefix is not None or self.add_path_prefix is not None

    def rewrite(self, path: str) -> str:
        rest = path
        if self.strip_path_prefix is not None and path.startswith(self.strip_path_prefix):
            rest = path[len(self.strip_path_prefix) :]
        if self.add_path_prefix is None:
            return rest if rest.startswith("/") else "/" + rest
        if rest and not rest.startswith(("/", "?")):
            rest = "/" + rest
        return (self.add_path_prefix.rstrip("/") + rest) or "/"


FlowKey = Literal["tenant", "user"]


@dataclass(frozen=True, slots=True)
class Fairness:
    """How service is counted between flows of one tier (the Virtual Token Counter)."""

    flow: FlowKey = "tenant"
    """A flow is a tenant, or each end user of a tenant (``user``)."""
    input_weight: float = 1.0
    output_weight: float = 2.0
    default_output_tokens: int = 256
    """Charged up front for a request without ``max_tokens``, corrected when it finishes."""


@dataclass(frozen=True, slots=True)
class Backpressure:
    """How fresh the backends' scraped metrics must be for their gates to open."""

    scrape_interval_s: float = 0.1
    stale_after_s: float = 1.0
    """Metrics older than this count as saturated: no request goes to that backend."""


@dataclass(frozen=True, slots=True)
class Routing:
    """How the picker weighs the backends that may take a request (lower score wins)."""

    queue_weight: float = 1.0
    """Per request waiting or in flight, relative to the backend's slot limit."""
    kv_cache_weight: float = 1.0
    """Per unit of ``vllm:kv_cache_usage_perc``."""
    prefix_weight: float = 2.0
    """Per unit of the share of the prompt's prefix blocks the backend already holds."""
    region_weight: float = 0.5
    """Added for a backend outside the local (first-named) region."""
    sticky_margin: float = 1.0
    """Stay on the backend holding the prefix until its load score is worse than the best
    other backend's by more than this: 1.0 is one backend's slots more requests. A request
    that leaves its prefix pays the whole prefill again and copies the prefix over someone
    else's cache, while the tier's gate already bounds how deep the holder's queue gets.
    Measured on ``shared-prefix`` (docs/benchmarks/prefix-routing.md): 0.25 hit 86.8 % of prompt
    tokens, 0.5 89.5 %, 1.0 90.4 %, 3.0 90.9 % (KV unbounded, the ceiling: 91-92 %) at
    9.3-10.1 req/s; with one hot prefix every margin gave the same."""
    lora_weight: float = 1.0
    """For a request to a LoRA adapter: added in full on an engine that lists the adapter
    but has no free LoRA slot and is not running it (a swap waits for a slot and costs
    engine time), 0.4 of it when the adapter waits there for a slot, 0.2 with a slot free,
    none when it runs there already (llm-d's LoRA affinity: 1.0 / 0.6 / 0.8 / 1.0 as
    scores). 1.0 is one backend's slots of queue."""
    prefix_lookahead: int = 8
    """When one engine or a few have room, the queued request that goes there may be any of
    the flow's this many oldest: the one whose prompt prefix they hold the most of
    (``extproc.core.affinity``); 0 or 1 keeps strict arrival order within a flow. A request
    is passed over at most this many times."""


@dataclass(frozen=True, slots=True)
class Policy:
    """One validated policy file. Build it with ``parse_policy``/``load_policy``."""

    tiers: tuple[Tier, ...]
    tenants: tuple[Tenant, ...]
    rules: tuple[Rule, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    on_escalation: EscalationMode = "downgrade"
    """What happens when a client asks for a tier more urgent than its key allows."""
    max_in_flight_per_backend: int = 4096
    """A safety cap on requests sent to one backend; its seats (learned or declared) decide
    first, so this need not match the engines."""
    user_header: str = "x-user-id"
    """Where the end-user id comes from when the body has no ``"user"`` string."""
    fairness: Fairness = Fairness()
    backpressure: Backpressure = Backpressure()
    routing: Routing = Routing()
    model_aliases: ModelAliases = field(default_factory=lambda: NO_MODEL_ALIASES, hash=False)
    """A client's model name -> the served models it is sent to, with their weights
    (``extproc.policy.models.resolve_model``). Read-only: a ``dict`` given here is copied
    into a ``MappingProxyType``. Left out of the hash (a mapping has none) but compared."""
    runtime_adapters: RuntimeAdapters = field(
        default_factory=lambda: NO_RUNTIME_ADAPTERS, hash=False
    )
    """LoRA adapters loaded onto engines at run time (opt-in: empty, nothing is loaded).
    Read-only like ``model_aliases``."""
    source: str = "<policy>"
    warnings: tuple[str, ...] = field(default=(), compare=False)
    """``file:line: field: message`` for what works but should change (a plain API key in
    the file); ``fairlane check`` prints them."""
    key_files: tuple[Path, ...] = field(default=(), compare=False)
    """The files ``file:`` API keys were read from; the store reloads when one changes, so
    a rotated key file takes effect like an edited policy."""

    _tiers_by_name: dict[str, Tier] = field(init=False, repr=False, compare=False)
    _tiers_by_word: dict[str, Tier] = field(init=False, repr=False, compare=False)
    _tenants_by_key: KeyIndex[Tenant] = field(init=False, repr=False, compare=False)
    _tenants_by_name: dict[str, Tenant] = field(init=False, repr=False, compare=False)
    _top_tier: dict[str, Tier] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        aliases = {name: tuple(targets) for name, targets in self.model_aliases.items()}
        for name, targets in aliases.items():
            if not targets:
                raise ValueError(f"model alias {name!r} has no target")
            chained = [t.model for t in targets if t.model != name and t.model in aliases]
            if chained:
                raise ValueError(f"model alias {name!r} points to alias {chained[0]!r}")
        object.__setattr__(self, "model_aliases", MappingProxyType(aliases))
        adapters = dict(self.runtime_adapters)
        for name in adapters:
            if name in aliases:
                raise ValueError(f"{name!r} is both a model alias and a runtime adapter")
        object.__setattr__(self, "runtime_adapters", MappingProxyType(adapters))
        by_name = {tier.name: tier for tier in self.tiers}
        by_word = dict(by_name)
        for tier in self.tiers:
            by_word.update(dict.fromkeys(tier.aliases, tier))
        tenants_by_key = KeyIndex(
            (digest, tenant) for tenant in self.tenants for digest in tenant.key_digests
        )
        top = {
            tenant.name: min((by_name[t] for t in tenant.tiers), key=lambda t: t.rank)
            for tenant in self.tenants
        }
        object.__setattr__(self, "_tiers_by_name", by_name)
        object.__setattr__(self, "_tiers_by_word", by_word)
        object.__setattr__(self, "_tenants_by_key", tenants_by_key)
        object.__setattr__(self, "_tenants_by_name", {t.name: t for t in self.tenants})
        object.__setattr__(self, "_top_tier", top)

    def tier(self, name: str) -> Tier:
        """The tier called ``name`` (``KeyError`` if there is none)."""
        return self._tiers_by_name[name]

    def tier_for_ask(self, word: str) -> Tier | None:
        """The tier a client means by ``word`` (a tier name or alias, any case)."""
        return self._tiers_by_word.get(word.strip().lower())

    def tenant(self, name: str) -> Tenant:
        return self._tenants_by_name[name]

    def tenant_for_key(self, key: str) -> Tenant | None:
        """The tenant whose key a client presented (hashed and compared in constant time,
        whatever form the policy wrote the key in)."""
        return self._tenants_by_key.find(key)

    def top_tier(self, tenant: Tenant) -> Tier:
        """The most urgent tier ``tenant`` may use: the ceiling for whatever it asks."""
        return self._top_tier[tenant.name]

    @property
    def lowest_tier(self) -> Tier:
        return self.tiers[-1]


# --------------------------------------------------------------------------- errors


class PolicyError(Exception):
    """A policy file that cannot be used, with every problem found in it."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        count = f"{len(errors)} error{'s' if len(errors) != 1 else ''}"
        super().__init__(f"invalid policy ({count}):\n" + "\n".join(self.errors))
