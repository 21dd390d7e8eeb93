"""The ``fairlane`` command.

Each sub-command lives in its own module, which exposes ``add_arguments(parser)`` and
``run(args) -> int``. Only the chosen sub-command's module is imported, so ``fairlane check``
does not pay for grpc and ``fairlane sim`` does not load Envoy's protobufs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

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
    "render-envoy": (
        "extproc.envoy.render",
        "write the Envoy bootstrap (or --snippet) for a deployment YAML, checked by Envoy",
    ),
    "bench": (
        "loadtests.bench.cli",
        "run a load scenario A/B (FIFO vs fairlane) and write a report",
    ),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairlane", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).add_arguments(sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(args_list)
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
