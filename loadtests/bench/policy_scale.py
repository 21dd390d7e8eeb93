"""A policy rescaled to a simulated fleet's speedup: what ``policy: default`` in a scenario means.

The simulators run ``speedup`` times faster than the wall clock; the gateway does not know and
applies its policy's durations in wall-clock seconds, so a policy written for real engines
would mean durations ``speedup`` times longer in the simulated fleet's time (a 10 s queue
deadline would be 200 simulated seconds at speedup 20). A scenario that names
``policy: default`` therefore gets the shipped default with every duration the gateway
applies on its own clock divided by the speedup, and nothing else changed, so the benchmark
measures the policy an operator deploys. A gate's ``max_itl_ms`` is not divided: it is
compared with the engine's own inter-token latency, which the simulator reports in simulated
seconds. ``rescale_policy`` lists the fields, the rounding and the floors.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from extproc.policy import Backpressure, Tier

MIN_SCRAPE_INTERVAL_S = 0.005
"""The shortest ``backpressure.scrape_interval_s`` a rescaled policy gets (wall seconds)."""

TIER_SECONDS = ("queue_deadline_s", "slo_latency_s", "reserved_idle_s")
TIER_MILLISECONDS = ("slo_ttft_ms", "hedge_after_ms")
AGING_SECONDS = ("seconds_per_rank",)
BACKPRESSURE_SECONDS = ("scrape_interval_s", "stale_after_s")
UNSCALED_TIME_FIELDS = ("gate.max_itl_ms",)
"""Durations left alone: they are compared with the engines' metrics, in simulated time."""

_TIER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Tier)}
_BACKPRESSURE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Backpressure)}
# Durations whose model default applies when the file leaves them out.
_DEFAULTED_TIER_SECONDS = tuple(
    k for k in TIER_SECONDS if isinstance(_TIER_DEFAULTS.get(k), int | float)
)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _seconds(value: Any, speedup: float) -> Any:
    """``value / speedup`` to 6 significant digits; anything not a number (``null``, a
    mistake the policy's validation will report) is left as it is."""
    if not _is_number(value):
        return value
    return float(f"{value / speedup:.6g}")


def _milliseconds(value: Any, speedup: float) -> Any:
    """Whole milliseconds (the schema's integers >= 1): rounded, at least 1."""
    if not _is_number(value):
        return value
    return max(1, round(value / speedup))


def rescale_policy(policy: Mapping[str, Any], speedup: float) -> dict[str, Any]:
    """The policy mapping (a ``yaml.safe_load`` of a policy file) with every duration the
    gateway applies in wall-clock seconds divided by ``speedup``; a new mapping, the input
    is not changed.
    Parts that are not of the expected shape are left as they are, for the policy's own
    validation to report.

    Divided by the speedup (the full list of the policy's time fields, see
    ``extproc/policy/parse.py``):

    - per tier: ``queue_deadline_s``, ``slo_latency_s``, ``reserved_idle_s`` (seconds) and
      ``slo_ttft_ms``, ``hedge_after_ms`` (milliseconds: whole numbers >= 1 in the policy
      schema, so they are rounded to the nearest millisecond, at least 1);
      ``aging.seconds_per_rank``;
    - ``backpressure.scrape_interval_s`` and ``stale_after_s``.

    A field the file leaves out but whose model default is a duration (``reserved_idle_s``, the
    two ``backpressure`` fields) is written out rescaled, or the default would silently stay in
    wall-clock seconds.

    **Not** divided: a gate's ``max_itl_ms``. It is compared with the engine's own
    ``vllm:inter_token_latency_seconds``, which the simulator reports in simulated seconds (like
    a real vLLM on its own clock), so it already means simulated time; divided by 20, batch's
    150 ms bound would be 7.5 ms and no ``llama-8b-l4`` step (~55 ms) would ever pass it. The
    hand-written ``loadtests/scenarios/policies/bench-x20.yaml`` leaves it unscaled for the same
    reason.

    Rounding and floors: seconds are rounded to 6 significant digits (a readable file, and 10 /
    3 is not worth 17 digits). The scrape interval does not go below ``MIN_SCRAPE_INTERVAL_S``
    (5 ms): at 5 ms each simulator already renders its ``/metrics`` 200 times a wall second and
    the service parses as many scrapes per backend; shorter intervals spend a small machine's
    CPU on scraping and are below what the event loop's timers keep accurately. (The
    hand-written x20 policies chose 0.05 s, one simulated second, ten times the default's 0.1
    simulated seconds, to keep scraping cheap; the rescaled default keeps the default's 0.1
    simulated seconds down to that floor, so up to speedup 20.) Staleness is a number of missed
    scrapes, so when the floor applies ``stale_after_s`` keeps at least its original ratio to
    the scrape interval (10 scrapes in the default) instead of falling below the interval, which
    would make every backend look stale.
    """
    if not (math.isfinite(speedup) and speedup > 0):
        raise ValueError(f"speedup must be a finite number > 0, got {speedup}")
    scaled = copy.deepcopy(dict(policy))
    tiers = scaled.get("tiers")
    for tier in tiers if isinstance(tiers, list) else ():
        if not isinstance(tier, dict):
            continue
        for key in _DEFAULTED_TIER_SECONDS:
            tier.setdefault(key, _TIER_DEFAULTS[key])
        for key in TIER_SECONDS:
            if key in tier:
                tier[key] = _seconds(tier[key], speedup)
        for key in TIER_MILLISECONDS:
            if key in tier:
                tier[key] = _milliseconds(tier[key], speedup)
        aging = tier.get("aging")
        if isinstance(aging, dict):
            for key in AGING_SECONDS:
                if key in aging:
                    aging[key] = _seconds(aging[key], speedup)
    backpressure = scaled.get("backpressure", {})
    if isinstance(backpressure, dict):
        original = {k: backpressure.get(k, _BACKPRESSURE_DEFAULTS[k]) for k in BACKPRESSURE_SECONDS}
        interval, stale = original["scrape_interval_s"], original["stale_after_s"]
        if _is_number(interval) and interval > 0:
            floored = max(_seconds(interval, speedup), MIN_SCRAPE_INTERVAL_S)
            backpressure["scrape_interval_s"] = floored
            if _is_number(stale):
                # Stale after as many missed scrapes as the original at least.
                backpressure["stale_after_s"] = max(
                    _seconds(stale, speedup), _seconds(stale / interval * floored, 1.0)
                )
            else:
                backpressure["stale_after_s"] = stale
        else:
            backpressure.update({k: _seconds(v, speedup) for k, v in original.items()})
        scaled["backpressure"] = backpressure
    return scaled


def scaled_file_name(source: Path, speedup: float) -> str:
    """``policy-default-x20.yaml``: the rescaled copy's name in a run's output directory."""
    return f"policy-{source.stem}-x{speedup:g}.yaml"


def render_scaled_policy(source: Path, speedup: float) -> str:
    """The policy file at ``source`` rescaled for ``speedup``, as YAML text with a header
    saying what was done (the file ``fairlane serve --policy`` reads in a bench run)."""
    data = yaml.safe_load(source.read_text(encoding="utf-8"))
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: a policy must be a mapping, got {type(data).__name__}")
    header = (
        f"# {source} rescaled for speedup {speedup:g} by loadtests/bench/policy_scale.py:\n"
        f"# every duration the gateway applies in wall-clock seconds divided by {speedup:g},\n"
        f"# the scrape interval at least {MIN_SCRAPE_INTERVAL_S:g} s; gate max_itl_ms unscaled\n"
        "# (engines report inter-token latency in simulated time). Generated for one run:\n"
        "# edit the source, not this copy.\n"
    )
    return header + yaml.safe_dump(
        rescale_policy(data, speedup), sort_keys=False, default_flow_style=False
    )


def write_scaled_policy(source: Path, speedup: float, directory: Path) -> Path:
    """Write the rescaled copy of ``source`` into ``directory`` (created if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / scaled_file_name(source, speedup)
    path.write_text(render_scaled_policy(source, speedup), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtests.bench.policy_scale SPEEDUP [POLICY]``: print the rescaled
    policy (the default policy unless POLICY is given), e.g. to read what a run used."""
    import argparse

    from extproc.policy import DEFAULT_POLICY_PATH

    parser = argparse.ArgumentParser(description="Print a policy rescaled for a speedup.")
    parser.add_argument("speedup", type=float)
    parser.add_argument("policy", type=Path, nargs="?", default=DEFAULT_POLICY_PATH)
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(render_scaled_policy(args.policy, args.speedup))
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"policy_scale: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
