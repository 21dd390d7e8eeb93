"""Reading Kubernetes manifests in the deploy tests: every object, one by kind and name."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml


def load_objects(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Every object of every YAML document in ``paths``, in order."""
    found = []
    for path in paths:
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def find_object(paths: Sequence[Path], kind: str, name: str) -> dict[str, Any]:
    """The one object of ``kind`` named ``name`` (fails when none or several)."""
    (found,) = [
        o for o in load_objects(paths) if o["kind"] == kind and o["metadata"]["name"] == name
    ]
    return found


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    """The container ``name`` of a Deployment's pod template."""
    (found,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name
    ]
    return found
