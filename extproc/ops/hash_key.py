"""``fairlane hash-key KEY``: the ``sha256:HEX`` entry of an API key, for a policy's
``api_keys``.

The policy then holds only the key's digest; the gateway hashes what clients present and
compares digests (``extproc.policy.keys``). ``KEY`` given as ``-`` (or left out) is read
from stdin, so the key need not appear in the shell's history or the process list; at a
terminal it is asked for without echo.
"""

from __future__ import annotations

import argparse
import getpass
import sys

from extproc.policy import hashed_form


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "key",
        metavar="KEY",
        nargs="?",
        default="-",
        help="the API key; '-' or nothing reads it from stdin (keeps it out of shell history)",
    )


def run(args: argparse.Namespace) -> int:
    key = _read_key() if args.key == "-" else args.key
    problem = _problem(key)
    if problem is not None:
        print(f"fairlane hash-key: {problem}", file=sys.stderr)
        return 2
    print(hashed_form(key))
    return 0


def _read_key() -> str:
    """The key from stdin: one line (its newline stripped), asked for without echo at a
    terminal."""
    if sys.stdin.isatty():
        return getpass.getpass("API key: ")
    return sys.stdin.readline().rstrip("\r\n")


def _problem(key: str) -> str | None:
    """Why ``key`` could never be presented as a bearer token, if it could not."""
    if not key:
        return "the key is empty"
    if any(ch.isspace() for ch in key):
        return "an API key cannot contain whitespace"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return "the key is not valid UTF-8"
    return None
