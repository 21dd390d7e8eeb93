"""PNG plots of a bench run, drawn from the arms' request records, and their place in
``report.md``.

Per tier, the CDFs of TTFT and end-to-end latency and the requests in flight (and, for
fairlane arms, held in the gateway's queue); per arm, throughput over time and each tenant's
share of the service (``write_plots`` lists the files). Times are simulated seconds, as in
the report. matplotlib (Agg, no display) is imported only when plots are drawn, so nothing
else (the service above all) ever loads it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtests.bench.client import RequestRecord
from loadtests.bench.results import BenchResults, Figures

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 110
TIMELINE_POINTS = 600
"""Samples of the queue-depth timeline (step function evaluated on a regular grid)."""
THROUGHPUT_BINS = 50
"""About this many bins over the run for the throughput plot (rounded to a nice width)."""
LOG_X_SPAN = 20.0
"""Use a log x axis for a CDF when its largest value is this many times its smallest."""

SECTION_TIER = "## Tier `{tier}`"
SECTION_TOTAL = "## Total (the whole fleet)"
SECTION_TENANTS = "## Tenants"
SECTION_FALLBACK = "## Plots"


def safe_name(text: str) -> str:
    """``text`` usable in a file name (tier names come from scenario files)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text) or "_"


def new_figure(
    rows: int = 1, cols: int = 1, height: float = 4.2, width: float = 8.5
) -> tuple[Figure, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        rows, cols, figsize=(width, height * rows), squeeze=False, layout="constrained"
    )
    return fig, axes


def save_figure(fig: Figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _window(scenario: Mapping[str, Any]) -> tuple[float, float]:
    return float(scenario["warmup_s"]), float(scenario["duration_s"])


def _mark_window(ax: Axes, scenario: Mapping[str, Any]) -> None:
    """Shade what is outside the measured window (warm-up, drain)."""
    start, end = _window(scenario)
    if start > 0:
        ax.axvspan(0, start, color="0.9", zorder=0, label="warm-up")
    ax.axvline(end, color="0.5", linestyle=":", linewidth=1, label="end of load")


def _cdf(ax: Axes, values_by_arm: Mapping[str, Sequence[float]]) -> None:
    import numpy as np

    values = [v for vs in values_by_arm.values() for v in vs if v > 0]
    for arm, vs in values_by_arm.items():
        if not vs:
            continue
        xs = np.sort(np.asarray(vs, dtype=float))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.step(xs, ys, where="post", label=f"{arm} (n={len(xs)})", linewidth=1.6)
    if values and max(values) / min(values) >= LOG_X_SPAN:
        ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("fraction of requests ≤ x")
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        ax.axhline(q, color="0.6", linestyle=":", linewidth=0.8)
        ax.annotate(
            name,
            (0, q),
            xycoords=("axes fraction", "data"),
            xytext=(3, 2),
            textcoords="offset points",
            fontsize="x-small",
            color="0.4",
        )
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right")


def _tiers(records: Mapping[str, Sequence[RequestRecord]], order: Sequence[str]) -> list[str]:
    """The records' tiers, in ``order`` (the report's) first."""
    seen = {r.tier for recs in records.values() for r in recs}
    return [t for t in order if t in seen] + sorted(seen - set(order))


def latency_cdfs(
    out_dir: Path,
    scenario: Mapping[str, Any],
    records: Mapping[str, Sequence[RequestRecord]],
    order: Sequence[str] = (),
) -> dict[str, list[Path]]:
    """``{tier: [ttft_cdf, e2e_cdf]}``."""
    start, end = _window(scenario)
    tiers = _tiers(records, order)
    written: dict[str, list[Path]] = {}
    for tier in tiers:
        measured = {
            arm: [r for r in recs if r.tier == tier and r.ok and start <= r.start_s < end]
            for arm, recs in records.items()
        }
        paths = []
        for metric, label in (("ttft", "time to first token"), ("e2e", "end-to-end latency")):
            values = {
                arm: [v for r in rs if (v := getattr(r, f"{metric}_s")) is not None]
                for arm, rs in measured.items()
            }
            fig, axes = new_figure()
            ax = axes[0][0]
            _cdf(ax, values)
            ax.set_xlabel(f"{label} (simulated s)")
            ax.set_title(f"{scenario['name']}: tier {tier}, {label} CDF")
            paths.append(save_figure(fig, out_dir / f"{metric}_cdf_{safe_name(tier)}.png"))
        written[tier] = paths
    return written


def _count_over(times: Any, starts: Sequence[float], ends: Sequence[float]) -> Any:
    """How many intervals ``[start, end)`` contain each time."""
    import numpy as np

    s = np.sort(np.asarray(starts, dtype=float))
    e = np.sort(np.asarray(ends, dtype=float))
    return np.searchsorted(s, times, side="right") - np.searchsorted(e, times, side="right")


def _end_of(r: RequestRecord) -> float:
    return r.end_s if r.end_s is not None else r.start_s


def queue_depth(
    out_dir: Path,
    scenario: Mapping[str, Any],
    records: Mapping[str, Sequence[RequestRecord]],
    kinds: Mapping[str, str],
    order: Sequence[str] = (),
) -> Path:
    """Requests in flight per tier for every arm; the gateway queue for fairlane arms."""
    import numpy as np

    speedup = float(scenario["speedup"])
    tiers = _tiers(records, order)
    last = max([_end_of(r) for recs in records.values() for r in recs], default=1.0)
    times = np.linspace(0.0, max(last, 1e-9), TIMELINE_POINTS)
    fig, axes = new_figure(rows=max(len(tiers), 1), height=3.2, width=11.0)
    colors = _arm_colors(records)
    for row, tier in enumerate(tiers):
        ax = axes[row][0]
        for arm, recs in records.items():
            mine = [r for r in recs if r.tier == tier]
            flight = _count_over(times, [r.start_s for r in mine], [_end_of(r) for r in mine])
            ax.plot(times, flight, color=colors[arm], linewidth=1.4, label=f"{arm}: in flight")
            queued = [r for r in mine if r.queue_ms is not None]
            if kinds.get(arm) == "fairlane" and queued:
                held = _count_over(
                    times,
                    [r.start_s for r in queued],
                    [r.start_s + (r.queue_ms or 0.0) * speedup / 1000.0 for r in queued],
                )
                ax.plot(
                    times,
                    held,
                    color=colors[arm],
                    linewidth=1.2,
                    linestyle="--",
                    label=f"{arm}: in the gateway queue",
                )
        _mark_window(ax, scenario)
        ax.set_ylabel("requests")
        ax.set_title(f"tier {tier}")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    axes[-1][0].set_xlabel("time since the start of the run (simulated s)")
    fig.suptitle(
        f"{scenario['name']}: requests in flight (sent, not finished) and held in the "
        "gateway queue, per tier"
    )
    return save_figure(fig, out_dir / "queue_depth.png")


def _arm_colors(records: Mapping[str, Any]) -> dict[str, str]:
    palette = [f"C{i}" for i in range(10)]
    return {arm: palette[i % len(palette)] for i, arm in enumerate(records)}


def _bin_width(span: float) -> float:
    raw = span / THROUGHPUT_BINS
    for nice in (0.5, 1, 2, 5, 10, 15, 20, 30, 60, 120, 300, 600):
        if raw <= nice:
            return float(nice)
    return raw


def throughput(
    out_dir: Path, scenario: Mapping[str, Any], records: Mapping[str, Sequence[RequestRecord]]
) -> Path:
    """Completed requests and output tokens per simulated second, binned over time."""
    import numpy as np

    last = max([_end_of(r) for recs in records.values() for r in recs], default=1.0)
    width = _bin_width(max(last, 1e-9))
    edges = np.arange(0.0, last + width, width)
    if len(edges) < 2:
        edges = np.array([0.0, width])
    centers = (edges[:-1] + edges[1:]) / 2
    fig, axes = new_figure(rows=2, height=3.4)
    colors = _arm_colors(records)
    for arm, recs in records.items():
        done = [r for r in recs if r.ok and r.end_s is not None]
        ends = np.asarray([r.end_s for r in done], dtype=float)
        tokens = np.asarray([r.completion_tokens for r in done], dtype=float)
        count, _ = np.histogram(ends, bins=edges)
        toks, _ = np.histogram(ends, bins=edges, weights=tokens)
        axes[0][0].plot(centers, count / width, color=colors[arm], label=arm, linewidth=1.5)
        axes[1][0].plot(centers, toks / width, color=colors[arm], label=arm, linewidth=1.5)
    for ax, label in (
        (axes[0][0], "completed requests / s"),
        (axes[1][0], "output tokens / s"),
    ):
        _mark_window(ax, scenario)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper right", fontsize="small")
    axes[1][0].set_xlabel("time since the start of the run (simulated s)")
    fig.suptitle(
        f"{scenario['name']}: throughput over time (successful requests, by finish time, "
        f"{width:g} s bins)"
    )
    return save_figure(fig, out_dir / "throughput.png")


def service_share(out_dir: Path, results: BenchResults) -> Path | None:
    """Per-tenant share of the service in the window, a stacked bar per arm."""
    arms = results.arms
    tenants = list(dict.fromkeys(t for a in arms.values() for t in a.summary.by_tenant))
    if not tenants:
        return None
    names = list(arms)
    fig, axes = new_figure(height=max(2.2, 0.9 * len(names) + 1.6))
    ax = axes[0][0]
    left = [0.0] * len(names)
    for i, tenant in enumerate(tenants):
        shares = [_share(arms[n].summary.by_tenant.get(tenant)) * 100 for n in names]
        bars = ax.barh(names, shares, left=left, color=f"C{i % 10}", label=tenant)
        ax.bar_label(
            bars,
            labels=[f"{s:.0f} %" if s >= 6 else "" for s in shares],
            label_type="center",
            color="white",
            fontsize="small",
        )
        left = [a + b for a, b in zip(left, shares, strict=True)]
    ax.set_xlim(0, 100)
    ax.invert_yaxis()  # first arm on top, as in the report's tables
    ax.set_xlabel("share of service in the measured window (%, input + 2 x output tokens)")
    ax.set_title(f"{results.scenario['name']}: per-tenant service share")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncols=min(len(tenants), 4))
    return save_figure(fig, out_dir / "service_share.png")


def write_plots(
    out_dir: Path, results: BenchResults, records: Mapping[str, Sequence[RequestRecord]]
) -> dict[str, list[Path]]:
    """Draw every plot into ``out_dir``; ``{report section heading: [png, ...]}``.

    The plots:

    * ``ttft_cdf_<tier>.png``, ``e2e_cdf_<tier>.png``: per tier, the CDF of TTFT and of the
      end-to-end latency, one line per arm, over the same requests as the report's percentiles
      (successful, started in the measured window); log-x when the values span a wide range;
    * ``queue_depth.png``: per tier, requests in flight (sent, not yet finished) for every arm,
      and for fairlane arms the requests held in the gateway's queue (from the start of a
      request to start + ``x-fairlane-queue-ms`` x speedup). FIFO arms have no gateway queue:
      their waiting requests are in flight, queued inside vLLM;
    * ``throughput.png``: completed requests and output tokens per simulated second over time,
      per arm (successful requests, counted when they finish);
    * ``service_share.png``: each tenant's share of the service in the window (input + 2 x
      output tokens, as the report's tenant table), one stacked bar per arm.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    scenario = results.scenario
    records = {arm: recs for arm, recs in records.items() if recs}
    kinds = {name: arm.kind for name, arm in results.arms.items()}
    order = list(dict.fromkeys(t for a in results.arms.values() for t in a.summary.by_tier))
    sections: dict[str, list[Path]] = {}
    if records:
        for tier, paths in latency_cdfs(out_dir, scenario, records, order).items():
            sections[SECTION_TIER.format(tier=tier)] = paths
        sections[SECTION_TOTAL] = [
            queue_depth(out_dir, scenario, records, kinds, order),
            throughput(out_dir, scenario, records),
        ]
    share = service_share(out_dir, results)
    if share is not None:
        sections[SECTION_TENANTS] = [share]
    return sections


def _share(figures: Figures | None) -> float:
    return 0.0 if figures is None or figures.share is None else float(figures.share)


def _alt(path: Path) -> str:
    return path.stem.replace("_", " ")


def embed(markdown: str, sections: Mapping[str, Sequence[Path]]) -> str:
    """``markdown`` with each section's images appended at the end of that section (before
    the next ``## `` heading); images whose section is missing go to a final "Plots"."""
    lines = markdown.rstrip("\n").split("\n")
    leftover: list[Path] = []
    for heading, paths in sections.items():
        links = [f"![{_alt(p)}]({p.name})" for p in paths]
        try:
            at = lines.index(heading)
        except ValueError:
            leftover += paths
            continue
        end = next((i for i in range(at + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        while end > at + 1 and not lines[end - 1].strip():
            end -= 1
        block = [""]
        for link in links:
            block += [link, ""]
        lines[end:end] = block[:-1]
    if leftover:
        lines += ["", SECTION_FALLBACK, ""]
        for p in leftover:
            lines += [f"![{_alt(p)}]({p.name})", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def add_plots(
    markdown: str,
    out_dir: Path,
    results: BenchResults,
    records: Mapping[str, Sequence[RequestRecord]],
) -> str:
    """Draw the plots and embed them in ``markdown``. A failure to draw (matplotlib missing,
    a bug) is reported in the markdown and on stderr, never loses the run's report."""
    try:
        sections = write_plots(out_dir, results, records)
    except Exception as exc:  # the figures and results.json matter more than the pictures
        message = f"plots not drawn: {type(exc).__name__}: {exc}"
        print(f"fairlane bench: WARNING: {message}", file=sys.stderr, flush=True)
        return markdown.rstrip("\n") + f"\n\n{SECTION_FALLBACK}\n\n({message})\n"
    return embed(markdown, sections)
