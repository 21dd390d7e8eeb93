"""The import contracts in pyproject.toml (``[tool.importlinter]``) hold, and catch a breach.

Each breach case copies ``extproc`` and the contracts into a temporary directory, appends one
import that breaks one contract, and runs ``lint-imports`` on the copy: the report must name
that import. The real tree is checked by the same command.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "400"}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", "--config", "pyproject.toml"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_keeps_every_contract() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr


# (module under extproc/, the line appended to it, what the report must say)
BREACHES = {
    "core imports asyncio": (
        "core/priority.py",
        "import asyncio",
        "extproc.core.priority -> asyncio",
    ),
    "policy imports grpc": (
        "policy/model.py",
        "import grpc",
        "extproc.policy.model -> grpc",
    ),
    "core imports the transport": (
        "core/prompt.py",
        "from extproc.transport import codec",
        "extproc.core.prompt -> extproc.transport.codec",
    ),
    "fleet state imports aiohttp": (
        "fleet/seats.py",
        "import aiohttp",
        "extproc.fleet.seats -> aiohttp",
    ),
    "fleet state imports the poller": (
        "fleet/vllm_metrics.py",
        "from extproc.fleet import poller",
        "extproc.fleet.vllm_metrics -> extproc.fleet.poller",
    ),
    "policy imports the core (a lower layer importing a higher one)": (
        "policy/model.py",
        "from extproc.core import scheduler",
        "extproc.policy.model -> extproc.core.scheduler",
    ),
    "the wire names import the policy (the bottom layer importing one above)": (
        "wire.py",
        "from extproc.policy import model",
        "extproc.wire -> extproc.policy.model",
    ),
    "protobuf outside the codec, servicer and server": (
        "transport/prometheus.py",
        "from google.protobuf import struct_pb2",
        "extproc.transport.prometheus -> google",
    ),
    "betterproto2 outside the renderer": (
        "envoy/bootstrap.py",
        "import betterproto2",
        "extproc.envoy.bootstrap -> betterproto2",
    ),
    "the service imports loadtests": (
        "ops/check.py",
        "import loadtests.sim.engine",
        "extproc.ops.check -> loadtests",
    ),
    "a cycle between two core modules": (
        "core/prompt.py",
        "from extproc.core import classify",  # classify imports prompt
        "No cycles are allowed in extproc.core.",
    ),
}


@pytest.mark.parametrize("case", BREACHES)
def test_a_breach_is_reported(case: str, tmp_path: Path) -> None:
    module, line, expected = BREACHES[case]
    shutil.copytree(
        REPO / "extproc", tmp_path / "extproc", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with (tmp_path / "extproc" / module).open("a") as f:
        f.write(f"\n{line}\n")

    result = lint_imports(tmp_path)

    assert result.returncode != 0
    assert expected in result.stdout, result.stdout + result.stderr
