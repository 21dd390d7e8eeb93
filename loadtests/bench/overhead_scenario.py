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

from loadtests.bench.scenario import (
    Document,
    ScenarioError,
    _choice,
    _int,
    _number,
    _pos,
    _Reader,
    _str,
    _text,
)

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
    numbers = [_pos(v) for v in value]
    return None if any(n is None for n in numbers) else [float(n or 0) for n in numbers]


def _arms(value: Any) -> list[str] | None:
    if not isinstance(value, list) or not value:
        return None
    ok = all(isinstance(v, str) and v in OVERHEAD_ARMS for v in value)
    return value if ok and len(set(value)) == len(value) else None


class _OverheadReader(_Reader):
    def overhead(self, data: Any) -> OverheadScenario | None:
        allowed = (
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
        top = self.mapping(data, "", allowed)
        if top is None:
            return None
        name = self.get(top, "", "name", _text, "a non-empty string")
        description = self.get(top, "", "description", _str, "a string", "")
        policy = self.policy(top)
        rates = self.get(top, "", "rates", _rates, "a list of requests/s > 0", [])
        duration = self.get(top, "", "duration_s", _pos, "wall seconds > 0 per phase")
        connections = self.get(
            top, "", "saturation_connections", _int(0), "an integer >= 0 (0: no saturation)", 32
        )
        warmup = self.get(top, "", "warmup_requests", _int(0), "an integer >= 0", 200)
        arms = self.get(
            top, "", "arms", _arms, f"a list of distinct arms out of {OVERHEAD_ARMS}", None
        )
        if rates == [] and connections == 0:
            self.error("rates", "no phase to run: no rates and saturation_connections 0")
        targets = self.overhead_targets(top.get("targets", []), rates or [])
        if self.errors:
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
            path=self.path,
        )

    def overhead_targets(self, data: Any, rates: list[float]) -> tuple[OverheadTarget, ...]:
        if not isinstance(data, list):
            self.error("targets", "must be a list")
            return ()
        targets = []
        for i, item in enumerate(data):
            where = f"targets[{i}]"
            raw = self.mapping(item, where, ("name", "metric", "rate", "max", "min"))
            if raw is None:
                continue
            before = len(self.errors)
            name = self.get(raw, where, "name", _text, "a non-empty string")
            metric = self.get(
                raw, where, "metric", _choice(*OVERHEAD_METRICS), f"one of {OVERHEAD_METRICS}"
            )
            rate = self.get(raw, where, "rate", _pos, "one of the scenario's rates", None)
            if metric in RATE_METRICS and rate is None and "rate" not in raw:
                self.error(f"{where}.rate", f"required for {metric} (one of the rates)")
            if rate is not None and metric in SATURATION_METRICS:
                self.error(f"{where}.rate", f"{metric} is measured at saturation: no rate")
            if rate is not None and metric in RATE_METRICS and rate not in rates:
                self.error(
                    f"{where}.rate", f"{rate:g} is not one of the rates {[f'{r:g}' for r in rates]}"
                )
            if ("max" in raw) == ("min" in raw):
                self.error(where, "needs exactly one bound: max (<=) or min (>=)")
                continue
            op: Literal["max", "min"] = "max" if "max" in raw else "min"
            bound = self.get(raw, where, op, _number, "a number")
            if len(self.errors) == before:
                targets.append(OverheadTarget(name, metric, float(bound), op, rate))
        return tuple(targets)


def parse_overhead(document: Document) -> OverheadScenario:
    """Validate a ``kind: overhead`` document; one :class:`ScenarioError` for every problem."""
    reader = _OverheadReader(document.path)
    scenario = reader.overhead(document.data)
    if reader.errors or scenario is None:
        raise reader.failure(document.node)
    return scenario
