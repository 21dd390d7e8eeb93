"""What a client of an arm adds to the workload's requests: a priority, another key.

The workload (:mod:`loadtests.bench.workload`) is the same in every arm; where no gateway
sets a priority, the clients of some arms send their tier's as their gateway expects it,
from the scenario's policy (each tier's base vLLM priority):

* ``vllm-priority``: vLLM's ``priority`` in the body (no gateway, engines on ``priority``);
* ``litellm``: LiteLLM's ``priority`` (0-255, 0 first), the master key in place of the
  tenant's (:mod:`loadtests.bench.peers.litellm`);
* ``litellm-priority``: vLLM's priority in ``extra_body``, which LiteLLM passes on, and the
  master key;
* every other arm: nothing (fairlane sets the priority itself; the routers send none).

Requests of ``direct`` groups, which bypass the gateway, keep their own key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from loadtests.bench.peers.install import LITELLM
from loadtests.bench.peers.kinds import PEER_ARMS
from loadtests.bench.peers.litellm import MASTER_KEY, litellm_priority
from loadtests.bench.workload import tier_priorities


@dataclass(frozen=True)
class RequestStyle:
    priorities: Mapping[str, int] = field(default_factory=dict)
    """Tier (name or alias) -> the priority value its requests carry."""
    where: Literal["priority", "extra_body"] = "priority"
    api_key: str | None = None
    """Sent in place of each group's key through the gateway (None: the group's own)."""

    def extras(self, tier: str) -> dict[str, object]:
        """What a request of ``tier`` adds to its body."""
        value = self.priorities.get(tier)
        if value is None:
            return {}
        if self.where == "extra_body":
            return {"extra_body": {"priority": value}}
        return {"priority": value}

    def key(self, own: str) -> str:
        return own if self.api_key is None else self.api_key


def request_style(kind: str | None, policy: Path) -> RequestStyle:
    """The style of an arm of ``kind`` whose scenario's policy is ``policy``."""
    if kind == "vllm-priority":
        return RequestStyle(tier_priorities(policy))
    peer = PEER_ARMS.get(kind or "")
    if peer is None:
        return RequestStyle()
    key = MASTER_KEY if peer.peer is LITELLM else None
    if peer.priority == "litellm":
        mapped = {t: litellm_priority(p) for t, p in tier_priorities(policy).items()}
        return RequestStyle(mapped, "priority", key)
    if peer.priority == "extra_body":
        return RequestStyle(tier_priorities(policy), "extra_body", key)
    return RequestStyle(api_key=key)
