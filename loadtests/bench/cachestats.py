"""Prefix-cache hit rate of a fleet over the measured window, from the backends' /metrics.

vLLM (and ``fairlane sim``) count prefix-cache lookups in **tokens**: a request's prompt
tokens are added to ``vllm:prefix_cache_queries_total`` when it is admitted, the tokens
found cached to ``vllm:prefix_cache_hits_total``. The fleet's hit rate over a window is
Σ Δhits / Σ Δqueries over the backends, so a backend that serves more prompt tokens weighs
more (a per-backend mean would let an idle backend's lucky hit count as much as a busy one's
misses). The counters come from two scrapes, at the start and the end of the measured window,
so warm-up (where every system prompt is a miss the first time) is left out. Each backend's
finished requests and preemptions over the same window show where the requests went. Pure
functions on text and numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
FINISHED = "vllm:request_success_total"  # every finished_reason (abort too): requests served
PREEMPTIONS = "vllm:num_preemptions_total"


@dataclass(frozen=True)
class PrefixCounters:
    """One backend's cumulative prefix-cache counters (tokens), finished requests and
    preemptions."""

    queries: float
    hits: float
    finished: float = 0.0
    preemptions: float = 0.0


def parse_prefix_counters(text: str) -> PrefixCounters:
    """The two counters in a Prometheus text exposition, summed over their label sets
    (one engine per simulator, but a real vLLM with several engines has one series each).

    Raises ValueError when the queries counter is missing: a backend that does not export
    it cannot be measured, and reading it as 0 would silently skew the fleet's rate."""
    queries: float | None = None
    hits = finished = preemptions = 0.0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if not rest:  # a series without labels: "name value"
            name, _, rest = line.partition(" ")
        else:
            rest = rest.rsplit("}", 1)[-1]
        fields = rest.split()
        if not fields:
            continue
        value = float(fields[0])
        if name == QUERIES:
            queries = (queries or 0.0) + value
        elif name == HITS:
            hits += value
        elif name == FINISHED:
            finished += value
        elif name == PREEMPTIONS:
            preemptions += value
    if queries is None:
        raise ValueError(f"no {QUERIES} in the metrics")
    return PrefixCounters(queries, hits, finished, preemptions)


@dataclass(frozen=True)
class PrefixWindow:
    """The fleet's prefix-cache traffic over the window."""

    queries: float
    hits: float
    backends: int
    """Backends both of whose scrapes succeeded (the others are left out, and said so)."""
    missing: int
    per_backend: tuple[dict[str, float | None], ...] = ()
    """Per backend (configured order; None where it could not be measured): finished
    requests, preemptions and hit rate over the window."""

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "prefix_queries": self.queries,
            "prefix_hits": self.hits,
            "prefix_hit_rate": self.hit_rate,
            "prefix_backends": self.backends,
            "prefix_backends_missing": self.missing,
            "per_backend": list(self.per_backend),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PrefixWindow:
        return cls(
            queries=data["prefix_queries"],
            hits=data["prefix_hits"],
            backends=data["prefix_backends"],
            missing=data["prefix_backends_missing"],
            per_backend=tuple(dict(b) for b in data["per_backend"]),
        )


def window_hit_rate(
    start: Sequence[PrefixCounters | None], end: Sequence[PrefixCounters | None]
) -> PrefixWindow:
    """Σ Δhits / Σ Δqueries over backends with both snapshots (index-aligned lists).

    A counter that went down means the backend restarted in between; its delta is unknown,
    so that backend is left out like a failed scrape."""
    queries = hits = 0.0
    used = missing = 0
    unknown: dict[str, float | None] = {"finished": None, "preemptions": None, "hit_rate": None}
    per_backend: list[dict[str, float | None]] = []
    for before, after in zip(start, end, strict=True):
        if before is None or after is None:
            missing += 1
            per_backend.append(dict(unknown))
            continue
        deltas = [
            after.queries - before.queries,
            after.hits - before.hits,
            after.finished - before.finished,
            after.preemptions - before.preemptions,
        ]
        if any(d < 0 or not math.isfinite(d) for d in deltas):
            missing += 1
            per_backend.append(dict(unknown))
            continue
        dq, dh, finished, preemptions = deltas
        queries += dq
        hits += dh
        used += 1
        per_backend.append(
            {
                "finished": finished,
                "preemptions": preemptions,
                "hit_rate": dh / dq if dq > 0 else None,
            }
        )
    return PrefixWindow(queries, hits, used, missing, tuple(per_backend))


__all__ = [
    "HITS",
    "QUERIES",
    "PrefixCounters",
    "PrefixWindow",
    "parse_prefix_counters",
    "window_hit_rate",
]
