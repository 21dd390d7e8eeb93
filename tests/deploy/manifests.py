"""The Kubernetes examples the deploy tests read: their files, every object, one by name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Example:
    """One example directory: ``deployment.yaml``, the ``envoy.yaml`` rendered from it, a
    ``kustomization.yaml`` and ``manifests/*.yaml``."""

    directory: Path

    @property
    def deployment(self) -> Path:
        return self.directory / "deployment.yaml"

    @property
    def envoy_config(self) -> Path:
        return self.directory / "envoy.yaml"

    @property
    def kustomization(self) -> Path:
        return self.directory / "kustomization.yaml"

    @property
    def manifests(self) -> list[Path]:
        return sorted((self.directory / "manifests").glob("*.yaml"))

    def objects(self) -> list[dict[str, Any]]:
        """Every object of every manifest, in order."""
        found = []
        for path in self.manifests:
            found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        return found

    def find(self, kind: str, name: str) -> dict[str, Any]:
        """The one object of ``kind`` named ``name`` (fails when none or several)."""
        (found,) = [
            o for o in self.objects() if o["kind"] == kind and o["metadata"]["name"] == name
        ]
        return found


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    """The container ``name`` of a Deployment's pod template."""
    (found,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name
    ]
    return found
