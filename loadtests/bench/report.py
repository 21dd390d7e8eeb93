"""Statistics over the request records, the scenario's targets, and the two output files.

All latencies are in **simulated seconds** (the client records wall seconds x speedup), so
figures compare with a real GPU fleet's, not with the wall clock of this run. Which
requests count:

* latency percentiles (TTFT, end-to-end): successful requests that *started* inside the
  measured window ``[warmup_s, duration_s)``;
* goodput and service (token) shares: successful requests that *finished* inside it, per
  simulated second of the window;
* waits: every request. A request's wait is its TTFT, or, if it never got a first token
  (shed, failed, still running at the end), how long it had been waiting: a starved request
  is the one that matters for starvation and must not drop out of the maximum;
* the gateway queue wait is ``x-fairlane-queue-ms`` x speedup (FIFO has no gateway queue);
* throughput: successful requests that *finished* inside the window, per simulated second;
* the prefix-cache hit rate is the fleet's, from the backends' counters scraped at the
  window's start and end (``cachestats``), in ``summary["prefix_cache"]``.

Pure functions on plain data, except :func:`write` (files).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests.bench.client import RequestRecord
from loadtests.bench.scenario import ARM_METRICS, Scenario, Target

OUTPUT_WEIGHT = 2  # service = input tokens + 2 x output tokens (the VTC cost of the design)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index (Σx)² / (n·Σx²): 1 when all equal, 1/n when one gets all."""
    if not values:
        return None
    square_sum = sum(v * v for v in values)
    if square_sum == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * square_sum)


def service_tokens(record: RequestRecord) -> int:
    return record.prompt_tokens + OUTPUT_WEIGHT * record.completion_tokens


def wait_s(record: RequestRecord) -> float | None:
    """Time to first token, or how long a request that never got one had waited."""
    if record.ok:
        return record.ttft_s
    if record.end_s is not None:
        return record.end_s - record.start_s
    return None


@dataclass(frozen=True)
class Window:
    start_s: float
    end_s: float

    @property
    def length_s(self) -> float:
        return max(self.end_s - self.start_s, 1e-9)

    def started(self, r: RequestRecord) -> bool:
        return self.start_s <= r.start_s < self.end_s

    def finished(self, r: RequestRecord) -> bool:
        return r.end_s is not None and self.start_s <= r.end_s <= self.end_s


def _pcts(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    return {f"{prefix}_p{q}": percentile(values, q) for q in (50, 90, 95, 99)}


def selection_stats(
    records: Sequence[RequestRecord], window: Window, speedup: float
) -> dict[str, Any]:
    """Counts, latency percentiles, goodput, service and waits of one set of requests."""
    measured_ok = [r for r in records if r.ok and window.started(r)]
    done = [r for r in records if r.ok and window.finished(r)]
    waits = [w for r in records if (w := wait_s(r)) is not None]
    queue = [r.queue_ms * speedup / 1000.0 for r in records if r.queue_ms is not None]
    errors = Counter(str(r.status) for r in records if not r.ok and not r.unfinished)
    stats: dict[str, Any] = {
        "sent": len(records),
        "ok": sum(r.ok for r in records),
        "errors": dict(sorted(errors.items())),
        "unfinished": sum(r.unfinished for r in records),
        "measured": len(measured_ok),
        **_pcts([r.ttft_s for r in measured_ok if r.ttft_s is not None], "ttft"),
        **_pcts([r.e2e_s for r in measured_ok if r.e2e_s is not None], "e2e"),
        "goodput": sum(r.completion_tokens for r in done) / window.length_s,
        "throughput": len(done) / window.length_s,
        "service_tokens": sum(service_tokens(r) for r in done),
        "plain_tokens": sum(r.prompt_tokens + r.completion_tokens for r in done),
        "wait_max": max(waits) if waits else None,
        "wait_p99": percentile(waits, 99),
        "queue_wait_max": max(queue) if queue else None,
        "queue_wait_p99": percentile(queue, 99),
    }
    return stats


def _by(
    records: Iterable[RequestRecord], key: Callable[[RequestRecord], str]
) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    return groups


def arm_summary(scenario: Scenario, records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Per tier, per tenant and per group statistics of one arm, plus token shares."""
    window = Window(scenario.warmup_s, scenario.duration_s)
    speedup = scenario.speedup
    by_tier = _by(records, lambda r: r.tier)
    by_tenant = _by(records, lambda r: r.tenant)
    by_group = _by(records, lambda r: r.group)
    summary: dict[str, Any] = {
        "total": selection_stats(records, window, speedup),
        "by_tier": {
            t: selection_stats(by_tier[t], window, speedup) for t in scenario.tiers if t in by_tier
        },
        "by_tenant": {
            t: selection_stats(by_tenant[t], window, speedup)
            for t in scenario.tenants
            if t in by_tenant
        },
        "by_group": {
            g.name: selection_stats(by_group[g.name], window, speedup)
            for g in scenario.groups
            if g.name in by_group
        },
    }
    total_service = summary["total"]["service_tokens"] or 0
    total_plain = summary["total"]["plain_tokens"] or 0
    for stats in summary["by_tenant"].values():
        stats["share"] = stats["service_tokens"] / total_service if total_service else 0.0
        stats["plain_share"] = stats["plain_tokens"] / total_plain if total_plain else 0.0
    return summary


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class TargetResult:
    target: Target
    value: float | None
    baseline: float | None
    measured: float | None
    """The value compared with the bound: value / baseline when there is a baseline arm."""
    passed: bool | None
    """None when it could not be evaluated (an arm not run, no data)."""
    note: str = ""

    def line(self) -> str:
        t = self.target
        verdict = {True: "PASS", False: "FAIL", None: "N/A"}[self.passed]
        sign = "<=" if t.op == "max" else ">="
        what = "ratio" if t.baseline_arm else "value"
        measured = "-" if self.measured is None else f"{self.measured:.3g}"
        extra = f" ({self.note})" if self.note else ""
        return f"{verdict} {t.name}: {what} {measured} {sign} {t.bound:g}{extra}"

    def to_json(self) -> dict[str, Any]:
        t = self.target
        return {
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


def metric_value(
    summary: Mapping[str, Any], target: Target, weights: Mapping[str, float] | None = None
) -> float | None:
    """``target.metric`` in one arm's summary (None when there is no data for it)."""
    if target.metric in ARM_METRICS:
        value = (summary.get("prefix_cache") or {}).get(target.metric)
        return None if value is None else float(value)
    if target.metric == "jain":
        tenants = summary["by_tenant"]
        weights = weights or {}
        values = [
            (tenants[t]["service_tokens"] if t in tenants else 0) / weights.get(t, 1.0)
            for t in target.tenants
        ]
        return jain_index(values)
    for key, table in (("tier", "by_tier"), ("tenant", "by_tenant"), ("group", "by_group")):
        selected = getattr(target, key)
        if selected is not None:
            stats = summary[table].get(selected)
            if stats is None:
                return None
            value = stats.get(target.metric)
            return None if value is None else float(value)
    return None


def evaluate(
    targets: Sequence[Target],
    summaries: Mapping[str, Mapping[str, Any]],
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
            baseline = metric_value(summaries[t.baseline_arm], t, weights)
            measured = value / baseline if value is not None and baseline else None
        if measured is None:
            results.append(TargetResult(t, value, baseline, None, None, "no data"))
            continue
        passed = measured <= t.bound if t.op == "max" else measured >= t.bound
        results.append(TargetResult(t, value, baseline, measured, passed))
    return results


# --------------------------------------------------------------------------- output


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


ROWS: tuple[tuple[str, str], ...] = (
    ("ttft_p50", "TTFT p50 (s)"),
    ("ttft_p90", "TTFT p90 (s)"),
    ("ttft_p95", "TTFT p95 (s)"),
    ("ttft_p99", "TTFT p99 (s)"),
    ("e2e_p50", "e2e p50 (s)"),
    ("e2e_p95", "e2e p95 (s)"),
    ("e2e_p99", "e2e p99 (s)"),
    ("goodput", "goodput (output tok/s)"),
    ("throughput", "throughput (completed req/s)"),
    ("wait_max", "max wait for first token (s)"),
    ("queue_wait_p99", "gateway queue wait p99 (s)"),
    ("queue_wait_max", "gateway queue wait max (s)"),
    ("sent", "sent"),
    ("ok", "ok"),
    ("errors", "errors by status"),
    ("unfinished", "unfinished (cancelled at the end)"),
)


TENANT_ROWS: tuple[tuple[str, str], ...] = (
    ("share", "service share"),
    ("ttft_p95", "TTFT p95 (s)"),
    ("e2e_p95", "e2e p95 (s)"),
    ("goodput", "goodput (output tok/s)"),
    ("ok", "ok"),
)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _errors_text(errors: Mapping[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in errors.items()) or "0"


def _hit_rate_text(arm: Mapping[str, Any]) -> str:
    cache = arm["summary"].get("prefix_cache") or {}
    rate = cache.get("prefix_hit_rate")
    if rate is None:
        return "-"
    text = f"{rate:.1%} ({fmt(cache['prefix_hits'])} of {fmt(cache['prefix_queries'])})"
    if cache.get("prefix_backends_missing"):
        text += f", {cache['prefix_backends_missing']} backend(s) not scraped"
    return text


def _per_backend_text(arm: Mapping[str, Any], key: str) -> str:
    """``a / b / c / d`` in backend order (from the simulators' own counters)."""
    rows = (arm["summary"].get("prefix_cache") or {}).get("per_backend") or []
    return " / ".join(fmt(r.get(key)) for r in rows) or "-"


def _fleet_text(arm: Mapping[str, Any]) -> str:
    return "balanced" if arm.get("balanced") else "as configured"


def policy_text(sc: Mapping[str, Any]) -> str:
    """The fairlane arms' policy as the report names it: the file, and for ``policy:
    default`` the speedup its durations were divided by and the copy the gateway read."""
    scale = sc.get("policy_scale")
    if scale is None:
        return f"`{sc['policy']}`"
    return (
        f"`{sc['policy']}` with its durations divided by {scale:g} (the speedup; read from "
        f"`{sc.get('policy_file', '?')}`)"
    )


def fleet_line(sc: Mapping[str, Any]) -> str:
    """What the arms ran against: the simulated fleet (engines switched to fcfs or priority
    per arm), or existing engines given with ``--backend`` (their policy is their own)."""
    external = sc["backends"].get("external")
    if external:
        return (
            f"- fleet: {len(external)} existing backend(s) given with --backend "
            f"({', '.join(external)}); **their scheduling policy is their own** (whatever "
            "they were started with): FIFO vs priority cannot be switched per arm, so every "
            "arm runs on it, and fairlane's injected priority orders requests inside the "
            "engines only if they run `--scheduling-policy priority`. FIFO: Envoy round-robin "
            "to them; least-request / random: Envoy's LEAST_REQUEST / RANDOM; fairlane: the "
            f"gateway with {policy_text(sc)} (scraping their /metrics)."
        )
    return (
        f"- fleet: {sc['backends']['count']} simulated backend(s), profile "
        f"{sc['backends']['profile']}, flags `{' '.join(sc['backends']['flags']) or '-'}`; "
        "FIFO: Envoy round-robin, vLLM fcfs; least-request / random: Envoy's LEAST_REQUEST / "
        "RANDOM, vLLM fcfs; fairlane: the gateway with "
        f"{policy_text(sc)}, vLLM priority."
    )


def render_markdown(results: Mapping[str, Any]) -> str:
    sc = results["scenario"]
    arms: dict[str, Any] = results["arms"]
    names = list(arms)
    lines = [
        f"# fairlane bench: {sc['name']}",
        "",
        sc["description"].strip(),
        "",
        f"- {sc['duration_s']:g} simulated seconds at speedup {sc['speedup']:g} "
        f"({sc['duration_s'] / sc['speedup']:.1f} s wall per arm), warm-up "
        f"{sc['warmup_s']:g} s left out of latency percentiles and goodput; seed {sc['seed']}.",
        fleet_line(sc),
        *(
            [
                "- per-backend overrides (left out by balanced arms): "
                + "; ".join(
                    f"backend {i}: `{' '.join(f)}`" for i, f in sc["backends"]["overrides"].items()
                )
            ]
            if sc["backends"].get("overrides")
            else []
        ),
        "- **All times are simulated seconds** (wall seconds x speedup). Goodput is output "
        "tokens per simulated second.",
        "",
        "## Targets",
        "",
    ]
    targets = results["targets"]
    if targets:
        rows = []
        for t in targets:
            verdict = {True: "PASS", False: "FAIL", None: "N/A"}[t["passed"]]
            compare = f"{t['arm']}" + (f" / {t['baseline_arm']}" if t["baseline_arm"] else "")
            sign = "≤" if t["op"] == "max" else "≥"
            rows.append(
                [
                    t["name"],
                    f"{t['metric']} {compare}",
                    fmt(t["value"]),
                    fmt(t["baseline"]),
                    fmt(t["measured"]),
                    f"{sign} {t['bound']:g}",
                    verdict + (f" ({t['note']})" if t["note"] else ""),
                ]
            )
        lines += _table(
            ["target", "metric", "value", "baseline", "measured", "bound", "result"], rows
        )
    else:
        lines.append("(none)")
    tiers = list(dict.fromkeys(t for a in arms.values() for t in a["summary"]["by_tier"]))
    for tier in tiers:
        lines += ["", f"## Tier `{tier}`", ""]
        rows = []
        for key, label in ROWS:
            row = [label]
            for name in names:
                stats = arms[name]["summary"]["by_tier"].get(tier)
                if stats is None:
                    row.append("(not in arm)")
                elif key == "errors":
                    row.append(_errors_text(stats[key]))
                else:
                    row.append(fmt(stats[key]))
            rows.append(row)
        lines += _table(["", *names], rows)
    lines += ["", "## Total (the whole fleet)", ""]
    lines += _table(
        ["", *names],
        [
            [
                label,
                *(
                    _errors_text(arms[n]["summary"]["total"][key])
                    if key == "errors"
                    else fmt(arms[n]["summary"]["total"][key])
                    for n in names
                ),
            ]
            for key, label in (
                ("throughput", "throughput (completed req/s)"),
                ("goodput", "goodput (output tok/s)"),
                ("ttft_p50", "TTFT p50 (s)"),
                ("ttft_p90", "TTFT p90 (s)"),
                ("ttft_p99", "TTFT p99 (s)"),
                ("e2e_p50", "e2e p50 (s)"),
                ("e2e_p99", "e2e p99 (s)"),
                ("sent", "sent"),
                ("ok", "ok"),
                ("errors", "errors by status"),
                ("unfinished", "unfinished"),
            )
        ]
        + [
            ["prefix-cache hit rate (tokens)", *(_hit_rate_text(arms[n]) for n in names)],
            [
                "requests finished per backend (window)",
                *(_per_backend_text(arms[n], "finished") for n in names),
            ],
            [
                "preemptions per backend (window)",
                *(_per_backend_text(arms[n], "preemptions") for n in names),
            ],
            ["fleet", *(_fleet_text(arms[n]) for n in names)],
        ],
    )
    lines += [
        "",
        "## Tenants",
        "",
        "Service share: the tenant's share of the service delivered in the window, counted as "
        "input + 2 x output tokens (plain input + output tokens in brackets).",
        "",
    ]
    tenants = list(dict.fromkeys(t for a in arms.values() for t in a["summary"]["by_tenant"]))
    rows = []
    for tenant in tenants:
        for key, label in TENANT_ROWS:
            row = [f"{tenant}: {label}"]
            for name in names:
                stats = arms[name]["summary"]["by_tenant"].get(tenant)
                if stats is None:
                    row.append("-")
                elif key == "share":
                    row.append(f"{stats['share']:.1%} ({stats['plain_share']:.1%})")
                else:
                    row.append(fmt(stats[key]))
            rows.append(row)
    lines += _table(["tenant", *names], rows)
    failed = results.get("failed_arms") or {}
    if failed:
        lines += ["", "## Failed arms", ""]
        for name, error in failed.items():
            lines += [
                f"- **{name}**: could not run (its processes were stopped):",
                "",
                "```",
                error.strip()[-3000:],
                "```",
            ]
    lines += ["", "## CPU (cores used during the workload: CPU seconds / wall seconds)", ""]
    procs = list(dict.fromkeys(p for a in arms.values() for p in a["cpu"]["cores"]))
    rows = [[p, *(fmt(arms[n]["cpu"]["cores"].get(p)) for n in names)] for p in procs]
    rows.append(
        [
            "machine (all processes)",
            *(
                f"{arms[n]['cpu']['machine_cores']:.2f} of {arms[n]['cpu']['machine_capacity']}"
                for n in names
            ),
        ]
    )
    rows.append(
        [
            "machine, busiest second",
            *(f"{arms[n]['cpu'].get('machine_peak', 0):.0%}" for n in names),
        ]
    )
    rows.append(
        [
            "load generator, worst event-loop stall (wall ms)",
            *(f"{arms[n]['cpu'].get('loop_lag_max_s', 0) * 1000:.0f}" for n in names),
        ]
    )
    rows.append(["wall seconds", *(f"{arms[n]['cpu']['wall_s']:.1f}" for n in names)])
    lines += _table(["process", *names], rows)
    warnings = [f"- {n}: {w}" for n in names for w in arms[n]["cpu"]["warnings"]]
    warnings += [
        f"- {n}: WARNING: the request cap ({sc['max_requests']}) was hit: the "
        "workload was cut short"
        for n in names
        if arms[n]["capped"]
    ]
    if warnings:
        lines += ["", "### Warnings", "", *warnings]
    return "\n".join(lines) + "\n"


def write(
    out_dir: Path, results: Mapping[str, Any], records: Mapping[str, Sequence[RequestRecord]]
) -> tuple[Path, Path]:
    """Write ``report.md`` (with its PNG plots) and ``results.json`` (summary + every request
    record)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    from loadtests.bench import plots  # PNGs next to report.md, embedded in it

    md.write_text(plots.add_plots(render_markdown(results), out_dir, results, records))
    data = dict(results)
    data["records"] = {arm: [r.to_json() for r in recs] for arm, recs in records.items()}
    js = out_dir / "results.json"
    js.write_text(json.dumps(data, indent=1))
    return md, js
