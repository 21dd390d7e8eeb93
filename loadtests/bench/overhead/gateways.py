"""The whole gateway of every arm side by side, the peers' too: what each adds to the
backend called directly, and the CPU it spends per request.

fairlane's own targets compare Envoy + fairlane with Envoy alone (``direct``); a peer
gateway (vllm-router, LiteLLM) takes the place of both, so here every arm is measured
against the backend alone:

- at concurrency 1, the arm's p50 and p99 minus the backend's, measured alternately in the
  same phase against the same backend process;
- at each numeric rate, the arm's p50 and p99 minus the backend alone's at that rate (the
  ``backend`` phases of the direct arm);
- the gateway's CPU per 1,000 requests: the CPU seconds of every process of the arm but the
  backend, per 1,000 requests completed in the phase.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loadtests.bench.overhead.scenario import DIRECT

Row = Mapping[str, Any]
BACKEND = "backend"


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def gateway_processes(row: Row) -> list[str]:
    """The arm's processes in a phase, the backend left out."""
    return [p for p in row["cpu_cores"] if p != BACKEND]


def cpu_per_1000(row: Row, process: str | None = None) -> float | None:
    """The gateway's CPU seconds per 1,000 requests completed in the phase (``process``:
    that process's alone)."""
    rps = row.get("achieved_rps")
    if not rps:
        return None
    cores = sum(c for p, c in row["cpu_cores"].items() if p != BACKEND and process in (None, p))
    return round(cores / rps * 1000, 3)


def _mode(rows: Sequence[Row], mode: str, rate: float | None = None) -> Row | None:
    return next(
        (r for r in rows if r["mode"] == mode and (rate is None or r["target_rps"] == rate)), None
    )


def gateway_figures(arms: Mapping[str, Sequence[Row]], rates: Sequence[float]) -> dict[str, Any]:
    """Per arm: its gateway's processes, at concurrency 1 and at each of ``rates`` (numeric,
    req/s) what it adds to the backend and its CPU per 1,000 requests (``results.json``'s
    ``gateways``)."""
    alone = {rate: _mode(arms.get(DIRECT, ()), BACKEND, rate) for rate in rates}
    figures: dict[str, Any] = {}
    for arm, rows in arms.items():
        c1 = _mode(rows, "concurrency1")
        processes = next((gateway_processes(r) for r in rows if r.get("cpu_cores")), [])
        entry: dict[str, Any] = {"processes": processes, "concurrency1": None, "rates": {}}
        if c1 is not None:
            entry["concurrency1"] = {
                "added_p50_ms": _minus(c1.get("p50_ms"), c1.get("backend_p50_ms")),
                "added_p99_ms": _minus(c1.get("p99_ms"), c1.get("backend_p99_ms")),
                "cpu_s_per_1000": cpu_per_1000(c1),
            }
        for rate in rates:
            row, base = _mode(rows, "rate", rate), alone[rate] or {}
            if row is None:
                continue
            entry["rates"][f"{rate:g}"] = {
                "p50_ms": row.get("p50_ms"),
                "p99_ms": row.get("p99_ms"),
                "added_p50_ms": _minus(row.get("p50_ms"), base.get("p50_ms")),
                "added_p99_ms": _minus(row.get("p99_ms"), base.get("p99_ms")),
                "cpu_s_per_1000": cpu_per_1000(row),
                "errors": row.get("errors", 0),
            }
        figures[arm] = entry
    return figures


def gateway_lines(arms: Mapping[str, Sequence[Row]], rates: Sequence[float]) -> list[str]:
    """The report's section (none when no arm ran)."""
    figures = gateway_figures(arms, rates)
    if not figures:
        return []
    lines = [
        "",
        "## The whole gateway, beside the peers",
        "",
        "Every arm against the backend called directly (a peer gateway replaces Envoy and "
        "the service together, so Envoy alone is not its baseline): at concurrency 1 the "
        "arm's p50 / p99 minus the backend's in the same phase; at each rate the arm's minus "
        "the backend alone's at that rate (measured in the direct arm); the gateway's CPU is "
        "every process of the arm but the backend, per 1,000 completed requests.",
        "",
        "| arm | gateway processes | added p50 / p99 at concurrency 1 (ms) "
        "| gateway CPU per 1,000 requests at concurrency 1 (s) |",
        "|---|---|---|---|",
    ]
    for arm, f in figures.items():
        c1 = f["concurrency1"] or {}
        lines.append(
            f"| {arm} | {', '.join(f['processes']) or '-'} "
            f"| {_fmt(c1.get('added_p50_ms'))} / {_fmt(c1.get('added_p99_ms'))} "
            f"| {_fmt(c1.get('cpu_s_per_1000'))} |"
        )
    lines += [
        "",
        "| rate | arm | p50 / p99 (ms) | added p50 / p99 over the backend alone (ms) "
        "| gateway CPU per 1,000 requests (s) | errors |",
        "|---|---|---|---|---|---|",
    ]
    for rate in rates:
        base = _mode(arms.get(DIRECT, ()), BACKEND, rate)
        if base is not None:
            lines.append(
                f"| {rate:g} req/s | the backend alone | {_fmt(base.get('p50_ms'))} / "
                f"{_fmt(base.get('p99_ms'))} | - | - | {base.get('errors', 0)} |"
            )
        for arm, f in figures.items():
            r = f["rates"].get(f"{rate:g}")
            if r is None:
                continue
            lines.append(
                f"| {rate:g} req/s | {arm} | {_fmt(r['p50_ms'])} / {_fmt(r['p99_ms'])} "
                f"| {_fmt(r['added_p50_ms'])} / {_fmt(r['added_p99_ms'])} "
                f"| {_fmt(r['cpu_s_per_1000'])} | {r['errors']} |"
            )
    return lines
