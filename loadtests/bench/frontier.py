"""The chat-versus-batch frontier of a flood scenario, measured.

Under a batch flood a non-preemptive engine trades chat latency for batch throughput through
one thing: how many seats are kept free for chat. fairlane sizes that reserve to chat's
recent demand, capped by the interactive tier's ``reserved_share``. This tool re-runs a
scenario's ``fairlane`` arm with the shipped default policy and that ceiling at several
values (0: no reserve at all), against the scenario's own ``fifo`` and ``fairlane-no-flood``
baselines, and plots each point as (batch goodput / FIFO's, interactive p90 TTFT / no
flood's), with the scenario's targets as the corner to reach::

    python -m loadtests.bench.frontier flood-8seat --shares 0,0.1,0.25,0.5 --out DIR

It writes ``frontier.json`` and ``frontier.png`` into ``DIR``; each point is one arm of the
scenario, one after the other, on the same seeded workload. ``main`` has the other options.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from extproc.policy import DEFAULT_POLICY_PATH
from loadtests.bench.cli import raise_interrupt, run_arm
from loadtests.bench.policy_scale import rescale_policy
from loadtests.bench.results import ArmResult
from loadtests.bench.scenario import Scenario, load_scenario

DEFAULT_SHARES = (0.0, 0.1, 0.25, 0.5)


def policy_with_ceiling(
    share: float,
    speedup: float,
    directory: Path,
    preemptible: bool = True,
    batch_cap: int | None = None,
) -> Path:
    """The default policy with the interactive tier's ``reserved_share`` set to ``share``
    (and batch not ``preemptible``, or capped at ``batch_cap`` per engine, if so asked),
    rescaled to ``speedup`` like ``policy: default``; written into ``directory``."""
    policy = yaml.safe_load(DEFAULT_POLICY_PATH.read_text())
    for tier in policy["tiers"]:
        if tier["name"] == "interactive":
            tier["reserved_share"] = share
        if tier["name"] == "batch":
            tier["preemptible"] = preemptible
            if batch_cap is not None:
                tier["gate"]["max_in_flight"] = batch_cap
    path = directory / f"policy-interactive-share-{share:g}.yaml"
    path.write_text(yaml.safe_dump(rescale_policy(policy, speedup), sort_keys=False))
    return path


def _tier(arm: ArmResult, tier: str, metric: str) -> float | None:
    figures = arm.summary.by_tier.get(tier)
    value = None if figures is None else figures.metric(metric)
    return None if value is None else float(value)


def measure(
    scenario: Scenario,
    shares: list[float],
    out: Path,
    preemption: tuple[bool, ...] = (True,),
    batch_caps: tuple[int | None, ...] = (None,),
) -> dict[str, Any]:
    """Run the baselines and one fairlane arm per ceiling (and per preemption setting and
    batch cap); the points of the frontier."""
    _, fifo = run_arm(scenario, "fifo", out / "logs" / "fifo")
    _, alone = run_arm(scenario, "fairlane-no-flood", out / "logs" / "fairlane-no-flood")
    fifo_goodput = _tier(fifo, "batch", "goodput")
    alone_p90 = _tier(alone, "interactive", "ttft_p90")
    points = []
    settings = [(on, share, cap) for on in preemption for cap in batch_caps for share in shares]
    for preemptible, share, cap in settings:
        name = f"fairlane-share-{share:g}{'' if preemptible else '-no-preempt'}"
        where = out / "logs" / (name if cap is None else f"{name}-batch-cap-{cap}")
        where.mkdir(parents=True, exist_ok=True)
        policy = policy_with_ceiling(share, scenario.speedup, where, preemptible, cap)
        _, arm = run_arm(scenario, "fairlane", where, policy=policy)
        goodput, p90 = _tier(arm, "batch", "goodput"), _tier(arm, "interactive", "ttft_p90")
        points.append(
            {
                "reserved_share": share,
                "preemptible": preemptible,
                "batch_max_in_flight": cap,
                "batch_goodput_vs_fifo": goodput / fifo_goodput
                if goodput and fifo_goodput
                else None,
                "interactive_p90_vs_no_flood": p90 / alone_p90 if p90 and alone_p90 else None,
                "cpu": arm.cpu.to_json(),
            }
        )
        label = f"share {share:g}, preemptible {preemptible}, batch cap {cap}"
        print(f"frontier: {label}: {points[-1]}", file=sys.stderr)
    return {
        "scenario": scenario.name,
        "fifo_batch_goodput": fifo_goodput,
        "no_flood_interactive_p90_s": alone_p90,
        "points": points,
    }


def plot(result: dict[str, Any], targets: tuple[float | None, float | None], path: Path) -> None:
    """Batch goodput against chat p90 TTFT, one labelled point per ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    points = [
        p
        for p in result["points"]
        if None not in (p["batch_goodput_vs_fifo"], p["interactive_p90_vs_no_flood"])
    ]
    for preemptible, color in ((True, "tab:blue"), (False, "tab:orange")):
        curve = [p for p in points if p.get("preemptible", True) is preemptible]
        if not curve:
            continue
        xs = [p["batch_goodput_vs_fifo"] for p in curve]
        ys = [p["interactive_p90_vs_no_flood"] for p in curve]
        label = "batch preemptible" if preemptible else "no preemption"
        ax.plot(xs, ys, "o-", color=color, label=label)
        for p, x, y in zip(curve, xs, ys, strict=True):
            cap = p.get("batch_max_in_flight")
            text = f"share {p['reserved_share']:g}" + ("" if cap is None else f", cap {cap}")
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(5, 5))
    ax.legend(loc="upper left")
    min_goodput, max_p90 = targets
    if min_goodput is not None and max_p90 is not None:
        ax.axvline(min_goodput, color="tab:green", linestyle="--", linewidth=1)
        ax.axhline(max_p90, color="tab:green", linestyle="--", linewidth=1)
        ax.text(min_goodput, max_p90, " target corner", color="tab:green", va="bottom")
    ax.set_yscale("log")
    ax.set_xlabel("batch goodput / FIFO's")
    ax.set_ylabel("interactive p90 TTFT / no flood's")
    ax.set_title(f"{result['scenario']}: the reserve ceiling's frontier")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _targets(scenario: Scenario) -> tuple[float | None, float | None]:
    min_goodput = next((t.bound for t in scenario.targets if t.metric == "goodput"), None)
    max_p90 = next((t.bound for t in scenario.targets if t.metric.startswith("ttft_p")), None)
    return min_goodput, max_p90


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtests.bench.frontier SCENARIO --shares ... --out DIR``.

    ``--preemption on,off`` measures each ceiling with the batch tier ``preemptible`` (the
    shipped default) and without, so the two curves show what preemption moves; ``--batch-caps
    64,128`` measures each ceiling again with batch capped at that many requests per engine (its
    gate's ``max_in_flight``): on big engines the decode batch, not the seat, is what chat waits
    for (every step is longer), and the cap is the lever on it; ``--speedup`` runs the scenario
    at another speedup (a lower one keeps the simulators' scrape cost out of their step times).
    """
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.frontier")
    parser.add_argument(
        "scenario", help="a flood scenario with fifo, fairlane, fairlane-no-flood arms"
    )
    parser.add_argument("--shares", default=",".join(f"{s:g}" for s in DEFAULT_SHARES))
    parser.add_argument(
        "--preemption", default="on", help="on, off or on,off: batch preemptible or not"
    )
    parser.add_argument(
        "--batch-caps",
        default="",
        help="comma-separated caps on batch requests per engine (none: uncapped, the default)",
    )
    parser.add_argument("--speedup", type=float, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    scenario = load_scenario(args.scenario).with_overrides(speedup=args.speedup)
    shares = [float(s) for s in args.shares.split(",") if s.strip()]
    settings = [s.strip() for s in args.preemption.split(",") if s.strip()]
    if not settings or set(settings) - {"on", "off"}:
        parser.error("--preemption takes on, off or on,off")
    caps = tuple(
        None if c.strip() == "none" else int(c) for c in args.batch_caps.split(",") if c.strip()
    )
    args.out.mkdir(parents=True, exist_ok=True)
    # A SIGTERM unwinds like Ctrl-C, so each arm's process group stops its processes.
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        on = tuple(s == "on" for s in settings)
        result = measure(scenario, shares, args.out, on, caps or (None,))
    except KeyboardInterrupt:
        print("frontier: interrupted; every process was stopped", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    (args.out / "frontier.json").write_text(json.dumps(result, indent=2))
    plot(result, _targets(scenario), args.out / "frontier.png")
    print(f"frontier: {args.out / 'frontier.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
