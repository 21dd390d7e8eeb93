"""The located YAML reader's parts that readers wording their own checks use: whole values,
merged pairs, data built in code (errors without a line) and a field path's line."""

from __future__ import annotations

from yaml.nodes import MappingNode

from extproc.yamlfile import LocatedReader, compose, line_of, represent

TEXT = """\
base: &base
  rate: 1
groups:
  - name: a
    <<: *base
  - name: b
    tokens: [1, 2]
"""


def test_construct_gives_whole_values_and_pairs_resolve_merges() -> None:
    root = compose(TEXT, "f.yaml")
    assert isinstance(root, MappingNode)
    reader = LocatedReader("f.yaml")
    assert reader.construct(root)["groups"][1] == {"name": "b", "tokens": [1, 2]}
    first = root.value[1][1].value[0]
    keys = [reader.construct(k) for k, _ in reader.pairs(first)]
    assert sorted(keys) == ["name", "rate"]
    assert reader.errors == []


def test_data_built_in_code_is_read_alike_and_its_errors_have_no_line() -> None:
    node = represent({"groups": [{"name": "a", "rate": 2.5, "on": True}], "none": None})
    reader = LocatedReader("built.yaml")
    assert reader.construct(node) == {
        "groups": [{"name": "a", "rate": 2.5, "on": True}],
        "none": None,
    }
    reader.error(node, "groups", "bad")
    reader.error(None, "", "no node: line 1 as before")
    assert reader.errors == ["built.yaml: groups: bad", "built.yaml:1: no node: line 1 as before"]


def test_line_of_a_field_path() -> None:
    root = compose(TEXT, "f.yaml")
    assert line_of(root, "groups[1].tokens") == 7
    assert line_of(root, "groups[0].missing") == 4  # the closest enclosing field
    assert line_of(root, "groups[9]") == 3
    assert line_of(None, "groups") is None
