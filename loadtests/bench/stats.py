"""Statistics over one arm's request records: its figures per tier, tenant and group.

All latencies are in **simulated seconds** (the client records wall seconds x speedup), so
figures compare with a real GPU fleet's, not with the wall clock of this run. Latency
percentiles count the successful requests that *started* inside the measured window, goodput
and service shares those that *finished* inside it, and waits every request, so a starved
request never drops out of the maximum (``arm_summary`` has each rule). Pure functions on
records.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from loadtests.bench.client import RequestRecord
from loadtests.bench.results import ArmSummary, Figures
from loadtests.bench.scenario import Scenario

OUTPUT_WEIGHT = 2  # service = input tokens + 2 x output tokens (the VTC cost of the design)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index (Σx)² / (n·Σx²): 1 when all equal, 1/n when one gets all."""
    if not values:
        return None
    square_sum = sum(v * v for v in values)
    if square_sum == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * square_sum)


def service_tokens(record: RequestRecord) -> int:
    return record.prompt_tokens + OUTPUT_WEIGHT * record.completion_tokens


def wait_s(record: RequestRecord) -> float | None:
    """Time to first token, or how long a request that never got one had waited."""
    if record.ok:
        return record.ttft_s
    if record.end_s is not None:
        return record.end_s - record.start_s
    return None


@dataclass(frozen=True)
class Window:
    start_s: float
    end_s: float

    @property
    def length_s(self) -> float:
        return max(self.end_s - self.start_s, 1e-9)

    def started(self, r: RequestRecord) -> bool:
        return self.start_s <= r.start_s < self.end_s

    def finished(self, r: RequestRecord) -> bool:
        return r.end_s is not None and self.start_s <= r.end_s <= self.end_s


def _pcts(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    return {f"{prefix}_p{q}": percentile(values, q) for q in (50, 90, 95, 99)}


def selection_stats(records: Sequence[RequestRecord], window: Window, speedup: float) -> Figures:
    """Counts, latency percentiles, goodput, service and waits of one set of requests."""
    measured_ok = [r for r in records if r.ok and window.started(r)]
    done = [r for r in records if r.ok and window.finished(r)]
    waits = [w for r in records if (w := wait_s(r)) is not None]
    queue = [r.queue_ms * speedup / 1000.0 for r in records if r.queue_ms is not None]
    errors = Counter(str(r.status) for r in records if not r.ok and not r.unfinished)
    limited = [r for r in records if r.rate_limited]
    return Figures(
        sent=len(records),
        ok=sum(r.ok for r in records),
        errors=dict(sorted(errors.items())),
        unfinished=sum(r.unfinished for r in records),
        measured=len(measured_ok),
        **_pcts([r.ttft_s for r in measured_ok if r.ttft_s is not None], "ttft"),
        **_pcts([r.e2e_s for r in measured_ok if r.e2e_s is not None], "e2e"),
        goodput=sum(r.completion_tokens for r in done) / window.length_s,
        throughput=len(done) / window.length_s,
        service_tokens=sum(service_tokens(r) for r in done),
        plain_tokens=sum(r.prompt_tokens + r.completion_tokens for r in done),
        wait_max=max(waits) if waits else None,
        wait_p99=percentile(waits, 99),
        queue_wait_max=max(queue) if queue else None,
        queue_wait_p99=percentile(queue, 99),
        tokens_per_wall_min=sum(r.prompt_tokens + r.completion_tokens for r in done)
        / (window.length_s / speedup / 60.0),
        rate_limited=len(limited),
        rate_limit_headers_ok=(
            sum(bool(r.rate_limit_headers) for r in limited) / len(limited) if limited else None
        ),
        error_share=sum(errors.values()) / len(records) if records else 0.0,
    )


def _by(
    records: Iterable[RequestRecord], key: Callable[[RequestRecord], str]
) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    return groups


def _with_shares(tenants: dict[str, Figures], total: Figures) -> dict[str, Figures]:
    """Each tenant's share of the service delivered in the window (and in plain tokens)."""
    total_service = total.service_tokens or 0
    total_plain = total.plain_tokens or 0
    return {
        name: dataclasses.replace(
            figures,
            share=figures.service_tokens / total_service if total_service else 0.0,
            plain_share=figures.plain_tokens / total_plain if total_plain else 0.0,
        )
        for name, figures in tenants.items()
    }


def arm_summary(scenario: Scenario, records: Sequence[RequestRecord]) -> ArmSummary:
    """Per tier, per tenant and per group statistics of one arm, plus token shares.

    Which requests count:

    * latency percentiles (TTFT, end-to-end): successful requests that *started* inside the
      measured window ``[warmup_s, duration_s)``;
    * goodput and service (token) shares: successful requests that *finished* inside it, per
      simulated second of the window;
    * waits: every request. A request's wait is its TTFT, or, if it never got a first token
      (shed, failed, still running at the end), how long it had been waiting: a starved request
      is the one that matters for starvation and must not drop out of the maximum;
    * the gateway queue wait is ``x-fairlane-queue-ms`` x speedup (FIFO has no gateway queue);
    * throughput: successful requests that *finished* inside the window, per simulated second;
    * the prefix-cache hit rate is the fleet's, from the backends' counters scraped at the
      window's start and end (``cachestats``), set on the summary by the runner.
    """
    window = Window(scenario.warmup_s, scenario.duration_s)
    speedup = scenario.speedup
    by_tier = _by(records, lambda r: r.tier)
    by_tenant = _by(records, lambda r: r.tenant)
    by_group = _by(records, lambda r: r.group)
    total = selection_stats(records, window, speedup)
    tenants = {
        t: selection_stats(by_tenant[t], window, speedup)
        for t in scenario.tenants
        if t in by_tenant
    }
    return ArmSummary(
        total=total,
        by_tier={
            t: selection_stats(by_tier[t], window, speedup) for t in scenario.tiers if t in by_tier
        },
        by_tenant=_with_shares(tenants, total),
        by_group={
            g.name: selection_stats(by_group[g.name], window, speedup)
            for g in scenario.groups
            if g.name in by_group
        },
    )
