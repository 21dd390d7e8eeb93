"""Where the peer gateways are installed, and why one is missing.

``scripts/setup-peers`` puts each peer into a virtual environment of its own under
``${FAIRLANE_CACHE:-~/.cache/fairlane}/peers/`` (pinned versions, a stamp file once the
install worked, the reason in ``PEER.error`` when it did not). The peers are what the bench
measures, never a dependency of fairlane: an arm that needs a missing one fails with
:class:`PeerMissing`, which says why and which command installs it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SETUP = "scripts/setup-peers"
STAMP = ".fairlane-peer-installed"


@dataclass(frozen=True)
class Peer:
    """One peer gateway: its venv's name, its command and the pinned requirement."""

    name: str
    command: str
    requirement: str

    def venv(self, cache: Path | None = None) -> Path:
        return peers_dir(cache) / self.name

    def binary(self, cache: Path | None = None) -> Path:
        return self.venv(cache) / "bin" / self.command


VLLM_ROUTER = Peer("vllm-router", "vllm-router", "vllm-router==0.1.17")
LITELLM = Peer("litellm", "litellm", "litellm[proxy]==1.108.7")
PEERS = {p.name: p for p in (VLLM_ROUTER, LITELLM)}


def peers_dir(cache: Path | None = None) -> Path:
    """``$FAIRLANE_CACHE/peers`` (``~/.cache/fairlane/peers`` by default)."""
    if cache is None:
        env = os.environ.get("FAIRLANE_CACHE")
        cache = Path(env) if env else Path.home() / ".cache" / "fairlane"
    return cache / "peers"


class PeerMissing(RuntimeError):
    """A peer gateway is not installed; the message says why and how to install it."""


def missing_reason(peer: Peer, cache: Path | None = None) -> str | None:
    """Why ``peer`` cannot be started (None: its venv is complete)."""
    install = (
        f"install it with `{SETUP}` (what scripts/test runs) or by hand: "
        f"`python3 -m venv {peer.venv(cache)} && {peer.venv(cache)}/bin/pip install "
        f"'{peer.requirement}'`"
    )
    error = peers_dir(cache) / f"{peer.name}.error"
    if error.is_file():
        return f"{peer.name} is not installed ({SETUP} failed); {install}.\n{error.read_text()}"
    stamp = peer.venv(cache) / STAMP
    if not peer.binary(cache).is_file() or not stamp.is_file():
        return f"{peer.name} is not installed in {peer.venv(cache)}; {install}."
    if stamp.read_text().strip() != peer.requirement:
        return (
            f"{peer.venv(cache)} holds {stamp.read_text().strip()!r}, not "
            f"{peer.requirement!r}; {install}."
        )
    return None


def require(peer: Peer, cache: Path | None = None) -> Path:
    """The peer's command, or :class:`PeerMissing`."""
    reason = missing_reason(peer, cache)
    if reason is not None:
        raise PeerMissing(reason)
    return peer.binary(cache)
