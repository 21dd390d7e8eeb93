"""fairlane installed from a wheel works outside a checkout.

Everything else in the suite runs against the source tree, where ``policies/`` and
``deploy/`` sit next to the package, so a file the package reads but the wheel does not ship
would never be noticed there. This test builds the wheel from a copy of the sources (the
checkout is left as it is), installs it into a directory of its own, and runs the
``fairlane`` it installed from a directory that is not a checkout: ``check`` with the
default policy, and ``render-envoy`` (typed check and ``envoy --mode validate`` included)
for a deployment that names no policy. The wheel is built without network access
(``--no-build-isolation --no-index``), with the setuptools of this environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# What the wheel is built from (pyproject.toml names the README and the packages).
SOURCES = ("pyproject.toml", "README.md", "extproc", "loadtests", "policies")
DEPLOYMENT = """\
listen: {host: 127.0.0.1, port: 18080}
admin: {host: 127.0.0.1, port: 18081}
service: {host: 127.0.0.1, port: 18082}
backends:
  - {url: http://127.0.0.1:18101, region: local}
"""


def _can_build_wheels_offline() -> bool:
    """setuptools builds wheels itself from 70.1 on; before that it needs ``wheel``."""
    try:
        version = tuple(int(part) for part in metadata.version("setuptools").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    if version >= (70, 1):
        return True
    try:
        metadata.version("wheel")
    except metadata.PackageNotFoundError:
        return False
    return True


@dataclass(frozen=True)
class Installed:
    wheel: Path
    site: Path
    """The directory the wheel was installed into (``pip install --target``)."""
    cwd: Path
    """Where the commands run: not a checkout, nothing of fairlane's beside it."""

    def fairlane(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run the installed ``fairlane`` with this environment's interpreter (for its
        dependencies), importing fairlane only from :attr:`site`."""
        env = {**os.environ, "PYTHONPATH": str(self.site)}
        return subprocess.run(
            [sys.executable, str(self.site / "bin" / "fairlane"), *args],
            cwd=self.cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )


def _copy_sources(target: Path) -> None:
    """The sources as they are in the checkout, symlinks kept: the wheel build itself must
    turn ``extproc/default_policy.yaml`` into a file."""
    target.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")
    for name in SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, target / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(source, target / name)


def _pip(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    if not _can_build_wheels_offline():
        pytest.fail(
            "building a wheel offline needs setuptools>=70.1, which the dev extra installs"
            " (scripts/bootstrap, or pip install -e '.[dev]')"
        )
    with tempfile.TemporaryDirectory(prefix="fairlane-wheel-") as tmp:
        root = Path(tmp).resolve()
        _copy_sources(root / "src")
        offline = ("--no-deps", "--no-index", "-q")
        _pip("wheel", *offline, "--no-build-isolation", "-w", str(root / "dist"), str(root / "src"))
        [wheel] = (root / "dist").glob("fairlane-*.whl")
        _pip("install", *offline, "--target", str(root / "site"), str(wheel))
        (root / "work").mkdir()
        yield Installed(wheel, root / "site", root / "work")


def test_the_wheel_ships_the_default_policy_as_a_file(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        shipped = wheel.read("extproc/default_policy.yaml")
    assert shipped == (REPO / "policies" / "default.yaml").read_bytes()


def test_check_finds_the_default_policy(installed: Installed) -> None:
    result = installed.fairlane("check")
    assert result.returncode == 0, result.stdout + result.stderr
    packaged = installed.site / "extproc" / "default_policy.yaml"
    assert str(packaged) in result.stdout + result.stderr
    assert "interactive" in result.stdout


def test_render_envoy_renders_and_validates_a_deployment(installed: Installed) -> None:
    (installed.cwd / "deploy.yaml").write_text(DEPLOYMENT)
    result = installed.fairlane("render-envoy", "deploy.yaml", "-o", "envoy.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "typed check: OK" in result.stderr
    assert "envoy --mode validate: OK" in result.stderr
    # the policy came from the package, not from a checkout
    assert str(installed.site / "extproc" / "default_policy.yaml") in result.stderr
    assert "fairlane_extproc" in (installed.cwd / "envoy.yaml").read_text()


def test_render_envoy_without_a_deployment_says_what_to_pass(installed: Installed) -> None:
    result = installed.fairlane("render-envoy")
    assert result.returncode == 2
    assert "`fairlane render-envoy DEPLOYMENT.yaml`" in result.stderr


def test_the_commands_ran_the_installed_package(installed: Installed) -> None:
    env = {**os.environ, "PYTHONPATH": str(installed.site)}
    result = subprocess.run(
        [sys.executable, "-c", "import extproc; print(extproc.__file__)"],
        cwd=installed.cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert Path(result.stdout.strip()).is_relative_to(installed.site)
