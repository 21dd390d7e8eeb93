"""``python -m loadtests.bench.overhead``: ``fairlane bench overhead`` with its older flags.

``python -m loadtests.bench.overhead [--rates 100,500 --duration 10 --concurrency 32 --arms ...]``
``python -m loadtests.bench.overhead backend --port 8000`` (the instant backend alone)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtests.bench.overhead import runner
from loadtests.bench.overhead.backend import serve_backend
from loadtests.bench.overhead.eventloop import run_loop
from loadtests.bench.overhead.scenario import HALF_CAPACITY, OverheadScenario, Rate, parse_overhead
from loadtests.bench.scenario.document import ScenarioError, read_document


def _rates(text: str) -> list[Rate]:
    return [
        HALF_CAPACITY if v.strip() == HALF_CAPACITY else float(v)
        for v in text.split(",")
        if v.strip()
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.overhead", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    backend = sub.add_parser("backend", help="the instant backend alone")
    backend.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--rates", type=_rates, default=None, help="req/s list, e.g. 100,half_capacity"
    )
    parser.add_argument("--duration", type=float, default=None, help="wall seconds per phase")
    parser.add_argument(
        "--concurrency", type=int, default=None, help="connections at saturation (0: skip)"
    )
    parser.add_argument("--arms", type=lambda s: s.split(","), default=None)
    parser.add_argument("--out", type=Path, default=None)
    return parser


def _with_flags(scenario: OverheadScenario, args: argparse.Namespace) -> OverheadScenario:
    """The shipped scenario with ``--rates`` (and only the targets at those rates) and
    ``--concurrency``."""
    changes: dict[str, Any] = {}
    if args.rates is not None:
        changes["rates"] = tuple(args.rates)
        changes["targets"] = tuple(
            t for t in scenario.targets if t.rate is None or t.rate in args.rates
        )
    if args.concurrency is not None:
        changes["saturation_connections"] = max(0, args.concurrency)
    return dataclasses.replace(scenario, **changes)


def main(argv: Sequence[str] | None = None) -> int:
    """``backend`` alone, or an alias for ``fairlane bench overhead`` with its old flags."""
    args = _parser().parse_args(argv)
    if args.command == "backend":
        run_loop(serve_backend(args.port))
        return 0
    try:
        scenario = parse_overhead(read_document("overhead")).with_overrides(
            duration_s=args.duration, arms=args.arms
        )
    except ScenarioError as exc:
        print(f"python -m loadtests.bench.overhead: {exc}", file=sys.stderr)
        return 1
    return runner.run_scenario(_with_flags(scenario, args), args.out)


if __name__ == "__main__":
    sys.exit(main())
