"""What a scorer knows of the request beyond the backend it scores."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Context:
    slot_limit: int
    """The policy's per-backend cap: a backend's seats count up to it."""
    local_region: str
    """The fleet's first region: the others cost ``region_weight``."""
    model: str | None = None
    """The model the request is for (its LoRA adapter, when it names one)."""
