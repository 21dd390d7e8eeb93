"""Reading a scenario's fields out of its YAML node tree, every mistake with its line.

Built on extproc's located reader (:class:`extproc.yamlfile.LocatedReader`, the policy
parser's too), so each problem comes back as ``FILE:LINE: field.path: message`` and the
whole file is checked in one pass. What is the benchmark's own is the wording: a scenario's
values are short, so a message shows the value it refused (``must be a number > 0, got
'fast'``), and an error points at the line of the field's key, where a person reads it.

A value is a :class:`Field` (its path, its node, the node its errors point at); a mapping is
a :class:`Section` of fields. Checks (``positive``, ``integer_at_least`` ...) take a plain
value and return it, or None to refuse it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from yaml.nodes import MappingNode, Node, SequenceNode

from extproc.yamlfile import LocatedReader, join_path, represent
from loadtests.bench.scenario.document import Document, ScenarioError

T = TypeVar("T")
TOP_LEVEL = "(top level)"
"""How an error about the document itself (not a mapping) names its place."""


@dataclass(frozen=True)
class Field:
    """One value of the file: its path (``groups[0].rate``), its node, and the node whose
    line its errors give (the field's key; a list item or the document: itself)."""

    path: str
    node: Node
    at: Node


@dataclass(frozen=True)
class Section:
    """One mapping of the file: its own place, and its fields by key (unknown ones too)."""

    place: Field
    fields: dict[Any, Field]

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str) -> Field | None:
        return self.fields.get(key)


class FieldReader:
    """Reads fields and collects located errors; :meth:`failure` is every one of them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._located = LocatedReader(str(path))

    @property
    def errors(self) -> list[str]:
        return self._located.errors

    def failure(self) -> ScenarioError:
        return ScenarioError("\n".join(self.errors))

    def error(self, field: Field, message: str) -> None:
        self._located.error(field.at, field.path or TOP_LEVEL, message)

    def error_in(self, section: Section, key: str, message: str) -> None:
        """An error about field ``key``; on the section's line when the key is absent."""
        field = section.get(key)
        at = field.at if field is not None else section.place.at
        self._located.error(at, join_path(section.place.path, key), message)

    def value(self, field: Field) -> Any:
        """The field's plain value (lists and mappings whole), as ``yaml.safe_load`` reads it."""
        return self._located.construct(field.node)

    def pairs(self, field: Field) -> list[tuple[Any, Field]] | None:
        """A mapping's (key, field) pairs with any keys, or None when it is not a mapping.
        A key given twice is read as ``yaml.safe_load`` reads it: the last value, in the
        first one's place (and line)."""
        if not isinstance(field.node, MappingNode):
            return None
        pairs: dict[Any, Field] = {}
        for key_node, value_node in self._located.pairs(field.node):
            key = self._located.construct(key_node)
            at = pairs[key].at if key in pairs else key_node
            pairs[key] = Field(join_path(field.path, str(key)), value_node, at)
        return list(pairs.items())

    def section(self, field: Field, allowed: Sequence[str]) -> Section | None:
        """The mapping at ``field``, with an error for each key not in ``allowed``."""
        pairs = self.pairs(field)
        if pairs is None:
            self.error(field, f"must be a mapping, got {type(self.value(field)).__name__}")
            return None
        for key, item in pairs:
            if key not in allowed:
                self.error(item, f"unknown field (allowed: {', '.join(allowed)})")
        return Section(field, dict(pairs))

    def items(self, field: Field | None) -> list[Field] | None:
        """A list's items, or None when ``field`` is absent or not a list."""
        if field is None or not isinstance(field.node, SequenceNode):
            return None
        return [Field(f"{field.path}[{i}]", n, n) for i, n in enumerate(field.node.value)]

    def get(
        self,
        section: Section,
        key: str,
        check: Callable[[Any], T | None],
        what: str,
        default: Any = dataclasses.MISSING,
    ) -> Any:
        """Field ``key`` passed through ``check``; ``default`` when absent or null (an
        error when there is no default), None after an error."""
        field = section.get(key)
        value = None if field is None else self.value(field)
        if field is None or value is None:
            if default is dataclasses.MISSING:
                self.error_in(section, key, f"required ({what})")
                return None
            return default
        checked = check(value)
        if checked is None:
            self.error(field, f"must be {what}, got {value!r}")
        return checked


def document_root(document: Document) -> Field:
    """The document as a field: its node tree, or for data built in code (no node) one made
    from the data, whose errors then name the file without a line."""
    node = document.node if document.node is not None else represent(document.data)
    return Field("", node, node)


def read_whole(document: Document, read: Callable[[FieldReader, Field], T | None]) -> T:
    """``read`` the whole document from its root; one :class:`ScenarioError` listing every
    problem, when there was any."""
    reader = FieldReader(document.path)
    value = read(reader, document_root(document))
    if reader.errors or value is None:
        raise reader.failure()
    return value


# --------------------------------------------------------------------------- value checks


def string(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def text(value: Any) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def boolean(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def positive(value: Any) -> float | None:
    found = number(value)
    return found if found is not None and found > 0 else None


def non_negative(value: Any) -> float | None:
    found = number(value)
    return found if found is not None and found >= 0 else None


def integer_at_least(low: int) -> Callable[[Any], int | None]:
    def check(value: Any) -> int | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
        return value if ok else None

    return check


def choice(*options: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return value if value in options else None

    return check


def string_list(value: Any) -> list[str] | None:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None
