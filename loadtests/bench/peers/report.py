"""What ``report.md`` says about the peer arms that ran: which gateway, configured how.

The figures of a peer arm are in the report's tables like any other arm's (its gateway's
CPU in the CPU table under the process's name); this is the line that says what the arm
was, so a reader does not have to know the kinds by heart.
"""

from __future__ import annotations

from collections.abc import Mapping

from loadtests.bench.peers.kinds import PEER_ARMS
from loadtests.bench.results import ArmResult


def peer_lines(arms: Mapping[str, ArmResult], external: bool = False) -> list[str]:
    """One bullet naming every peer arm of the run (none when there is none); with
    ``external`` engines their scheduling policy is their own, so it is not named."""
    described = []
    for name, arm in arms.items():
        peer = PEER_ARMS.get(arm.kind)
        if peer is None:
            continue
        engines = "" if external else f", vLLM {peer.scheduling}"
        described.append(f"{name}: {peer.summary} (`{peer.peer.requirement}`{engines})")
    if not described:
        return []
    return ["- peer gateways (`loadtests/bench/peers`): " + "; ".join(described) + "."]
