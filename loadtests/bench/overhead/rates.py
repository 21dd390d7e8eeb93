"""Which open-loop rates each arm of the overhead bench runs.

A scenario's rates are numbers, or ``half_capacity``: half of the arm's own saturation
req/s, known only once that arm's saturation phase ran. The fairlane arms resolve it each
for itself; ``direct``, which runs last, runs every number and every fairlane arm's half, so
each fairlane arm is compared with Envoy alone at its own rates.
"""

from __future__ import annotations

from loadtests.bench.overhead.scenario import HALF_CAPACITY, Rate


def half_capacity(capacity_rps: float | None) -> float | None:
    """The ``half_capacity`` rate of an arm with this saturation req/s (whole req/s)."""
    if not capacity_rps or capacity_rps < 2:
        return None
    return float(round(capacity_rps / 2))


def resolve_rates(
    rates: tuple[Rate, ...], capacity_rps: float | None
) -> list[tuple[float, str | None]]:
    """A fairlane arm's rates as (req/s, label): ``half_capacity`` becomes half its own
    capacity (left out when it has none); a number stays itself."""
    found: list[tuple[float, str | None]] = []
    for rate in rates:
        if isinstance(rate, str):
            half = half_capacity(capacity_rps)
            if half is not None:
                found.append((half, HALF_CAPACITY))
        else:
            found.append((float(rate), None))
    return found


def direct_rates(
    rates: tuple[Rate, ...], halves: dict[str, float]
) -> list[tuple[float, str | None]]:
    """The direct arm's rates: every number, and every fairlane arm's ``half_capacity``
    (labelled with the arms it is half of), sorted, each once."""
    numbers = {float(r): None for r in rates if not isinstance(r, str)}
    labels: dict[float, list[str]] = {}
    if HALF_CAPACITY in rates:
        for arm, rate in halves.items():
            labels.setdefault(rate, []).append(arm)
    merged: dict[float, str | None] = dict(numbers)
    for rate, arms in labels.items():
        if rate not in merged:
            merged[rate] = f"{HALF_CAPACITY} of {', '.join(arms)}"
    return sorted(merged.items())
