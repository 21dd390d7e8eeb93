"""Shared helpers for the deployment tests: the Debian tools they need, and the repository.

``docker-compose`` (Debian's 1.29, which parses compose files without a Docker engine) and
``promtool`` (Debian's ``prometheus``) are installed by ``scripts/setup-tools``, which
``scripts/test`` runs first. A missing tool is a FAILURE here, never a skip: a check that
silently does not run is how configs rot. The message says what is missing, why
``setup-tools`` could not install it (its error file), and how to install it by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
SETUP_ERROR = Path(os.environ.get("FAIRLANE_CACHE", Path.home() / ".cache" / "fairlane")) / (
    "setup-tools.error"
)
# command -> the Debian package that ships it
DEBIAN_PACKAGE = {
    "docker-compose": "docker-compose",
    "promtool": "prometheus",
    "prometheus": "prometheus",
}


def require_tool(name: str) -> str:
    """The path of ``name``, or fail the test saying how to get it."""
    found = shutil.which(name)
    if found:
        return found
    package = DEBIAN_PACKAGE[name]
    reason = SETUP_ERROR.read_text().strip() if SETUP_ERROR.is_file() else ""
    pytest.fail(
        f"`{name}` is not installed, so this check cannot run. Install it with "
        f"`scripts/setup-tools` (what scripts/test runs) or by hand: "
        f"`apt-get update && apt-get install -y --no-install-recommends {package}`."
        + (f"\nscripts/setup-tools reported:\n{reason}" if reason else ""),
        pytrace=False,
    )


def run_tool(
    argv: list[str],
    cwd: Path = REPO,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> str:
    """Run a tool; fail the test with its output when it exits non-zero; return stdout."""
    result = subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False, env=env
    )
    if result.returncode != 0:
        pytest.fail(
            f"`{' '.join(argv)}` exited {result.returncode}:\n{result.stderr}{result.stdout}",
            pytrace=False,
        )
    return result.stdout


def run_promtool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``promtool ARGS`` (failing the test when promtool is missing); the caller judges the
    exit status, since some checks expect promtool to refuse."""
    return subprocess.run(
        [require_tool("promtool"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="session")
def docker_compose() -> str:
    return require_tool("docker-compose")


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_tool("promtool")
