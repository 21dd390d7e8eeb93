"""A scenario file as read, before validation: where it is, its data and its node tree.

``fairlane bench NAME`` takes a name under ``loadtests/scenarios/`` or a path, and the file's
``kind`` decides which parser validates it (an A/B scenario, or ``kind: overhead``), so the
file is read once here and parsed by whichever applies. The node tree keeps every value's
line, for errors as ``FILE:LINE: field.path: message``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import Node

from extproc.yamlfile import YamlSyntaxError, compose

SCENARIO_DIR = Path(__file__).resolve().parents[2] / "scenarios"


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message names the file and every bad field."""


def resolve(name_or_path: str) -> Path:
    """A path as given, else ``loadtests/scenarios/NAME[.yaml]``."""
    given = Path(name_or_path)
    if given.is_file():
        return given
    for candidate in (SCENARIO_DIR / name_or_path, SCENARIO_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))
    raise ScenarioError(
        f"{name_or_path}: no such scenario file (names under {SCENARIO_DIR}: {', '.join(known)})"
    )


@dataclass(frozen=True)
class Document:
    """A scenario file as read: its data, and its node tree for the lines of errors."""

    path: Path
    data: Any
    node: Node | None = None

    @property
    def kind(self) -> str:
        """``ab`` (arms compared on a simulated fleet, the default) or ``overhead``."""
        kind = self.data.get("kind", "ab") if isinstance(self.data, Mapping) else "ab"
        return kind if isinstance(kind, str) else "ab"


def read_document(name_or_path: str | Path) -> Document:
    """Read (not validate) a scenario file; YAML syntax errors as ``file:line:``."""
    path = resolve(str(name_or_path))
    try:
        text = path.read_text()
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc}") from exc
    try:
        node = compose(text, str(path))
    except YamlSyntaxError as exc:
        raise ScenarioError(exc.message) from None
    return Document(path, yaml.safe_load(text), node)
