"""Reading a YAML file whose every mistake is reported with its line.

Policies, deployments and benchmark scenarios are edited by hand, so a mistake must come
back as ``file:line: field.path: message`` for each problem in the file, not the first only.
``LocatedReader`` walks PyYAML's node tree (which keeps each node's position), turns nodes
into values and collects located errors; the policy, deployment and scenario parsers build
on it. Data built in code (tests) is read the same way through :func:`represent`: its nodes
have no position, so its errors name the file without a line.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.representer import SafeRepresenter

T = TypeVar("T")

_LOADER = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader
"""libyaml's parser where PyYAML was built with it (its wheels are): the same node tree,
lines included, 2.8 x faster than PyYAML's own; a 100,000-tenant policy (6 MB) composes
in 12.6 s instead of 35.4 s."""


class YamlSyntaxError(ValueError):
    """A file that is not YAML at all; ``message`` is its one ``file:line:`` line."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def compose(text: str, filename: str) -> Node | None:
    """The node tree of ``text`` (None for an empty file), keeping every node's line."""
    try:
        return yaml.compose(text, Loader=_LOADER)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise YamlSyntaxError(f"{filename}:{line}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(f"{filename}:1: YAML error: {exc}") from None


class LocatedReader:
    """Walks the YAML node tree, turning nodes into values and collecting located errors.

    Each accessor returns the value, or ``None`` after recording an error, so one pass over
    the file finds every problem instead of stopping at the first.
    """

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.errors: list[str] = []
        self.warnings: list[str] = []
        """Located like errors, for what works but should change; they fail nothing."""
        self._constructor = SafeConstructor()
        self.warned: Counter[str] = Counter()
        """Warnings of each kind given to ``warn_at_most``, listed or not."""

    def error(self, node: Node | None, path: str, message: str) -> None:
        """Record ``file:line: path: message`` (``file: path: message`` for a node built in
        code, which has no line)."""
        self.errors.append(self.located(node, path, message))

    def warn(self, node: Node | None, path: str, message: str) -> None:
        """Record a warning, located like an error."""
        self.warnings.append(self.located(node, path, message))

    def warn_at_most(
        self, kind: str, limit: int, node: Node | None, path: str, message: str
    ) -> None:
        """Record a warning of ``kind`` for the first ``limit`` of that kind; count the rest
        (``warned``) for the caller to sum up in one line. A file with 100,000 of the same
        warning (plain keys, one per tenant) would otherwise keep 100,000 located strings,
        ~0.5 KiB each, for as long as its policy is in force."""
        self.warned[kind] += 1
        if self.warned[kind] <= limit:
            self.warn(node, path, message)

    def located(self, node: Node | None, path: str, message: str) -> str:
        where = f"{path}: " if path else ""
        if node is not None and node.start_mark is None:
            return f"{self.filename}: {where}{message}"
        line = node.start_mark.line + 1 if node is not None else 1
        return f"{self.filename}:{line}: {where}{message}"

    def scalar(self, node: Node) -> Any:
        return self.construct(node)

    def construct(self, node: Node) -> Any:
        """The plain value of any node (a mapping, a list or a scalar) as ``yaml.safe_load``
        gives it, for readers that check whole values rather than walk them."""
        return self._constructor.construct_object(node, deep=True)

    def pairs(self, node: MappingNode) -> list[tuple[Node, Node]]:
        """A mapping's (key node, value node) pairs, ``<<: *anchor`` merges resolved and no
        key checked, for readers that word their own field checks."""
        self._constructor.flatten_mapping(node)
        return list(node.value)

    def mapping(self, node: Node, path: str, keys: tuple[str, ...] | None) -> dict[str, Node]:
        """A mapping's items by key; ``keys`` lists the allowed ones (``None``: any)."""
        if not isinstance(node, MappingNode):
            self.error(node, path, f"must be a mapping, not {kind_of(node)}")
            return {}
        own = {id(key_node) for key_node, _ in node.value}
        self._constructor.flatten_mapping(node)  # resolve `<<: *anchor` merges
        items: dict[str, Node] = {}
        merged: set[str] = set()  # keys from a merge, which the mapping's own keys override
        for key_node, value_node in node.value:
            key = self.scalar(key_node) if isinstance(key_node, ScalarNode) else None
            if not isinstance(key, str):
                self.error(key_node, path, "keys must be strings")
                continue
            sub = join_path(path, key)
            if keys is not None and key not in keys:
                self.error(key_node, sub, f"unknown field (expected one of: {', '.join(keys)})")
            elif key in items and key not in merged:
                self.error(key_node, sub, "duplicate field")
            else:
                items[key] = value_node
                merged.discard(key)
                if id(key_node) not in own:
                    merged.add(key)
        return items

    def sequence(self, node: Node, path: str) -> list[Node]:
        if not isinstance(node, SequenceNode):
            self.error(node, path, f"must be a list, not {kind_of(node)}")
            return []
        return list(node.value)

    def typed(self, node: Node, path: str, kind: type[T] | tuple[type, ...], what: str) -> T | None:
        value = self.scalar(node) if isinstance(node, ScalarNode) else None
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _types(kind)):
            self.error(node, path, f"must be {what}, not {kind_of(node)}")
            return None
        return value  # type: ignore[return-value]

    def string(self, node: Node, path: str, pattern: re.Pattern[str] | None = None) -> str | None:
        value = self.typed(node, path, str, "a string")
        if value is None:
            return None
        if not value:
            self.error(node, path, "must not be empty")
            return None
        if pattern is not None and not pattern.fullmatch(value):
            self.error(node, path, f"{value!r} is not a valid name (pattern {pattern.pattern})")
            return None
        return value

    def integer(self, node: Node, path: str, minimum: int | None = None) -> int | None:
        value = self.typed(node, path, int, "an integer")
        if value is not None and minimum is not None and value < minimum:
            self.error(node, path, f"must be >= {minimum}, not {value}")
            return None
        return value

    def positive(self, node: Node, path: str) -> float | None:
        value = self.typed(node, path, (int, float), "a number")
        if value is not None and not value > 0:
            self.error(node, path, f"must be > 0, not {value}")
            return None
        return None if value is None else float(value)

    def number(
        self, node: Node, path: str, minimum: float = 0.0, maximum: float | None = None
    ) -> float | None:
        """A number in ``[minimum, maximum]``."""
        value = self.typed(node, path, (int, float), "a number")
        if value is None:
            return None
        if not minimum <= value or (maximum is not None and value > maximum):
            bound = f"in [{minimum:g}, {maximum:g}]" if maximum is not None else f">= {minimum:g}"
            self.error(node, path, f"must be {bound}, not {value}")
            return None
        return float(value)

    def strings(self, node: Node, path: str, pattern: re.Pattern[str] | None = None) -> list[str]:
        """A list of distinct strings, each element checked (and located) on its own."""
        return [value for _, _, value in self.located_strings(node, path, pattern)]

    def located_strings(
        self,
        node: Node,
        path: str,
        pattern: re.Pattern[str] | None = None,
        shown: Callable[[str], str] = repr,
    ) -> list[tuple[str, Node, str]]:
        """Like ``strings`` but each valid value comes with its path and node, for later
        cross-checks that must point at the exact line. ``shown`` renders a value in a
        message (secrets such as API keys must not be echoed whole)."""
        found: list[tuple[str, Node, str]] = []
        for i, item in enumerate(self.sequence(node, path)):
            item_path = f"{path}[{i}]"
            value = self.string(item, item_path, pattern)
            if value is None:
                continue
            if any(value == seen for _, _, seen in found):
                self.error(item, item_path, f"{shown(value)} is listed twice")
            else:
                found.append((item_path, item, value))
        return found

    def regex(self, node: Node, path: str) -> re.Pattern[str] | None:
        text = self.string(node, path)
        if text is None:
            return None
        try:
            return re.compile(text)
        except re.error as exc:
            self.error(node, path, f"invalid regular expression: {exc}")
            return None

    def value(self, node: Node, path: str, kind: type, check: Callable[[Any], str | None]) -> Any:
        """A scalar of type ``kind`` that passes ``check`` (which returns a complaint)."""
        value = self.scalar(node) if isinstance(node, ScalarNode) else None
        if isinstance(value, bool) or not isinstance(value, kind):
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            else:
                wanted = {int: "an integer", float: "a number", str: "a string"}[kind]
                self.error(node, path, f"must be {wanted}, not {kind_of(node)}")
                return None
        complaint = check(value)
        if complaint:
            self.error(node, path, complaint)
            return None
        return value


def represent(data: Any) -> Node:
    """The node tree of ``data`` built in code (plain dicts, lists and scalars), for the same
    reader as a file; its nodes carry no position (errors name no line)."""
    return SafeRepresenter(sort_keys=False).represent_data(data)


def line_of(node: Node | None, path: str) -> int | None:
    """The line of field ``path`` (``groups[1].rate``) in a node tree: the field's own key,
    else the closest enclosing one that exists (a missing field's mapping). For errors found
    elsewhere than in the tree's own reader (a generated copy of the file, say)."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("[") and isinstance(node, SequenceNode):
            index = int(part[1:-1])
            if index >= len(node.value):
                break
            node = node.value[index]
            line = node.start_mark.line + 1
        elif isinstance(node, MappingNode):
            found = next(
                ((k, v) for k, v in node.value if isinstance(k, ScalarNode) and k.value == part),
                None,
            )
            if found is None:
                break
            line, node = found[0].start_mark.line + 1, found[1]
        else:
            break
    return line


def _types(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def join_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def kind_of(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    tag = node.tag.rsplit(":", 1)[-1]
    return {
        "str": "a string",
        "int": "an integer",
        "float": "a number",
        "bool": "a boolean",
        "null": "null",
    }.get(tag, tag)
