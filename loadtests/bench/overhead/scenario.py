"""The ``kind: overhead`` scenario file: what ``fairlane bench overhead`` measures.

An overhead scenario is not a fleet simulation (no groups, no simulated seconds): it names
the fairlane arms (each a policy, the API key the load generator sends, optionally the
backend's declared seats), the peer gateways run beside them, the open-loop rates (a number,
or ``half_capacity``: half of the arm's own measured saturation), the wall seconds per
phase, the closed-loop saturation phase, the concurrency-1 phase, the overload block and the
targets. It is validated like the A/B scenarios (the same reader: every mistake as
``file:line: field: message``, unknown fields are errors), so a typo never silently changes
what is measured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from loadtests.bench.scenario.document import Document, ScenarioError
from loadtests.bench.scenario.fields import (
    Field,
    FieldReader,
    Section,
    choice,
    integer_at_least,
    number,
    positive,
    read_whole,
    string,
    text,
)
from loadtests.bench.scenario.policy import read_policy

DIRECT = "direct"
"""The arm without ext_proc: Envoy straight to the backend."""
FAIRLANE = "fairlane"
"""The fairlane arm a scenario without ``fairlane_arms`` has (its ``policy``)."""
OVERHEAD_ARMS = (DIRECT, FAIRLANE)
PEERS = ("vllm-router", "litellm")
"""Peer gateways in place of Envoy and fairlane, in front of the same instant backend
(vllm-router round_robin, the LiteLLM proxy: ``loadtests.bench.peers``); run only when
``arms`` names them. They run the saturation, the numeric rates and concurrency 1, not the
overload (whose verdicts are about fairlane's own refusals)."""
DEFAULT_API_KEY = "sk-overhead"
"""The key of ``policies/overhead.yaml``'s one tenant."""
HALF_CAPACITY = "half_capacity"
"""A rate: half of the fairlane arm's own saturation req/s (the direct arm runs every
fairlane arm's resolved value)."""

Rate = float | str
"""A rate as the file gives it: req/s, or :data:`HALF_CAPACITY`."""

# added_*: the fairlane arm minus direct at the target's ``rate``.
RATE_METRICS = ("added_p50_ms", "added_p99_ms")
# The fairlane arm's closed-loop phase; rps_per_core_vs_envoy also the direct arm's.
SATURATION_METRICS = ("saturation_rps", "rps_per_service_core", "rps_per_core_vs_envoy")
# The concurrency-1 phase: the gateway's p50 minus the backend's, called directly.
C1_METRICS = ("c1_added_p50_ms",)
# The overload phase and the recovery after it.
OVERLOAD_METRICS = (
    "overload_admitted_fraction",
    "overload_answered_within_fraction",
    "overload_envoy_errors",
    "overload_timeouts",
    "recovery_s",
)
OVERHEAD_METRICS = (*RATE_METRICS, *SATURATION_METRICS, *C1_METRICS, *OVERLOAD_METRICS)


@dataclass(frozen=True)
class OverheadTarget:
    name: str
    metric: str
    bound: float
    op: Literal["max", "min"]
    rate: Rate | None = None
    arm: str | None = None
    """The fairlane arm it is about; None: every fairlane arm of the run (one verdict each)."""


@dataclass(frozen=True)
class FairlaneArm:
    """An arm with Envoy's ext_proc filter and one fairlane service process."""

    name: str
    policy: Path
    api_keys: tuple[str, ...] = (DEFAULT_API_KEY,)
    """What the load generator sends as ``Bearer``, each key in turn: keys of the policy's
    tenants (``api_key`` in the file, a key or a list; several spread the load over
    replicas, which Envoy picks per key)."""
    seats: int | None = None
    """The instant backend's seats as declared to the service (``#seats=N``); None: learned."""
    replicas: int = 1
    """Service processes; above 1 they share state in a local Redis."""
    shared_state: bool = False
    """Put even one replica's state in Redis (to weigh shared against in-process state)."""


@dataclass(frozen=True)
class OverloadSpec:
    """Open loop at ``factor`` x the arm's own saturation req/s, then the recovery watch."""

    factor: float = 2.0
    duration_s: float = 30.0
    answer_within_ms: float = 50.0
    """A refusal (429/503 from the gateway) must come back within this."""
    timeout_s: float = 5.0
    """The client gives up on a request after this (counted as a timeout)."""
    max_connections: int = 512
    """Open connections at most; a send due while all are busy is not made (``unsent``)."""
    recovery_rate: float | None = None
    """Req/s after the overload; None: the lowest numeric rate (it needs its no-load p50)."""
    recovery_window_s: float = 0.5
    recovery_max_s: float = 10.0


@dataclass(frozen=True)
class OverheadScenario:
    name: str
    description: str
    policy: Path
    """The ``fairlane`` arm's policy (the first fairlane arm's, with ``fairlane_arms``)."""
    rates: tuple[Rate, ...]
    duration_s: float
    """Wall seconds per phase (not simulated: the gateway's own time is measured)."""
    saturation_connections: int
    """Closed-loop connections at saturation; 0 skips that phase."""
    warmup_requests: int
    arms: tuple[str, ...]
    targets: tuple[OverheadTarget, ...] = ()
    path: Path | None = None
    fairlane_arms: tuple[FairlaneArm, ...] = ()
    """Every arm but ``direct``; empty: one ``fairlane`` arm with ``policy``."""
    concurrency1_requests: int = 0
    """Requests of the concurrency-1 phase (each sent through the gateway and to the backend
    directly, alternating); 0 skips it."""
    overload: OverloadSpec | None = None

    @property
    def fairlane_specs(self) -> tuple[FairlaneArm, ...]:
        return self.fairlane_arms or (FairlaneArm(FAIRLANE, self.policy),)

    def fairlane_arm(self, name: str) -> FairlaneArm | None:
        return next((a for a in self.fairlane_specs if a.name == name), None)

    @property
    def all_arms(self) -> tuple[str, ...]:
        return (DIRECT, *(a.name for a in self.fairlane_specs), *PEERS)

    @property
    def run_order(self) -> tuple[str, ...]:
        """The arms as they run: the fairlane arms in the listed order (each measures its
        own saturation first, which ``half_capacity`` and the overload need), then
        ``direct`` at every rate they resolved."""
        return tuple(a for a in self.arms if a != DIRECT) + tuple(
            a for a in self.arms if a == DIRECT
        )

    @property
    def numeric_rates(self) -> tuple[float, ...]:
        return tuple(float(r) for r in self.rates if not isinstance(r, str))

    @property
    def recovery_rate(self) -> float | None:
        if self.overload is None:
            return None
        if self.overload.recovery_rate is not None:
            return self.overload.recovery_rate
        return min(self.numeric_rates, default=None)

    def with_overrides(
        self, duration_s: float | None = None, arms: list[str] | None = None
    ) -> OverheadScenario:
        """A copy with command-line overrides applied (and checked). ``--duration`` sets
        every phase's wall seconds, the overload's too."""
        where = str(self.path or self.name)
        changes: dict[str, Any] = {}
        if duration_s is not None:
            if not duration_s > 0:
                raise ScenarioError(f"{where}: --duration must be > 0, got {duration_s}")
            changes["duration_s"] = duration_s
            if self.overload is not None:
                changes["overload"] = dataclasses.replace(self.overload, duration_s=duration_s)
        if arms is not None:  # any arm the scenario defines, listed in `arms:` or not
            unknown = [a for a in arms if a not in self.all_arms]
            if unknown or not arms:
                raise ScenarioError(
                    f"{where}: --arms: unknown arm(s) {', '.join(unknown) or '(none given)'}; "
                    f"the scenario has {', '.join(self.all_arms)}"
                )
            changes["arms"] = tuple(a for a in self.all_arms if a in arms)
        return dataclasses.replace(self, **changes)


def _rates(value: Any) -> list[Rate] | None:
    if not isinstance(value, list):
        return None
    found: list[Rate] = []
    for v in value:
        if v == HALF_CAPACITY:
            found.append(HALF_CAPACITY)
            continue
        n = positive(v)
        if n is None:
            return None
        found.append(float(n))
    return found if len(set(found)) == len(found) else None


def _rate(value: Any) -> Rate | None:
    return HALF_CAPACITY if value == HALF_CAPACITY else positive(value)


def _names(value: Any) -> list[str] | None:
    if not isinstance(value, list) or not value:
        return None
    ok = all(isinstance(v, str) for v in value)
    return value if ok and len(set(value)) == len(value) else None


OVERHEAD_FIELDS = (
    "kind",
    "name",
    "description",
    "policy",
    "fairlane_arms",
    "rates",
    "duration_s",
    "saturation_connections",
    "warmup_requests",
    "concurrency1_requests",
    "overload",
    "arms",
    "targets",
)
ARM_FIELDS = ("policy", "api_key", "seats", "replicas", "shared_state")
OVERLOAD_FIELDS = tuple(f.name for f in dataclasses.fields(OverloadSpec))


def parse_overhead(document: Document) -> OverheadScenario:
    """Validate a ``kind: overhead`` document; one :class:`ScenarioError` for every problem."""
    return read_whole(document, _read_overhead)


def _read_overhead(reader: FieldReader, root: Field) -> OverheadScenario | None:
    top = reader.section(root, OVERHEAD_FIELDS)
    if top is None:
        return None
    name = reader.get(top, "name", text, "a non-empty string")
    description = reader.get(top, "description", string, "a string", "")
    fairlane_arms = _read_fairlane_arms(reader, top)
    if "fairlane_arms" in top and "policy" in top:
        reader.error_in(
            top, "policy", "give the policy in fairlane_arms (each arm's), or policy alone"
        )
    policy = read_policy(reader, top) if "fairlane_arms" not in top else None
    if fairlane_arms:
        policy = fairlane_arms[0].policy
    names = (DIRECT, *(a.name for a in fairlane_arms)) if fairlane_arms else OVERHEAD_ARMS
    allowed = (*names, *PEERS)
    rates = reader.get(
        top, "rates", _rates, f"a list of distinct requests/s > 0 (or {HALF_CAPACITY})", []
    )
    duration = reader.get(top, "duration_s", positive, "wall seconds > 0 per phase")
    connections = reader.get(
        top, "saturation_connections", integer_at_least(0), "an integer >= 0 (0: no saturation)", 32
    )
    warmup = reader.get(top, "warmup_requests", integer_at_least(0), "an integer >= 0", 200)
    c1 = reader.get(
        top, "concurrency1_requests", integer_at_least(0), "an integer >= 0 (0: no phase)", 0
    )
    overload = _read_overload(reader, top, rates or [])
    arms = reader.get(top, "arms", _names, "a list of distinct arm names", None)
    unknown = [a for a in arms or [] if a not in allowed]
    if unknown:
        reader.error_in(
            top, "arms", f"unknown arm(s) {', '.join(unknown)}: the arms are {', '.join(allowed)}"
        )
    if rates == [] and connections == 0:
        reader.error_in(top, "rates", "no phase to run: no rates and saturation_connections 0")
    if connections == 0 and (HALF_CAPACITY in (rates or []) or overload is not None):
        reader.error_in(
            top,
            "saturation_connections",
            f"{HALF_CAPACITY} and the overload need the saturation phase: must be > 0",
        )
    context = _TargetContext(
        rates=list(rates or []),
        fairlane=[a.name for a in fairlane_arms] if fairlane_arms else [FAIRLANE],
        concurrency1=bool(c1),
        overload=overload is not None,
    )
    targets = _read_targets(reader, top, context)
    if reader.errors or policy is None:
        return None
    return OverheadScenario(
        name=name,
        description=description,
        policy=policy,
        rates=tuple(rates),
        duration_s=float(duration),
        saturation_connections=connections,
        warmup_requests=warmup,
        arms=tuple(arms or names),
        targets=targets,
        path=reader.path,
        fairlane_arms=tuple(fairlane_arms),
        concurrency1_requests=c1,
        overload=overload,
    )


def _read_fairlane_arms(reader: FieldReader, top: Section) -> list[FairlaneArm]:
    field = top.get("fairlane_arms")
    if field is None:
        return []
    pairs = reader.pairs(field)
    if not pairs:
        reader.error(
            field,
            "must be a mapping of arm name -> {policy, api_key, seats, replicas, shared_state}",
        )
        return []
    arms = []
    for name, item in pairs:
        if not isinstance(name, str) or not name.strip() or name in (DIRECT, *PEERS):
            others = ", ".join((DIRECT, *PEERS))
            reader.error(item, f"an arm's name must be a non-empty string other than {others}")
            continue
        raw = reader.section(item, ARM_FIELDS)
        if raw is None:
            continue
        before = len(reader.errors)
        policy = read_policy(reader, raw)
        keys = reader.get(
            raw, "api_key", _keys, "a non-empty string or list of them", (DEFAULT_API_KEY,)
        )
        seats = reader.get(raw, "seats", integer_at_least(1), "an integer >= 1", None)
        replicas = reader.get(raw, "replicas", integer_at_least(1), "an integer >= 1", 1)
        shared = reader.get(raw, "shared_state", _boolean, "true or false", False)
        if len(reader.errors) == before:
            for key in sorted(set(keys) - _policy_keys(policy)):
                reader.error_in(raw, "api_key", f"no tenant of {policy} has the key {key!r}")
        if len(reader.errors) == before:
            arms.append(FairlaneArm(name, policy, keys, seats, replicas, shared))
    return arms


def _keys(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(key, str) and key.strip() for key in value):
        return None
    return tuple(value)


def _boolean(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _policy_keys(path: Path) -> set[str]:
    from extproc.policy import load_policy

    return {key for tenant in load_policy(path).tenants for key in tenant.api_keys}


def _read_overload(reader: FieldReader, top: Section, rates: list[Rate]) -> OverloadSpec | None:
    field = top.get("overload")
    if field is None or reader.value(field) is None:
        return None
    raw = reader.section(field, OVERLOAD_FIELDS)
    if raw is None:
        return None
    d = OverloadSpec()
    spec = OverloadSpec(
        factor=reader.get(raw, "factor", positive, "a number > 0", d.factor),
        duration_s=reader.get(raw, "duration_s", positive, "wall seconds > 0", d.duration_s),
        answer_within_ms=reader.get(
            raw, "answer_within_ms", positive, "milliseconds > 0", d.answer_within_ms
        ),
        timeout_s=reader.get(raw, "timeout_s", positive, "seconds > 0", d.timeout_s),
        max_connections=reader.get(
            raw, "max_connections", integer_at_least(1), "an integer >= 1", d.max_connections
        ),
        recovery_rate=reader.get(raw, "recovery_rate", positive, "one of the rates", None),
        recovery_window_s=reader.get(
            raw, "recovery_window_s", positive, "seconds > 0", d.recovery_window_s
        ),
        recovery_max_s=reader.get(raw, "recovery_max_s", positive, "seconds > 0", d.recovery_max_s),
    )
    numeric = [r for r in rates if not isinstance(r, str)]
    if spec.recovery_rate is not None and spec.recovery_rate not in numeric:
        reader.error_in(
            raw,
            "recovery_rate",
            f"{spec.recovery_rate:g} is not one of the numeric rates (its no-load p50 is the "
            "recovery's reference)",
        )
    if spec.recovery_rate is None and not numeric:
        reader.error_in(
            top, "overload", "the recovery needs a numeric rate (its no-load p50 is the reference)"
        )
    window, watch = spec.recovery_window_s, spec.recovery_max_s
    if window is not None and watch is not None and window > watch:
        reader.error_in(raw, "recovery_window_s", "must be <= recovery_max_s")
    return spec


@dataclass(frozen=True)
class _TargetContext:
    rates: list[Rate]
    fairlane: list[str]
    concurrency1: bool
    overload: bool


def _read_targets(
    reader: FieldReader, top: Section, context: _TargetContext
) -> tuple[OverheadTarget, ...]:
    field = top.get("targets")
    items = [] if field is None else reader.items(field)
    if items is None:
        reader.error_in(top, "targets", "must be a list")
        return ()
    targets = (_read_target(reader, item, context) for item in items)
    return tuple(t for t in targets if t is not None)


def _rate_text(rate: Rate) -> str:
    return rate if isinstance(rate, str) else f"{rate:g}"


def _read_target(
    reader: FieldReader, item: Field, context: _TargetContext
) -> OverheadTarget | None:
    raw = reader.section(item, ("name", "metric", "rate", "arm", "max", "min"))
    if raw is None:
        return None
    before = len(reader.errors)
    name = reader.get(raw, "name", text, "a non-empty string")
    metric = reader.get(raw, "metric", choice(*OVERHEAD_METRICS), f"one of {OVERHEAD_METRICS}")
    rate = reader.get(raw, "rate", _rate, f"one of the scenario's rates (or {HALF_CAPACITY})", None)
    arm = reader.get(raw, "arm", text, "a fairlane arm's name", None)
    if arm is not None and arm not in context.fairlane:
        reader.error_in(raw, "arm", f"{arm!r} is not a fairlane arm ({context.fairlane})")
    if metric in RATE_METRICS and rate is None and "rate" not in raw:
        reader.error_in(raw, "rate", f"required for {metric} (one of the rates)")
    if rate is not None and metric in SATURATION_METRICS:
        reader.error_in(raw, "rate", f"{metric} is measured at saturation: no rate")
    elif rate is not None and metric is not None and metric not in RATE_METRICS:
        reader.error_in(raw, "rate", f"{metric} is not measured at a rate: no rate")
    if rate is not None and metric in RATE_METRICS and rate not in context.rates:
        shown = [_rate_text(r) for r in context.rates]
        reader.error_in(raw, "rate", f"{_rate_text(rate)} is not one of the rates {shown}")
    if metric in C1_METRICS and not context.concurrency1:
        reader.error_in(raw, "metric", f"{metric} needs concurrency1_requests > 0")
    if metric in OVERLOAD_METRICS and not context.overload:
        reader.error_in(raw, "metric", f"{metric} needs the overload block")
    if ("max" in raw) == ("min" in raw):
        reader.error(item, "needs exactly one bound: max (<=) or min (>=)")
        return None
    op: Literal["max", "min"] = "max" if "max" in raw else "min"
    bound = reader.get(raw, op, number, "a number")
    if len(reader.errors) > before:
        return None
    return OverheadTarget(name, metric, float(bound), op, rate, arm)
