"""The scenario's targets checked against the arms' summaries.

A target compares one metric of one arm (over a tier, tenant or group, or Jain's index over
tenants, or a fleet metric), optionally as a ratio to a baseline arm, with a bound. A target
that cannot be evaluated (an arm not run, no data) is N/A, never a pass; a verdict computed
from an arm with CPU warnings is kept but marked suspect. Targets sharing an ``either``
label are alternatives: each is judged on its own, and its note says whether the set was
met (any one passed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from loadtests.bench.results import ArmResult, ArmSummary, TargetResult
from loadtests.bench.scenario import ARM_METRICS, Target
from loadtests.bench.stats import jain_index


def metric_value(
    summary: ArmSummary, target: Target, weights: Mapping[str, float] | None = None
) -> float | None:
    """``target.metric`` in one arm's summary (None when there is no data for it)."""
    if target.metric in ARM_METRICS:
        cache = {} if summary.prefix_cache is None else summary.prefix_cache.to_json()
        value = cache.get(target.metric)  # named as in results.json: prefix_hit_rate
        return None if value is None else float(value)
    if target.metric == "jain":
        tenants = summary.by_tenant
        weights = weights or {}
        values = [
            (tenants[t].service_tokens if t in tenants else 0) / weights.get(t, 1.0)
            for t in target.tenants
        ]
        return jain_index(values)
    for key, table in (
        ("tier", summary.by_tier),
        ("tenant", summary.by_tenant),
        ("group", summary.by_group),
    ):
        selected = getattr(target, key)
        if selected is not None:
            figures = table.get(selected)
            if figures is None:
                return None
            value = figures.metric(target.metric)
            return None if value is None else float(value)
    return None


def evaluate(
    targets: Sequence[Target],
    summaries: Mapping[str, ArmSummary],
    weights: Mapping[str, float] | None = None,
) -> list[TargetResult]:
    results = []
    for t in targets:
        missing = [a for a in (t.arm, t.baseline_arm) if a is not None and a not in summaries]
        if missing:
            results.append(
                TargetResult(t, None, None, None, None, f"arm {', '.join(missing)} not run")
            )
            continue
        value = metric_value(summaries[t.arm], t, weights)
        baseline = None
        measured = value
        if t.baseline_arm is not None:
            asked = (
                t if t.baseline_metric is None else dataclasses.replace(t, metric=t.baseline_metric)
            )
            baseline = metric_value(summaries[t.baseline_arm], asked, weights)
            if value is not None and baseline:
                measured = (value - t.allowance_s) / baseline
            else:
                measured = None
        if measured is None:
            results.append(TargetResult(t, value, baseline, None, None, "no data"))
            continue
        passed = measured <= t.bound if t.op == "max" else measured >= t.bound
        results.append(TargetResult(t, value, baseline, measured, passed))
    return _with_either(results)


def _with_either(results: list[TargetResult]) -> list[TargetResult]:
    """Each alternative (targets sharing an ``either`` label) keeps its own verdict and
    gets the set's in its note: met when any passed, undecided when none passed but one
    could not be evaluated, else not met."""
    sets: dict[str, list[bool | None]] = {}
    for r in results:
        if r.target.either is not None:
            sets.setdefault(r.target.either, []).append(r.passed)
    marked = []
    for r in results:
        label = r.target.either
        if label is not None:
            verdicts = sets[label]
            outcome = "met" if True in verdicts else "undecided" if None in verdicts else "not met"
            note = "; ".join(n for n in (r.note, f"either {label!r}: {outcome}") if n)
            r = dataclasses.replace(r, note=note)
        marked.append(r)
    return marked


def mark_suspect(result: TargetResult, arms: Mapping[str, ArmResult]) -> TargetResult:
    """A verdict computed from an arm with CPU warnings (client stalled, machine saturated)
    is kept but flagged: it may say more about the machine than about the scheduler."""
    target = result.target
    noisy = [
        a
        for a in (target.arm, target.baseline_arm)
        if a is not None and a in arms and arms[a].cpu.warnings
    ]
    note = result.note
    if noisy:
        flag = f"suspect: CPU warnings in {', '.join(noisy)}; rerun on a quieter machine"
        note = "; ".join(n for n in (note, flag) if n)
    return dataclasses.replace(result, suspect=bool(noisy), note=note)
