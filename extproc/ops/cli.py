"""The ``fairlane`` command.

Each sub-command lives in its own module, which exposes ``add_arguments(parser)`` and
``run(args) -> int``. Only the chosen sub-command's module is imported, so ``fairlane check``
does not pay for grpc and ``fairlane sim`` does not load Envoy's protobufs. A sub-command
whose modules come from an extra (``fairlane bench``: ``pip install 'fairlane[bench]'``) names
the extra and exits 2 when they are missing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": (
        "extproc.ops.up",
        "Envoy + the ext_proc service + backends on one port (Ctrl-C stops all)",
    ),
    "serve": ("extproc.transport.server", "the ext_proc gRPC service alone, for an existing Envoy"),
    "sim": (
        "loadtests.sim.cli",
        "one simulated vLLM server (per-step engine, vLLM API and metrics)",
    ),
    "check": ("extproc.ops.check", "validate a policy file and print its tiers and tenants"),
    "hash-key": (
        "extproc.ops.hash_key",
        "print the sha256: form of an API key for a policy's api_keys (KEY or - for stdin)",
    ),
    "render-envoy": (
        "extproc.envoy.render",
        "write the Envoy bootstrap (or --snippet) for a deployment YAML, checked by Envoy",
    ),
    "bench": (
        "loadtests.bench.cli",
        "run a load scenario A/B (FIFO vs fairlane) and write a report",
    ),
}

# Third-party modules that only an extra (pyproject.toml) installs: module -> extra.
EXTRA_OF_MODULE = {"locust": "bench", "matplotlib": "bench", "numpy": "bench"}

# Extra modules a sub-command imports only when it gets there (the plots at the end of a
# bench run), looked for before it starts.
IMPORTED_LATER: dict[str, tuple[str, ...]] = {"bench": ("matplotlib", "numpy")}


def load(command: str) -> ModuleType:
    """Import ``command``'s module; exit 2 naming the extra when a module of one is missing."""
    later = IMPORTED_LATER.get(command, ())
    missing = next((name for name in later if importlib.util.find_spec(name) is None), None)
    if missing is None:
        try:
            return importlib.import_module(COMMANDS[command][0])
        except ModuleNotFoundError as e:
            missing = (e.name or "").partition(".")[0]
            if missing not in EXTRA_OF_MODULE:
                raise
    extra = EXTRA_OF_MODULE[missing]
    print(
        f"fairlane {command} needs the {extra} extra ({missing} is not installed): "
        f"pip install 'fairlane[{extra}]'",
        file=sys.stderr,
    )
    raise SystemExit(2)


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairlane", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            load(name).add_arguments(sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(args_list)
    return int(load(args.command).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
