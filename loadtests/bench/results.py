"""What a bench run produced, typed: per-arm summaries, per-tier figures, CPU, targets.

The runner (``cli``) builds these, and the report, the plots and the frontier tool read
them. ``results.json`` is their :meth:`~BenchResults.to_json` (plus every request record),
a shape other tools and the benchmark pages read, so each class writes exactly the keys it always
had, in the same order, and reads them back with ``from_json``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from loadtests.bench.cachestats import PrefixWindow
from loadtests.bench.cpu import CpuUsage
from loadtests.bench.replica_flows import ReplicaFlows
from loadtests.bench.scenario import Target

TENANT_ONLY = ("share", "plain_share")
"""Figures a tenant has and a tier, a group or the whole arm does not."""


@dataclass(frozen=True)
class Figures:
    """One set of requests' figures: a tier's, a tenant's, a group's or the whole arm's.

    Times are simulated seconds; latency percentiles are over the successful requests that
    started in the measured window (see :mod:`loadtests.bench.stats`)."""

    sent: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    """Failed requests by HTTP status (``"0"``: no response), unfinished ones left out."""
    unfinished: int = 0
    measured: int = 0
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    ttft_p95: float | None = None
    ttft_p99: float | None = None
    e2e_p50: float | None = None
    e2e_p90: float | None = None
    e2e_p95: float | None = None
    e2e_p99: float | None = None
    goodput: float = 0.0
    throughput: float = 0.0
    service_tokens: int = 0
    plain_tokens: int = 0
    wait_max: float | None = None
    wait_p99: float | None = None
    queue_wait_max: float | None = None
    queue_wait_p99: float | None = None
    share: float | None = None
    """Tenants only: the tenant's share of the service (input + 2 x output tokens)."""
    plain_share: float | None = None
    """Tenants only: the same share counted in plain input + output tokens."""
    tokens_per_wall_min: float = 0.0
    """Plain input + output tokens of the requests completed in the window, per **wall**
    minute: what a budget (``tokens_per_minute``, on the gateway's wall clock) bounds."""
    rate_limited: int = 0
    """Requests refused with 429 ``rate_limit_exceeded`` (a budget spent)."""
    rate_limit_headers_ok: float | None = None
    """Of those, the share that carried ``retry-after`` and OpenAI's ``x-ratelimit-*``
    headers (None: none was refused)."""
    error_share: float = 0.0
    """Requests that failed (any status but 200, unfinished ones left out), per sent."""

    def metric(self, name: str) -> Any:
        """A figure by the name a target or a report row uses (None: not one of these)."""
        return getattr(self, name, None)

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in TENANT_ONLY:
            if data[key] is None:
                del data[key]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Figures:
        return cls(**{**data, "errors": dict(data["errors"])})


def _table_json(table: dict[str, Figures]) -> dict[str, Any]:
    return {name: figures.to_json() for name, figures in table.items()}


def _table_from_json(data: dict[str, Any]) -> dict[str, Figures]:
    return {name: Figures.from_json(figures) for name, figures in data.items()}


@dataclass(frozen=True)
class ArmSummary:
    """One arm's figures over the whole fleet, and per tier, tenant and group."""

    total: Figures = field(default_factory=Figures)
    by_tier: dict[str, Figures] = field(default_factory=dict)
    by_tenant: dict[str, Figures] = field(default_factory=dict)
    by_group: dict[str, Figures] = field(default_factory=dict)
    prefix_cache: PrefixWindow | None = None
    """The fleet's prefix-cache traffic over the window (None: not scraped)."""

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "total": self.total.to_json(),
            "by_tier": _table_json(self.by_tier),
            "by_tenant": _table_json(self.by_tenant),
            "by_group": _table_json(self.by_group),
        }
        if self.prefix_cache is not None:
            data["prefix_cache"] = self.prefix_cache.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ArmSummary:
        cache = data.get("prefix_cache")
        return cls(
            total=Figures.from_json(data["total"]),
            by_tier=_table_from_json(data["by_tier"]),
            by_tenant=_table_from_json(data["by_tenant"]),
            by_group=_table_from_json(data["by_group"]),
            prefix_cache=None if cache is None else PrefixWindow.from_json(cache),
        )


@dataclass(frozen=True)
class ArmResult:
    """One arm as it ran: what it was, its processes, their CPU, and its figures."""

    kind: str
    balanced: bool
    groups: list[str]
    pids: dict[str, int]
    capped: bool
    """The request cap was hit: the workload was cut short."""
    wall_s: float
    cpu: CpuUsage
    summary: ArmSummary
    replica_flows: ReplicaFlows = field(default_factory=dict)
    """Replica arms: which replica admitted how many of each flow's requests
    (``replica_flows``); empty for one service or none."""
    prefix_matches: dict[str, int] = field(default_factory=dict)
    """Fairlane arms: grants by the prefix index that judged them (``precise`` /
    ``approximate``), over the whole arm, from the gateway's own counter."""
    prefix_predicted_tokens: dict[str, int] = field(default_factory=dict)
    """Fairlane arms: prompt tokens each index said the chosen engines held, whole arm."""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "balanced": self.balanced,
            "groups": list(self.groups),
            "pids": dict(self.pids),
            "capped": self.capped,
            "wall_s": self.wall_s,
            "cpu": self.cpu.to_json(),
            "summary": self.summary.to_json(),
            "replica_flows": {r: dict(c) for r, c in self.replica_flows.items()},
            "prefix_matches": dict(self.prefix_matches),
            "prefix_predicted_tokens": dict(self.prefix_predicted_tokens),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ArmResult:
        return cls(
            kind=data["kind"],
            balanced=data["balanced"],
            groups=list(data["groups"]),
            pids=dict(data["pids"]),
            capped=data["capped"],
            wall_s=data["wall_s"],
            cpu=CpuUsage.from_json(data["cpu"]),
            summary=ArmSummary.from_json(data["summary"]),
            replica_flows={r: dict(c) for r, c in data.get("replica_flows", {}).items()},
            prefix_matches=dict(data.get("prefix_matches", {})),
            prefix_predicted_tokens=dict(data.get("prefix_predicted_tokens", {})),
        )


@dataclass(frozen=True)
class TargetResult:
    """One target checked against the arms."""

    target: Target
    value: float | None
    baseline: float | None
    measured: float | None
    """The value compared with the bound: value / baseline when there is a baseline arm."""
    passed: bool | None
    """None when it could not be evaluated (an arm not run, no data)."""
    note: str = ""
    suspect: bool | None = None
    """Set by the runner: an arm it was computed from had CPU warnings (None: not looked)."""

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "N/A"}[self.passed]

    def line(self) -> str:
        t = self.target
        sign = "<=" if t.op == "max" else ">="
        what = "ratio" if t.baseline_arm else "value"
        measured = "-" if self.measured is None else f"{self.measured:.3g}"
        extra = f" ({self.note})" if self.note else ""
        return f"{self.verdict} {t.name}: {what} {measured} {sign} {t.bound:g}{extra}"

    def to_json(self) -> dict[str, Any]:
        t = self.target
        data: dict[str, Any] = {
            "name": t.name,
            "metric": t.metric,
            "arm": t.arm,
            "baseline_arm": t.baseline_arm,
            "tier": t.tier,
            "tenant": t.tenant,
            "group": t.group,
            "tenants": list(t.tenants),
            "op": t.op,
            "bound": t.bound,
            "value": self.value,
            "baseline": self.baseline,
            "measured": self.measured,
            "passed": self.passed,
            "note": self.note,
        }
        if t.either is not None:
            data["either"] = t.either
        if t.baseline_metric is not None:
            data["baseline_metric"] = t.baseline_metric
        if t.allowance_s:
            data["allowance_s"] = t.allowance_s
        if self.suspect is not None:
            data["suspect"] = self.suspect
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TargetResult:
        op: Literal["max", "min"] = "max" if data["op"] == "max" else "min"
        target = Target(
            name=data["name"],
            metric=data["metric"],
            arm=data["arm"],
            bound=data["bound"],
            op=op,
            tier=data["tier"],
            tenant=data["tenant"],
            group=data["group"],
            tenants=tuple(data["tenants"]),
            baseline_arm=data["baseline_arm"],
            either=data.get("either"),
            baseline_metric=data.get("baseline_metric"),
            allowance_s=data.get("allowance_s", 0.0),
        )
        return cls(
            target,
            data["value"],
            data["baseline"],
            data["measured"],
            data["passed"],
            data["note"],
            data.get("suspect"),
        )


@dataclass(frozen=True)
class BenchResults:
    """A whole run: the scenario as run, every arm that ran, the ones that failed, the
    targets. ``scenario`` stays the plain mapping written to ``results.json``
    (``cli.scenario_json``): it echoes the file, the report only prints it."""

    scenario: dict[str, Any]
    arms: dict[str, ArmResult] = field(default_factory=dict)
    failed_arms: dict[str, str] = field(default_factory=dict)
    """Arms that could not run: the error, by arm."""
    targets: list[TargetResult] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "arms": {name: arm.to_json() for name, arm in self.arms.items()},
            "failed_arms": dict(self.failed_arms),
            "targets": [t.to_json() for t in self.targets],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchResults:
        return cls(
            scenario=data["scenario"],
            arms={name: ArmResult.from_json(arm) for name, arm in data["arms"].items()},
            failed_arms=dict(data["failed_arms"]),
            targets=[TargetResult.from_json(t) for t in data["targets"]],
        )
