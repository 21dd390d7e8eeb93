"""README.md is the front page (and the PyPI page): short, with the quickstart commands CI
runs, and every task a user comes for reachable from it in two clicks.

The docs site itself is built with ``mkdocs build --strict`` by ``scripts/check``, whose hook
(``docs/hooks.py``) checks the pages against the code; these tests check what the site build
cannot see: the README and the files beside it.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")

# What a user comes for, and the page that answers it.
TASKS = {
    "install": "docs/getting-started/install.md",
    "first request": "docs/getting-started/first-request.md",
    "deploy beside an existing Envoy": "docs/guides/existing-envoy.md",
    "write a policy": "docs/guides/policy.md",
    "load-test the tiers": "docs/guides/load-test.md",
    "read the metrics": "docs/reference/metrics.md",
}


def links(page: Path) -> set[Path]:
    """The repository files a Markdown page links to (external links left out)."""
    found = set()
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        found.add((page.parent / target).resolve())
    return found


def test_the_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the docs site holds the rest"


def test_the_readme_keeps_the_command_ci_runs() -> None:
    assert "./scripts/test" in (REPO / ".ci" / "run").read_text()
    assert "./scripts/test" in README.read_text()
    assert "./scripts/up" in README.read_text()


def test_every_link_of_the_readme_resolves() -> None:
    missing = [str(p.relative_to(REPO)) for p in links(README) if not p.exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


@pytest.mark.parametrize(("task", "page"), sorted(TASKS.items()))
def test_each_task_is_two_clicks_from_the_readme(task: str, page: str) -> None:
    target = (REPO / page).resolve()
    assert target.exists(), page
    first = links(README)
    second = {p for hop in first if hop.suffix == ".md" and hop.exists() for p in links(hop)}
    assert target in first | second, f"{task}: {page} is more than two clicks from README.md"


def test_license_changelog_and_contributing_exist() -> None:
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["readme"] == "README.md"
    assert (REPO / "CHANGELOG.md").read_text().startswith("# Changelog")
    contributing = (REPO / "CONTRIBUTING.md").read_text()
    for must in ("./scripts/test", "scripts/check", "not integration and not conformance"):
        assert must in contributing, must


def test_the_docs_build_is_part_of_the_checks() -> None:
    check = (REPO / "scripts" / "check").read_text()
    assert re.search(r"mkdocs build --strict", check), "scripts/check must build the docs"
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ;]", req, maxsplit=1)[0] for req in dev["dev"]}
    assert {"mkdocs", "mkdocs-material"} <= names
