"""KV-cache use: a fuller cache preempts sooner and holds less of anyone's prefix."""

from __future__ import annotations

from extproc.core.scorers.context import Context
from extproc.fleet.backend import Backend

WEIGHT = "kv_cache_weight"


def score(backend: Backend, context: Context) -> float:
    """``vllm:kv_cache_usage_perc`` as last scraped; 1.0 (full) when never scraped."""
    metrics = backend.metrics
    return metrics.kv_cache_usage if metrics is not None else 1.0
