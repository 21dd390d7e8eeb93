"""Finding an HTTP filter in a rendered connection manager by name, not position: the
bootstrap puts the owned-header filter before the ext_proc filter."""

from __future__ import annotations

from typing import Any

from extproc.wire import EXT_PROC_FILTER


def ext_proc_of(hcm: dict[str, Any]) -> dict[str, Any]:
    """The ext_proc filter of ``hcm`` (a connection manager's typed_config or a snippet)."""
    found: dict[str, Any] = next(f for f in hcm["http_filters"] if f["name"] == EXT_PROC_FILTER)
    return found
