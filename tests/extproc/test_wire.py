"""extproc.wire is the one definition of the names the service and the Envoy config share."""

from __future__ import annotations

import ast
from pathlib import Path

from extproc import wire
from extproc.transport import codec


def test_wire_imports_nothing_the_request_path_would_pay_for() -> None:
    tree = ast.parse(Path(wire.__file__).read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert [getattr(node, "module", None) for node in imports] == ["__future__"]


def test_the_codec_writes_the_names_the_config_reads() -> None:
    assert codec.ENDPOINT_HEADER == wire.DESTINATION_HEADER
    assert codec.LB_NAMESPACE == wire.LB_NAMESPACE
    assert codec.FAIRLANE_NAMESPACE == wire.FAIRLANE_NAMESPACE
