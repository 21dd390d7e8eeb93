"""The peer arm kinds: which gateway, configured how, and what its clients send.

Each kind is a gateway a platform team could run instead of fairlane, set up as its own
documentation says, in front of the same simulated (or ``--backend``) engines: vllm-router
0.1.17 with its round-robin, cache-aware or KV-aware policy, and the LiteLLM proxy 1.108.7
with its clients' priority as LiteLLM's ``priority`` or as vLLM's in ``extra_body``
(``PeerArm`` has each). The engines run vLLM's ``priority`` scheduling where the arm sends
priorities, ``fcfs`` otherwise (with ``--backend`` their policy is their own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from loadtests.bench.peers.install import LITELLM, VLLM_ROUTER, Peer

PriorityField = Literal["none", "litellm", "extra_body"]
"""Where a client of the arm puts its tier's priority: nowhere, LiteLLM's ``priority``
(clamped to LiteLLM's 0-255), or ``extra_body.priority`` (vLLM's, passed on)."""


@dataclass(frozen=True)
class PeerArm:
    """One peer arm kind: the gateway, its configuration and what its clients send.

    The kinds:

    * ``vllm-router``: vllm-router 0.1.17, ``--policy round_robin``.
    * ``vllm-router-cache``: ``--policy cache_aware`` (a radix tree of the text each worker was
      sent, balanced by load past its thresholds).
    * ``vllm-router-kv``: ``--policy kv_aware``, following each engine's KV events over ZMQ
      (``--kv-event-source``, ``--kv-event-replay-source``) and asking the engine for a prompt's
      token ids (``/tokenize``; the simulator serves it as vLLM does) to match them.
    * ``litellm``: the LiteLLM proxy 1.108.7, one deployment per model an engine serves; each
      client sends its tier's priority as LiteLLM's ``priority`` (0 most urgent). LiteLLM's
      scheduler holds a request only while no deployment is healthy, and engines that queue
      internally always are, so it holds nothing; a ``priority`` of 0 is passed on to vLLM,
      higher ones are not.
    * ``litellm-priority``: the same proxy, each client sending its tier's vLLM priority in
      ``extra_body`` (which LiteLLM passes on to the engine): vLLM's own priority queue behind
      LiteLLM.
    """

    kind: str
    peer: Peer
    router_policy: str | None
    """vllm-router's ``--policy`` (None for LiteLLM)."""
    priority: PriorityField
    scheduling: Literal["fcfs", "priority"]
    """The simulated engines' ``--scheduling-policy``."""
    kv_events: bool = False
    """The engines publish their KV events and the gateway follows them."""
    summary: str = ""


PEER_ARMS: dict[str, PeerArm] = {
    a.kind: a
    for a in (
        PeerArm(
            "vllm-router",
            VLLM_ROUTER,
            "round_robin",
            "none",
            "fcfs",
            summary="vllm-router, round_robin",
        ),
        PeerArm(
            "vllm-router-cache",
            VLLM_ROUTER,
            "cache_aware",
            "none",
            "fcfs",
            summary="vllm-router, cache_aware (approximate: what each worker was sent)",
        ),
        PeerArm(
            "vllm-router-kv",
            VLLM_ROUTER,
            "kv_aware",
            "none",
            "fcfs",
            kv_events=True,
            summary="vllm-router, kv_aware (the engines' KV events; prompt ids from /tokenize)",
        ),
        PeerArm(
            "litellm",
            LITELLM,
            None,
            "litellm",
            "priority",
            summary="LiteLLM proxy, each tier's priority as LiteLLM's `priority`",
        ),
        PeerArm(
            "litellm-priority",
            LITELLM,
            None,
            "extra_body",
            "priority",
            summary="LiteLLM proxy, each tier's vLLM priority in `extra_body`",
        ),
    )
}
