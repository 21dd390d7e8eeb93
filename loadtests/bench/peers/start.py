"""Starting a peer arm's gateway in front of engines that are already up.

The engines (simulated, started by ``loadtests.bench.arms`` with the scheduling policy and
KV events the kind asks for; or given with ``--backend``) are the same as every other
arm's; what differs is the gateway in front of them, started in the caller's
:class:`ProcessGroup` so it is stopped with the rest of the arm, also on failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from extproc.fleet.backend import BackendSpec
from extproc.ops.processes import ProcessGroup
from loadtests.bench.peers.install import LITELLM
from loadtests.bench.peers.kinds import PEER_ARMS
from loadtests.bench.peers.litellm import MASTER_KEY, start_litellm
from loadtests.bench.peers.served import block_size
from loadtests.bench.peers.vllm_router import KvSources, start_vllm_router


@dataclass(frozen=True)
class PeerGateway:
    url: str
    api_key: str | None = None
    """The key every request sends (LiteLLM's master key); None: each client's own."""


def start_peer(
    kind: str, backends: Sequence[BackendSpec], group: ProcessGroup, model: str
) -> PeerGateway:
    """Start ``kind``'s gateway (:data:`PEER_ARMS`) in front of ``backends``; ``model`` is
    the name every engine serves (``kv_aware``'s model identity). A configuration the
    gateway cannot run with (engines without KV events for ``kv_aware``) is a RuntimeError,
    which fails the arm and lets the others run."""
    arm = PEER_ARMS[kind]
    if arm.peer is LITELLM:
        return PeerGateway(start_litellm(group, backends), MASTER_KEY)
    assert arm.router_policy is not None
    kv = KvSources(model, block_size(backends[0].url)) if arm.kv_events else None
    try:
        return PeerGateway(start_vllm_router(group, backends, arm.router_policy, kv))
    except ValueError as exc:
        raise RuntimeError(f"{kind}: {exc}") from None
