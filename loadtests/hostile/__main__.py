"""``python -m loadtests.hostile``: a real ``fairlane serve`` under hostile HTTP/2 clients.

Runs the attacks one after the other, each on a service of its own (``--one-service``: all
on one) while a legit client calls it, prints a markdown table (a row per attack, PASS/FAIL
where the attack has a target) and stops every service. About a minute; ``--quick`` runs
every attack small (``--only`` a few of them: a check in seconds).

    python -m loadtests.hostile [--rounds 3] [--seconds 4] [--only 1,5,7] [--out FILE]

Exit status: 0 when every target is met, 1 when one is not or an attack broke, 2 when the
run itself broke (a service that did not start: no table).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from loadtests.hostile.bench import ATTACKS, Options, run


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.hostile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = Options()
    parser.add_argument(
        "--quick", action="store_true", help="every attack small (a check, not a measurement)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"rounds of the one-connection rapid reset (default {defaults.rounds})",
    )
    parser.add_argument(
        "--streams",
        type=int,
        default=None,
        help=f"streams per rapid-reset round (default {defaults.streams_per_round:,})",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help=f"each flood's and the flow-control attack's limit (default {defaults.seconds:g})",
    )
    numbers = sorted({number for number, _ in ATTACKS}, key=int)
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated attack numbers to run ({','.join(numbers)}; default all)",
    )
    parser.add_argument(
        "--one-service",
        action="store_true",
        help="attack one service with everything in turn (default: a new one per attack)",
    )
    parser.add_argument("--policy", type=Path, default=defaults.policy)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    options = Options(policy=args.policy, one_service=args.one_service)
    if args.quick:
        options = options.quick()
    only = frozenset(n.strip() for n in args.only.split(",") if n.strip())
    unknown = only - {number for number, _ in ATTACKS}
    if unknown:
        parser.error(f"no attack numbered {', '.join(sorted(unknown))}")
    changes: dict[str, object] = {"only": only}
    if args.rounds is not None:
        changes["rounds"] = max(1, args.rounds)
    if args.streams is not None:
        changes["streams_per_round"] = max(1, args.streams)
    if args.seconds is not None:
        changes["seconds"] = max(0.1, args.seconds)
    try:
        report = run(dataclasses.replace(options, **changes))  # type: ignore[arg-type]
    except KeyboardInterrupt:
        print("interrupted: the service was stopped", file=sys.stderr)
        return 130
    except Exception:  # a service that did not start, a legit client that died: no table
        traceback.print_exc()
        print("the benchmark broke (above); every service was stopped", file=sys.stderr)
        return 2
    if args.out is not None:
        args.out.write_text(report.markdown())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
