"""What a ``kind: des`` run reports: ``results.json`` (the contract), ``report.md``, a plot.

``results.json`` always holds ``decision_us_per_request`` (``"ENGINESxTENANTS"`` -> mean
CPU microseconds of the core's request-path calls per request), ``jain_backlogged`` and
``max_batch_wait_s``; the rest is there to read the run by.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.bench.stats import jain_index
from loadtests.des.model import DesScenario
from loadtests.des.run import Measured

PERCENTILES = (50, 90, 99)


def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, math.ceil(p / 100 * len(sorted_values)) - 1))
    return sorted_values[index]


def aging_bound_s(policy_tiers: Sequence[Any]) -> float | None:
    """How long a batch request waits before aging has lifted it as far as it may (to rank
    with the tier above): ``aging_cap / aging_rate`` of the least urgent tier (None: it does
    not age). This bounds when batch competes with api, not when it is served: a backlogged
    tier that asks for more than the fleet's capacity waits longer."""
    batch = policy_tiers[-1]
    rate = float(getattr(batch, "aging_rate", 0.0))
    cap = float(getattr(batch, "aging_cap", 0.0))
    if rate <= 0 or cap <= 0:
        return None
    return cap / rate


def backlogged_tenants(scenario: DesScenario) -> list[str]:
    """The tenants fairness is judged on: the batch-tier closed loops' (equal weights, more
    asked than the fleet's idle capacity gives them), or every closed loop's when none is
    batch. Power users at the api tier are served ahead of batch and are not backlogged, so
    mixing them in would measure their demand, not the scheduler's fairness."""
    loops = [c for c in scenario.closed_loops if c.tier == "batch"] or list(scenario.closed_loops)
    return sorted(f"{c.name}{i}" for c in loops for i in range(c.count))


def ttft_summary(by_tier: Mapping[str, Sequence[float]]) -> dict[str, dict[str, Any]]:
    """Tier -> count and TTFT percentiles."""
    ttft = {}
    for tier, values in sorted(by_tier.items()):
        ordered = sorted(values)
        ttft[tier] = {"n": len(ordered), **{f"p{p}": percentile(ordered, p) for p in PERCENTILES}}
    return ttft


def outage_summary(scenario: DesScenario, measured: Measured) -> dict[str, Any] | None:
    """Per phase of the region outage (by arrival): TTFT per tier and every status, so that
    what losing a region costs chat, API and batch while it is down and after it is back
    can be read side by side."""
    stats = measured.stats
    outage = scenario.outage
    if outage is None or stats.outage is None:
        return None
    phases: dict[str, Any] = {}
    for phase in ("before", "during", "after"):
        statuses: dict[str, dict[str, int]] = {}
        for (p, tier, status), n in sorted(stats.statuses_by_phase.items()):
            if p == phase:
                statuses.setdefault(tier, {})[str(status)] = n
        failed = sum(n for t in statuses.values() for code, n in t.items() if code != "200")
        phases[phase] = {
            "ttft_s": ttft_summary(stats.ttft_by_phase.get(phase, {})),
            "statuses": statuses,
            "failed": failed,
        }
    return {
        "region": outage.region,
        "from_s": stats.outage[0],
        "to_s": stats.outage[1],
        "lost_in_flight": stats.lost,
        "phases": phases,
    }


def run_summary(scenario: DesScenario, measured: Measured, aging_s: float | None) -> dict[str, Any]:
    stats = measured.stats
    ttft = ttft_summary(stats.ttft)
    backlogged = backlogged_tenants(scenario)
    served = [float(stats.served[t]) for t in backlogged]
    jain = jain_index(served) if served and any(served) else None
    mean = sum(served) / len(served) if served else 0.0
    worst = min(served) / mean if served and mean else None
    by_loop = {}
    for closed in scenario.closed_loops:
        group = [float(stats.served[f"{closed.name}{i}"]) for i in range(closed.count)]
        by_loop[closed.name] = jain_index(group) if any(group) else None
    statuses: dict[str, dict[str, int]] = {}
    for (tier, status), n in sorted(stats.statuses.items()):
        statuses.setdefault(tier, {})[str(status)] = n
    return {
        "name": scenario.name,
        "engines": scenario.fleet.engines,
        "tenants": scenario.open_loop.tenants + sum(c.count for c in scenario.closed_loops),
        "sent": stats.sent,
        "measured": stats.measured,
        "ttft_s": ttft,
        "statuses": statuses,
        "outage": outage_summary(scenario, measured),
        "preempted": stats.preempted,
        "max_wait_s": dict(stats.wait_max),
        "max_batch_wait_s": stats.wait_max.get("batch", 0.0),
        "aging_bound_s": aging_s,
        "backlogged_tokens": dict(zip(backlogged, served, strict=True)),
        "jain_backlogged": jain,
        "jain_by_closed_loop": by_loop,
        "worst_share_of_fair": worst,
        "decision_us": measured.decision_us,
        "cpu_us_per_call": {
            k: measured.cpu_ns[k] / 1000 / measured.calls[k]
            for k in measured.cpu_ns
            if measured.calls.get(k)
        },
        "calls": measured.calls,
        "tracked_flows_at_end": measured.flows,
        "wall_s": measured.wall_s,
        "requests_per_wall_s": stats.sent / measured.wall_s if measured.wall_s else None,
        "events": measured.events,
        "engine_steps": measured.engine_steps,
        "engine_steps_fast_forwarded": measured.engine_steps_skipped,
    }


def write(
    out: Path,
    scenario: DesScenario,
    main: dict[str, Any],
    sweep: Mapping[str, dict[str, Any]],
    memory: Mapping[str, float],
    by_models: Mapping[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``out/results.json``, ``out/report.md`` and ``out/decision-cost.png`` (the plot only
    with a sweep)."""
    out.mkdir(parents=True, exist_ok=True)
    decision = {key: run["decision_us"] for key, run in sweep.items()}
    if not decision:  # no sweep: the run's own point
        decision[f"{scenario.fleet.engines}x{scenario.open_loop.tenants}"] = main["decision_us"]
    results = {
        "scenario": scenario.name,
        "kind": "des",
        "decision_us_per_request": decision,
        "jain_backlogged": main["jain_backlogged"],
        "max_batch_wait_s": main["max_batch_wait_s"],
        "memory_bytes": dict(memory),
        "run": main,
        "sweep": dict(sweep),
        "model_sweep": dict(by_models or {}),
        "model_sweep_ratio": model_ratios(by_models or {}),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    (out / "report.md").write_text(markdown(results))
    if sweep:
        plot(out / "decision-cost.png", sweep)
    return results


MODEL_SCALE_TARGET = 1.2
"""A fleet of many model pools keeps the decision cost within this of one pool's."""


def model_ratios(by_models: Mapping[str, dict[str, Any]]) -> dict[str, float]:
    """Each ``models x engines`` point's decision cost over the smallest one-model point's
    (the one pool the others are judged against); empty without such a point."""
    singles = [key for key in by_models if key.startswith("1x")]
    if not singles:
        return {}
    base = min(singles, key=lambda key: int(key.split("x")[1]))
    cost = by_models[base]["decision_us"]
    return {key: run["decision_us"] / cost for key, run in by_models.items() if key != base}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s"


def markdown(results: Mapping[str, Any]) -> str:
    run = results["run"]
    lines = [
        f"# `{results['scenario']}` (discrete-event simulation)",
        "",
        f"{run['engines']} engines, {run['tenants']:,} tenants, {run['sent']:,} requests sent "
        f"({run['measured']:,} after the warm-up); {run['wall_s']:.1f} s of wall time, "
        f"{run['events']:,} events, {run['engine_steps']:,} engine steps.",
        "",
        "| tier | requests | TTFT p50 | p90 | p99 | longest gateway wait |",
        "|---|---|---|---|---|---|",
    ]
    for tier, t in run["ttft_s"].items():
        lines.append(
            f"| {tier} | {t['n']:,} | {_ms(t['p50'])} | {_ms(t['p90'])} | {_ms(t['p99'])} "
            f"| {_ms(run['max_wait_s'].get(tier))} |"
        )
    jain = run["jain_backlogged"]
    worst = run["worst_share_of_fair"]
    lines += [
        "",
        f"Backlogged equal tenants: Jain's index **{jain:.4f}**, the worst one got "
        f"{worst:.1%} of its fair share."
        if jain is not None and worst is not None
        else "No backlogged tenants.",
        f"Longest batch wait: {_ms(run['max_batch_wait_s'])} (aging bound "
        f"{_ms(run['aging_bound_s'])}).",
        "",
        "## Decision cost (CPU of the core's request path, per request)",
        "",
        "| engines x tenants | µs per request | handle | completed | dispatch calls | wall |",
        "|---|---|---|---|---|---|",
    ]
    for key, s in results["sweep"].items():
        per = s["cpu_us_per_call"]
        lines.append(
            f"| {key} | **{s['decision_us']:.0f}** | {per.get('handle', 0):.0f} "
            f"| {per.get('completed', 0):.0f} | {s['calls'].get('dispatch', 0):,} "
            f"| {s['wall_s']:.0f} s |"
        )
    if results.get("model_sweep"):
        lines += [
            "",
            "## Decision cost as the fleet becomes many model pools",
            "",
            "Same load and tenants per engine; ratio against the one-pool point "
            f"(target: at most {MODEL_SCALE_TARGET}x for several models).",
            "",
            "| models x engines | µs per request | ratio | target |",
            "|---|---|---|---|",
        ]
        ratios = results["model_sweep_ratio"]
        for key, s in results["model_sweep"].items():
            ratio = ratios.get(key)
            several = not key.startswith("1x")
            verdict = "-"
            if ratio is not None and several:
                verdict = "met" if ratio <= MODEL_SCALE_TARGET else "**not met**"
            shown = "1.00x (base)" if ratio is None else f"{ratio:.2f}x"
            lines.append(f"| {key} | **{s['decision_us']:.0f}** | {shown} | {verdict} |")
    outage = run.get("outage")
    if outage:
        lines += [
            "",
            f"## Region {outage['region']} down from {outage['from_s']:.0f} s to "
            f"{outage['to_s']:.0f} s",
            "",
            f"{outage['lost_in_flight']:,} requests were on its engines when it went down.",
            "",
            "| arrived | tier | requests | TTFT p50 | p90 | p99 | not 200 |",
            "|---|---|---|---|---|---|---|",
        ]
        for phase, figures in outage["phases"].items():
            for tier, t in figures["ttft_s"].items():
                failed = sum(
                    n for code, n in figures["statuses"].get(tier, {}).items() if code != "200"
                )
                lines.append(
                    f"| {phase} | {tier} | {t['n']:,} | {_ms(t['p50'])} | {_ms(t['p90'])} "
                    f"| {_ms(t['p99'])} | {failed:,} |"
                )
    memory = results["memory_bytes"]
    lines += ["", "## Memory", ""]
    for key, value in memory.items():
        lines.append(f"- {key}: {value:,.0f} bytes")
    lines.append("")
    return "\n".join(lines)


def plot(path: Path, sweep: Mapping[str, dict[str, Any]]) -> None:
    """Decision cost against fleet size and tenant count (one point per sweep run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    keys = list(sweep)
    values = [sweep[k]["decision_us"] for k in keys]
    ax.plot(range(len(keys)), values, marker="o")
    ax.set_xticks(range(len(keys)), keys)
    ax.set_xlabel("engines x tenants")
    ax.set_ylabel("CPU µs per request (core's calls)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
