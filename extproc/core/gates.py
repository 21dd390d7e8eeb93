"""Admission gates: may a request of this tier go to this backend now?

Backpressure, after TNG's LLM-Server: a request leaves the gateway's queue only while the
engine is not yet backed up, so the queueing (where fairness and priority are decided)
happens here rather than in vLLM's FCFS-ish waiting queue. Each tier has a ``Gate``; a
backend passes it when every bound the gate sets holds on the backend's last scrape plus
the grants the gateway made since (``Backend.effective_waiting``). ``passes`` states each
bound's meaning. Stale or missing metrics count as saturated; when no backend has usable
metrics, ``unusable_metrics`` says why, for the answer to the client.

The defaults (``DEFAULT_GATES``) step down by tier so that a lower tier always stops one step
before a higher one (batch enters only an empty queue, api while at most one waits,
interactive while at most two wait): lower tiers can never lock a higher tier out of a
backend, only fill its running batch, which vLLM's priority scheduling preempts.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.fleet.backend import Backend
from extproc.policy.model import Gate

LISTED = 3
"""Backends ``unusable_metrics`` names one by one; the rest are counted."""


def passes(
    gate: Gate,
    backend: Backend,
    now: float,
    stale_after_s: float,
    rank: int | None = None,
    final_kv: bool = False,
    priority: int | None = None,
) -> bool:
    """Whether ``backend`` may take one more request of the tier ``gate`` belongs to now.

    ``now`` is on the pool's clock (``BackendPool.clock``, monotonic by default), the clock
    that stamped ``backend.metrics.scraped_at``. With the tier's ``rank``, ``max_waiting``
    counts only the waiting requests it would wait behind (``Backend.waiting_ahead_of``):
    vLLM's priority queue lets it pass the less urgent ones, judged by the request's own
    vLLM ``priority`` where given.

    Each bound, precisely:

    - ``max_waiting = N`` admits while ``effective_waiting < N`` (strict), so TNG's "while the
      queue is below 3" is ``max_waiting: 3``. ``0`` means "only when the queue is empty"
      (``effective_waiting == 0``), the same as ``1``: a strict bound below zero would never admit,
      and that is what ``max_in_flight: 0`` or a missing tier is for.
    - ``max_kv_cache_usage``: admits while usage ``<=`` the bound (a fraction, 0..1): the scraped
      usage plus what the grants since the scrape will hold (``Backend.projected_kv_usage``). With
      ``final_kv`` (admission sets it for a tier that a more urgent active tier holds a reserve
      against) the usage is what the requests in flight will hold at their end
      (``Backend.final_kv_usage``): the headroom the bound leaves must still be there when chat
      arrives, after batch has generated its output.
    - ``max_itl_s``: admits while the mean inter-token latency of the last scrape interval is
      ``<=`` the bound; an unknown ITL (idle engine, first scrape) does not block, and neither does
      a backend whose ``/metrics`` has no ITL histogram: the bound is off for it (its first such
      scrape logs that), rather than the backend counting as saturated forever.
    - ``max_in_flight``: the gateway's own count of requests it sent to the backend and has not
      seen finish (all replicas' when they share state), ``<`` the bound (a per-backend cap for the
      tier).
    - ``None`` switches a bound off.

    A backend that is unhealthy (``/health`` fails or its scrapes fail), has never been scraped, or
    whose last good scrape is older than ``stale_after_s`` fails every gate: stale metrics count as
    saturated.
    """
    metrics = backend.metrics
    if not backend.healthy or metrics is None or now - metrics.scraped_at > stale_after_s:
        return False
    if gate.max_waiting is not None:
        waiting = (
            backend.effective_waiting()
            if rank is None
            else backend.waiting_ahead_of(rank, priority)
        )
        if waiting >= max(gate.max_waiting, 1):
            return False
    kv_bound = gate.max_kv_cache_usage
    if kv_bound is not None:
        usage = backend.final_kv_usage() if final_kv else backend.projected_kv_usage()
        if usage > kv_bound:
            return False
    if gate.max_itl_s is not None and backend.itl_s is not None and backend.itl_s > gate.max_itl_s:
        return False
    return gate.max_in_flight is None or backend.fleet_in_flight < gate.max_in_flight


def metrics_usable(backend: Backend, now: float, stale_after_s: float) -> bool:
    """Whether the gates can read ``backend``'s metrics now: its last scrape succeeded and
    is fresh (whatever its load, health or membership)."""
    metrics = backend.metrics
    return backend.scrape_ok and metrics is not None and now - metrics.scraped_at <= stale_after_s


def metrics_problem(backend: Backend, now: float, stale_after_s: float) -> str | None:
    """Why the gates cannot read ``backend``'s metrics, in words for a client; None when
    they can."""
    metrics = backend.metrics
    if not backend.scrape_ok:
        return f"scrape failed: {backend.scrape_error or 'metrics unreadable'}"
    if metrics is None:
        return "not scraped yet"
    age = now - metrics.scraped_at
    return f"last good scrape {age:.1f}s ago" if age > stale_after_s else None


def unusable_metrics(
    backends: Sequence[Backend], now: float, stale_after_s: float
) -> list[str] | None:
    """None when some backend's metrics are usable; otherwise why none are, as
    ``"ADDRESS (problem)"`` for the first ``LISTED`` backends and a count of the rest (or a
    single line for an empty fleet).

    A request can then never pass a gate, so waiting out its queue deadline tells its
    client nothing; this is what it is told instead. The scan stops at the first usable
    backend, so asking costs a healthy fleet one check.
    """
    for backend in backends:
        if metrics_usable(backend, now, stale_after_s):
            return None
    if not backends:
        return ["the fleet has no backend (none configured or discovered yet)"]
    problems = [
        f"{b.address} ({metrics_problem(b, now, stale_after_s)})" for b in backends[:LISTED]
    ]
    if len(backends) > LISTED:
        problems.append(f"{len(backends) - LISTED} more")
    return problems


def unusable_since(backends: Sequence[Backend], started_at: float) -> float:
    """Since when no backend can have had usable metrics, at the latest: its newest good
    scrape, or ``started_at`` when later (nothing scraped yet, or backends joined since)."""
    newest = max((b.metrics.scraped_at for b in backends if b.metrics is not None), default=None)
    return started_at if newest is None else max(started_at, newest)
