"""The ``kind: overhead`` scenario file: what ``fairlane bench overhead`` measures.

An overhead scenario is not a fleet simulation (no groups, no simulated seconds): it names
the policy the fairlane arm runs, the open-loop rates, the wall seconds per phase, the
closed-loop saturation phase and the targets. It is validated like the A/B scenarios (the
same reader: every mistake as ``file:line: field: message``, unknown fields are errors), so
a typo never silently changes what is measured.
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

OVERHEAD_ARMS = ("direct", "fairlane")
# added_*: fairlane minus direct at the target's ``rate``; saturation_*: the fairlane arm's
# closed-loop phase.
RATE_METRICS = ("added_p50_ms", "added_p99_ms")
SATURATION_METRICS = ("saturation_rps", "rps_per_service_core")
OVERHEAD_METRICS = (*RATE_METRICS, *SATURATION_METRICS)


@dataclass(frozen=True)
class OverheadTarget:
    name: str
    metric: str
    bound: float
    op: Literal["max", "min"]
    rate: float | None = None


@dataclass(frozen=True)
class OverheadScenario:
    name: str
    description: str
    policy: Path
    rates: tuple[float, ...]
    duration_s: float
    """Wall seconds per phase (not simulated: the gateway's own time is measured)."""
    saturation_connections: int
    """Closed-loop connections at saturation; 0 skips that phase."""
    warmup_requests: int
    arms: tuple[str, ...]
    targets: tuple[OverheadTarget, ...] = ()
    path: Path | None = None

    def with_overrides(
        self, duration_s: float | None = None, arms: list[str] | None = None
    ) -> OverheadScenario:
        """A copy with command-line overrides applied (and checked)."""
        where = str(self.path or self.name)
        changes: dict[str, Any] = {}
        if duration_s is not None:
            if not duration_s > 0:
                raise ScenarioError(f"{where}: --duration must be > 0, got {duration_s}")
            changes["duration_s"] = duration_s
        if arms is not None:
            unknown = [a for a in arms if a not in self.arms]
            if unknown or not arms:
                raise ScenarioError(
                    f"{where}: --arms: unknown arm(s) {', '.join(unknown) or '(none given)'}; "
                    f"the scenario has {', '.join(self.arms)}"
                )
            changes["arms"] = tuple(a for a in self.arms if a in arms)
        return dataclasses.replace(self, **changes)


def _rates(value: Any) -> list[float] | None:
    if not isinstance(value, list):
        return None
    numbers = [positive(v) for v in value]
    return None if any(n is None for n in numbers) else [float(n or 0) for n in numbers]


def _arms(value: Any) -> list[str] | None:
    if not isinstance(value, list) or not value:
        return None
    ok = all(isinstance(v, str) and v in OVERHEAD_ARMS for v in value)
    return value if ok and len(set(value)) == len(value) else None


OVERHEAD_FIELDS = (
    "kind",
    "name",
    "description",
    "policy",
    "rates",
    "duration_s",
    "saturation_connections",
    "warmup_requests",
    "arms",
    "targets",
)


def parse_overhead(document: Document) -> OverheadScenario:
    """Validate a ``kind: overhead`` document; one :class:`ScenarioError` for every problem."""
    return read_whole(document, _read_overhead)


def _read_overhead(reader: FieldReader, root: Field) -> OverheadScenario | None:
    top = reader.section(root, OVERHEAD_FIELDS)
    if top is None:
        return None
    name = reader.get(top, "name", text, "a non-empty string")
    description = reader.get(top, "description", string, "a string", "")
    policy = read_policy(reader, top)
    rates = reader.get(top, "rates", _rates, "a list of requests/s > 0", [])
    duration = reader.get(top, "duration_s", positive, "wall seconds > 0 per phase")
    connections = reader.get(
        top, "saturation_connections", integer_at_least(0), "an integer >= 0 (0: no saturation)", 32
    )
    warmup = reader.get(top, "warmup_requests", integer_at_least(0), "an integer >= 0", 200)
    arms = reader.get(top, "arms", _arms, f"a list of distinct arms out of {OVERHEAD_ARMS}", None)
    if rates == [] and connections == 0:
        reader.error_in(top, "rates", "no phase to run: no rates and saturation_connections 0")
    targets = _read_targets(reader, top, rates or [])
    if reader.errors:
        return None
    return OverheadScenario(
        name=name,
        description=description,
        policy=policy,
        rates=tuple(rates),
        duration_s=float(duration),
        saturation_connections=connections,
        warmup_requests=warmup,
        arms=tuple(arms or OVERHEAD_ARMS),
        targets=targets,
        path=reader.path,
    )


def _read_targets(
    reader: FieldReader, top: Section, rates: list[float]
) -> tuple[OverheadTarget, ...]:
    field = top.get("targets")
    items = [] if field is None else reader.items(field)
    if items is None:
        reader.error_in(top, "targets", "must be a list")
        return ()
    targets = (_read_target(reader, item, rates) for item in items)
    return tuple(t for t in targets if t is not None)


def _read_target(reader: FieldReader, item: Field, rates: list[float]) -> OverheadTarget | None:
    raw = reader.section(item, ("name", "metric", "rate", "max", "min"))
    if raw is None:
        return None
    before = len(reader.errors)
    name = reader.get(raw, "name", text, "a non-empty string")
    metric = reader.get(raw, "metric", choice(*OVERHEAD_METRICS), f"one of {OVERHEAD_METRICS}")
    rate = reader.get(raw, "rate", positive, "one of the scenario's rates", None)
    if metric in RATE_METRICS and rate is None and "rate" not in raw:
        reader.error_in(raw, "rate", f"required for {metric} (one of the rates)")
    if rate is not None and metric in SATURATION_METRICS:
        reader.error_in(raw, "rate", f"{metric} is measured at saturation: no rate")
    if rate is not None and metric in RATE_METRICS and rate not in rates:
        shown = [f"{r:g}" for r in rates]
        reader.error_in(raw, "rate", f"{rate:g} is not one of the rates {shown}")
    if ("max" in raw) == ("min" in raw):
        reader.error(item, "needs exactly one bound: max (<=) or min (>=)")
        return None
    op: Literal["max", "min"] = "max" if "max" in raw else "min"
    bound = reader.get(raw, op, number, "a number")
    if len(reader.errors) > before:
        return None
    return OverheadTarget(name, metric, float(bound), op, rate)
