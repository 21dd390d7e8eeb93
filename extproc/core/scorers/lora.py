"""LoRA affinity: an adapter runs where it is in the engine's batch, or a slot is free.

vLLM keeps at most ``max_loras`` distinct adapters in a batch; a request for another one
waits for a slot and pays the swap. Read from ``vllm:lora_requests_info``; vLLM 0.32 lists
the same adapters as running and waiting (those with requests past their first token), so
in practice an adapter runs there, a slot is free, or it would be swapped in. The shares
follow llm-d's LoRA scorer (affinities 1.0, 0.8, 0.6, 0). An engine that would first load
a runtime adapter (``extproc.fleet.adapters``) costs as a waiting adapter with a slot free,
and as a swap without one: an engine that holds it already wins a tie.
"""

from __future__ import annotations

from extproc.core.scorers.context import Context
from extproc.fleet.backend import Backend

WEIGHT = "lora_weight"

RUNNING, SLOT_FREE, WAITING, SWAP = 0.0, 0.2, 0.4, 1.0


def score(backend: Backend, context: Context) -> float:
    """0 when the request is for no adapter here, or the engine's slots are not reported."""
    model, served, metrics = context.model, backend.models, backend.metrics
    if model is None or served is None or model in served.bases or metrics is None:
        return 0.0
    slots = metrics.lora
    if slots is None:
        return 0.0
    if model not in served.adapters:  # a runtime adapter, loaded here before it runs
        return WAITING if len(slots.running) < slots.max_loras else SWAP
    if model in slots.running:
        return RUNNING
    if len(slots.running) < slots.max_loras:
        return SLOT_FREE
    return WAITING if model in slots.waiting else SWAP
