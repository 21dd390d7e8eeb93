"""``report.md`` and ``results.json`` of a bench run.

The report puts the arms side by side: the targets, then per tier, the whole fleet, the
tenants, failed arms and the CPU each process used (with the warnings that say when the
machine, not the scheduler, set the numbers). All times are simulated seconds
(:mod:`loadtests.bench.stats` says which requests each figure counts). The PNG plots are
drawn by :mod:`loadtests.bench.plots` and embedded under their sections.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.bench.client import RequestRecord
from loadtests.bench.cpu import GATEWAY_LIMIT_FRACTION
from loadtests.bench.external import RESET_NEEDS
from loadtests.bench.peers.report import peer_lines
from loadtests.bench.replica_flows import placement
from loadtests.bench.results import ArmResult, BenchResults, Figures


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


def errors_text(errors: Mapping[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in errors.items()) or "0"


def _cell(figures: Figures, key: str) -> str:
    value = figures.metric(key)
    return errors_text(value) if key == "errors" else fmt(value)


def _hit_rate_text(arm: ArmResult) -> str:
    cache = arm.summary.prefix_cache
    rate = None if cache is None else cache.hit_rate
    if cache is None or rate is None:
        return "-"
    text = f"{rate:.1%} ({fmt(cache.hits)} of {fmt(cache.queries)})"
    if cache.missing:
        text += f", {cache.missing} backend(s) not scraped"
    return text


def _per_backend_text(arm: ArmResult, key: str) -> str:
    """``a / b / c / d`` in backend order (from the simulators' own counters)."""
    cache = arm.summary.prefix_cache
    rows = () if cache is None else cache.per_backend
    return " / ".join(fmt(r.get(key)) for r in rows) or "-"


def _by_index(counts: Mapping[str, int]) -> str:
    """``precise 1,520 / approximate 12``: a gateway counter by prefix index (the grants it
    judged, or the tokens it predicted the engines hold; ``-`` for none)."""
    return " / ".join(f"{index} {count:,}" for index, count in counts.items()) or "-"


def _fleet_text(arm: ArmResult) -> str:
    return "balanced" if arm.balanced else "as configured"


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


def caches_text(sc: Mapping[str, Any]) -> str:
    """Whether each arm on existing engines started on empty prefix caches."""
    kept = sc["backends"].get("prefix_caches_kept") or {}
    if not kept:
        return "Their prefix caches were emptied before every arm (`POST /reset_prefix_cache`)."
    arms = "; ".join(f"{arm}: {', '.join(urls)}" for arm, urls in kept.items())
    return (
        f"**Prefix caches not emptied** before these arms ({arms}): each started on the cache "
        f"the arms before it warmed ({RESET_NEEDS})."
    )


def fleet_line(sc: Mapping[str, Any]) -> str:
    """What the arms ran against: the simulated fleet (engines switched to fcfs or priority
    per arm), or existing engines given with ``--backend`` (their policy is their own)."""
    external = sc["backends"].get("external")
    if external:
        given = (
            "real engine(s) the bench started (--engine)"
            if engines_started(sc)
            else "existing backend(s) given with --backend"
        )
        return (
            f"- fleet: {len(external)} {given} "
            f"({', '.join(external)}); **their scheduling policy is their own** (whatever "
            "they were started with): FIFO vs priority cannot be switched per arm, so every "
            "arm runs on it, and fairlane's injected priority orders requests inside the "
            "engines only if they run `--scheduling-policy priority`. FIFO: Envoy round-robin "
            "to them; least-request / random: Envoy's LEAST_REQUEST / RANDOM; fairlane: the "
            f"gateway with {policy_text(sc)} (scraping their /metrics). {caches_text(sc)}"
        )
    return (
        f"- fleet: {sc['backends']['count']} simulated backend(s), profile "
        f"{sc['backends']['profile']}, flags `{' '.join(sc['backends']['flags']) or '-'}`; "
        "FIFO: Envoy round-robin, vLLM fcfs; least-request / random: Envoy's LEAST_REQUEST / "
        "RANDOM, vLLM fcfs; fairlane: the gateway with "
        f"{policy_text(sc)}, vLLM priority."
    )


def engines_started(sc: Mapping[str, Any]) -> bool:
    """The engines were started (and pinned) by the bench (``--engine``)."""
    return bool((sc.get("pinning") or {}).get("engines_pinned"))


def pinning_text(sc: Mapping[str, Any]) -> str | None:
    """Which cores the engines and the gateway's side ran on (None: nothing was pinned)."""
    pinning = sc.get("pinning")
    if not pinning:
        return None
    engines = pinning.get("engines") or {}
    if pinning["engines_pinned"]:
        each = ", ".join(f"{name} on CPUs {cpus}" for name, cpus in engines.items())
        where = (
            f"engines started by the bench and pinned to CPUs {pinning['engine_cpus']} "
            f"({each}, OpenMP threads bound there)"
        )
    else:
        where = (
            "engines **not pinned by the bench** (started by someone else: they may run on "
            "any core, the gateway's too)"
        )
    return (
        f"pinning: {where}; the gateway (Envoy, the service, its replicas) and the load "
        f"generator pinned to CPUs {pinning['gateway_cpus']}; an arm is CPU-bound when those "
        f"cores were over {GATEWAY_LIMIT_FRACTION:.0%} busy"
    )


def models_line(sc: Mapping[str, Any]) -> list[str]:
    """What each simulated backend serves, when the scenario names models per backend."""
    models = sc["backends"].get("models")
    if not models or sc["backends"].get("external"):
        return []
    served = "; ".join(f"backend {i}: `{' '.join(names)}`" for i, names in enumerate(models))
    return [
        f"- models: {served} (in every arm). Envoy-only arms do not read the body: they send a "
        "request to any engine, and one that does not serve its model answers 404; the "
        "fairlane arms send it only to the engines that serve it."
    ]


def _head_lines(results: BenchResults) -> list[str]:
    sc = results.scenario
    overrides = sc["backends"].get("overrides")
    return [
        f"# fairlane bench: {sc['name']}",
        "",
        sc["description"].strip(),
        "",
        f"- {sc['duration_s']:g} simulated seconds at speedup {sc['speedup']:g} "
        f"({sc['duration_s'] / sc['speedup']:.1f} s wall per arm), warm-up "
        f"{sc['warmup_s']:g} s left out of latency percentiles and goodput; seed {sc['seed']}.",
        fleet_line(sc),
        *peer_lines(results.arms, bool(sc["backends"].get("external"))),
        *([f"- {pinning_text(sc)}"] if sc.get("pinning") else []),
        *models_line(sc),
        *(
            [
                "- per-backend overrides (left out by balanced arms): "
                + "; ".join(f"backend {i}: `{' '.join(f)}`" for i, f in overrides.items())
            ]
            if overrides
            else []
        ),
        "- **All times are simulated seconds** (wall seconds x speedup). Goodput is output "
        "tokens per simulated second.",
    ]


def _target_lines(results: BenchResults) -> list[str]:
    lines = ["", "## Targets", ""]
    if not results.targets:
        return [*lines, "(none)"]
    rows = []
    for r in results.targets:
        t = r.target
        compare = f"{t.arm}" + (f" / {t.baseline_arm}" if t.baseline_arm else "")
        sign = "≤" if t.op == "max" else "≥"
        rows.append(
            [
                t.name,
                f"{t.metric} {compare}",
                fmt(r.value),
                fmt(r.baseline),
                fmt(r.measured),
                f"{sign} {t.bound:g}",
                r.verdict + (f" ({r.note})" if r.note else ""),
            ]
        )
    return lines + _table(
        ["target", "metric", "value", "baseline", "measured", "bound", "result"], rows
    )


def _names_in(
    arms: Mapping[str, ArmResult], table: Callable[[ArmResult], Iterable[str]]
) -> list[str]:
    """Every tier (tenant, process ...) of any arm, in first-seen order."""
    return list(dict.fromkeys(name for arm in arms.values() for name in table(arm)))


def _tier_lines(results: BenchResults) -> list[str]:
    arms, names = results.arms, list(results.arms)
    lines: list[str] = []
    for tier in _names_in(arms, lambda a: a.summary.by_tier):
        lines += ["", f"## Tier `{tier}`", ""]
        rows = []
        for key, label in ROWS:
            row = [label]
            for name in names:
                figures = arms[name].summary.by_tier.get(tier)
                row.append("(not in arm)" if figures is None else _cell(figures, key))
            rows.append(row)
        lines += _table(["", *names], rows)
    return lines


TOTAL_ROWS: tuple[tuple[str, str], ...] = (
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


def _total_lines(results: BenchResults) -> list[str]:
    arms, names = results.arms, list(results.arms)
    rows = [
        [label, *(_cell(arms[n].summary.total, key) for n in names)] for key, label in TOTAL_ROWS
    ]
    rows += [
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
    ]
    if any(arms[n].prefix_matches for n in names):
        rows[-1:-1] = [
            [
                "grants by prefix index (whole arm)",
                *(_by_index(arms[n].prefix_matches) for n in names),
            ],
            [
                "prompt tokens the index predicted cached (whole arm)",
                *(_by_index(arms[n].prefix_predicted_tokens) for n in names),
            ],
        ]
    return ["", "## Total (the whole fleet)", "", *_table(["", *names], rows)]


def _tenant_lines(results: BenchResults) -> list[str]:
    arms, names = results.arms, list(results.arms)
    lines = [
        "",
        "## Tenants",
        "",
        "Service share: the tenant's share of the service delivered in the window, counted as "
        "input + 2 x output tokens (plain input + output tokens in brackets).",
        "",
    ]
    rows = []
    for tenant in _names_in(arms, lambda a: a.summary.by_tenant):
        for key, label in TENANT_ROWS:
            row = [f"{tenant}: {label}"]
            for name in names:
                figures = arms[name].summary.by_tenant.get(tenant)
                if figures is None:
                    row.append("-")
                elif key == "share":
                    row.append(f"{figures.share:.1%} ({figures.plain_share:.1%})")
                else:
                    row.append(fmt(figures.metric(key)))
            rows.append(row)
    return lines + _table(["tenant", *names], rows)


GROUP_ROWS: tuple[tuple[str, str], ...] = (
    ("ttft_p50", "TTFT p50 (s)"),
    ("ttft_p90", "TTFT p90 (s)"),
    ("ttft_p99", "TTFT p99 (s)"),
    ("e2e_p95", "e2e p95 (s)"),
    ("goodput", "goodput (output tok/s)"),
    ("sent", "sent"),
    ("ok", "ok"),
    ("errors", "errors by status"),
)


def groups_sharing_a_tier(sc: Mapping[str, Any]) -> list[str]:
    """The groups whose tier holds another group too (chat on two models, say): the tier's
    figures mix them, so they get their own (older results name no groups: none)."""
    groups: Mapping[str, Mapping[str, Any]] = sc.get("groups") or {}
    tiers = [g["tier"] for g in groups.values()]
    return [name for name, g in groups.items() if tiers.count(g["tier"]) > 1]


def _group_lines(results: BenchResults) -> list[str]:
    shown = groups_sharing_a_tier(results.scenario)
    if not shown:
        return []
    arms, names = results.arms, list(results.arms)
    about = results.scenario["groups"]
    lines = [
        "",
        "## Groups that share a tier",
        "",
        "A tier's figures above mix its groups; these are each one's.",
        "",
    ]
    rows = []
    for group in shown:
        label = f"{group} ({about[group]['tier']}, `{about[group]['model']}`)"
        for key, what in GROUP_ROWS:
            row = [f"{label}: {what}"]
            for name in names:
                figures = arms[name].summary.by_group.get(group)
                row.append("(not in arm)" if figures is None else _cell(figures, key))
            rows.append(row)
    return lines + _table(["group", *names], rows)


def _failed_lines(results: BenchResults) -> list[str]:
    if not results.failed_arms:
        return []
    lines = ["", "## Failed arms", ""]
    for name, error in results.failed_arms.items():
        lines += [
            f"- **{name}**: could not run (its processes were stopped):",
            "",
            "```",
            error.strip()[-3000:],
            "```",
        ]
    return lines


def _cpu_lines(results: BenchResults) -> list[str]:
    arms, names = results.arms, list(results.arms)
    lines = ["", "## CPU (cores used during the workload: CPU seconds / wall seconds)", ""]
    rows = [
        [_pinned_label(arms, p), *(fmt(arms[n].cpu.cores.get(p)) for n in names)]
        for p in _names_in(arms, lambda a: a.cpu.cores)
    ]
    rows += [
        [f"{core_set} CPUs {cpus} busy", *(_busy(arms[n], core_set) for n in names)]
        for core_set, cpus in _core_sets(arms).items()
    ]
    rows += [
        [
            "machine (all processes)",
            *(f"{arms[n].cpu.machine_cores:.2f} of {arms[n].cpu.machine_capacity}" for n in names),
        ],
        ["machine, busiest second", *(f"{arms[n].cpu.machine_peak:.0%}" for n in names)],
        [
            "load generator, worst event-loop stall (wall ms)",
            *(f"{arms[n].cpu.loop_lag_max_s * 1000:.0f}" for n in names),
        ],
        ["wall seconds", *(f"{arms[n].cpu.wall_s:.1f}" for n in names)],
    ]
    lines += _table(["process", *names], rows)
    warnings = [f"- {n}: {w}" for n in names for w in arms[n].cpu.warnings]
    warnings += [
        f"- {n}: WARNING: the request cap ({results.scenario['max_requests']}) was hit: the "
        "workload was cut short"
        for n in names
        if arms[n].capped
    ]
    if warnings:
        lines += ["", "### Warnings", "", *warnings]
    return lines


def _pinned_label(arms: Mapping[str, ArmResult], process: str) -> str:
    """``process``, with the cores it was allowed when the run was pinned."""
    cpus = next((a.cpu.affinity[process] for a in arms.values() if process in a.cpu.affinity), None)
    return process if cpus is None else f"{process} (CPUs {cpus})"


def _core_sets(arms: Mapping[str, ArmResult]) -> dict[str, str]:
    """Every pinned core set of the run and its cores, in the order first seen."""
    found: dict[str, str] = {}
    for arm in arms.values():
        for name, use in arm.cpu.core_sets.items():
            found.setdefault(name, use.cpus)
    return found


def _busy(arm: ArmResult, core_set: str) -> str:
    use = arm.cpu.core_sets.get(core_set)
    return "-" if use is None else f"{use.busy:.0%}"


def _replica_lines(results: BenchResults) -> list[str]:
    """Which replica decided which flow, per replica arm: Envoy pins each key to a replica by
    a hash of fresh ports, so runs of one scenario differ in it."""
    placed = {n: a.replica_flows for n, a in results.arms.items() if a.replica_flows}
    if not placed:
        return []
    lines = ["", "## Flows by replica (admitted requests)", ""]
    return lines + [f"- {n}: {placement(flows)}" for n, flows in placed.items()]


def render_markdown(results: BenchResults) -> str:
    lines = [
        *_head_lines(results),
        *_target_lines(results),
        *_tier_lines(results),
        *_group_lines(results),
        *_total_lines(results),
        *_tenant_lines(results),
        *_failed_lines(results),
        *_cpu_lines(results),
        *_replica_lines(results),
    ]
    return "\n".join(lines) + "\n"


def write(
    out_dir: Path, results: BenchResults, records: Mapping[str, Sequence[RequestRecord]]
) -> tuple[Path, Path]:
    """Write ``report.md`` (with its PNG plots) and ``results.json`` (summary + every request
    record)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    from loadtests.bench import plots  # PNGs next to report.md, embedded in it

    md.write_text(plots.add_plots(render_markdown(results), out_dir, results, records))
    data = results.to_json()
    data["records"] = {arm: [r.to_json() for r in recs] for arm, recs in records.items()}
    js = out_dir / "results.json"
    js.write_text(json.dumps(data, indent=1))
    return md, js
