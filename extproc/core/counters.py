"""What the gateway counts on the request path, as plain Python (no prometheus_client).

The request path only increments: a dict entry, or a bisect into fixed histogram buckets.
``extproc.transport.prometheus`` turns these into Prometheus families when Prometheus
scrapes, next to the gauges it reads from live state. Keeping the counting here, without a
client library's locks and label lookups, keeps the per-request cost to about a microsecond
per event and lets unit tests read exact numbers.

Label values that come from clients (users, model names) pass through a ``BoundedLabel``:
the first ``limit`` distinct values keep their own series, every later one is counted as
``"other"``, so a client sending thousands of made-up users cannot grow the exposition.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

OTHER = "other"
"""The label value that stands for every value past a ``BoundedLabel``'s limit."""

#: Seconds a request waits in a gateway queue: from instant to the longest batch deadlines.
QUEUE_WAIT_BUCKETS = (
    0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0,
)  # fmt: skip
#: Seconds to the first byte or to the end of a request, as the client saw them.
LATENCY_BUCKETS = (
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1800.0,
)  # fmt: skip
#: Seconds of the service's own work on one request (decode, decide, encode; no waiting).
SERVICE_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
)  # fmt: skip


class Histogram:
    """Counts per bucket upper bound (not cumulative; the exporter accumulates)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> Iterator[tuple[str, int]]:
        """``(le, count of observations <= le)`` pairs, ``+Inf`` last, as Prometheus wants."""
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            yield ("+Inf" if bound == float("inf") else repr(bound), running)


class LabelledHistograms:
    """One ``Histogram`` per label tuple, created on first use."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.by_labels: dict[tuple[str, ...], Histogram] = {}

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        histogram = self.by_labels.get(labels)
        if histogram is None:
            histogram = self.by_labels[labels] = Histogram(self.bounds)
        histogram.observe(value)


class BoundedLabel:
    """Keeps the first ``limit`` distinct values of a client-chosen label; the rest are OTHER."""

    __slots__ = ("limit", "seen")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self.seen:
            return value
        if len(self.seen) < self.limit:
            self.seen.add(value)
            return value
        return OTHER


@dataclass
class GatewayStats:
    """Every counter and histogram the request path feeds; read by ``extproc.transport.prometheus``.

    Tier names, reasons and statuses come from the policy and the code, so they are bounded
    already; ``model`` and ``flow`` labels pass through ``BoundedLabel``s.
    """

    flow_label_limit: int = 200
    model_label_limit: int = 50
    admitted: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(tier, model) -> requests released upstream."""
    shed: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(tier, reason) -> requests a queue turned away (full, early shed, deadline)."""
    rejected: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(status, reason) -> requests refused before any queue (bad key, bad JSON, bugs)."""
    flow_requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(tier, flow) -> requests admitted: the fairness unit's share of requests."""
    flow_tokens: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    """(tier, flow, input|output) -> tokens: the fairness unit's share of work."""
    policy_reloads: Counter[str] = field(default_factory=Counter)
    """ok | error -> policy file reloads."""
    queue_wait: LabelledHistograms = field(
        default_factory=lambda: LabelledHistograms(QUEUE_WAIT_BUCKETS)
    )
    time_to_first_byte: LabelledHistograms = field(
        default_factory=lambda: LabelledHistograms(LATENCY_BUCKETS)
    )
    request_duration: LabelledHistograms = field(
        default_factory=lambda: LabelledHistograms(LATENCY_BUCKETS)
    )
    service_time: Histogram = field(default_factory=lambda: Histogram(SERVICE_BUCKETS))

    def __post_init__(self) -> None:
        self._flow = BoundedLabel(self.flow_label_limit)
        self._model = BoundedLabel(self.model_label_limit)

    def admit(self, tier: str, model: str | None, flow: str, queued_s: float, tokens: int) -> None:
        """A request was released upstream after ``queued_s`` in its tier's queue."""
        self.admitted[(tier, self._model(model or "none"))] += 1
        self.queue_wait.observe((tier,), queued_s)
        flow_label = self._flow(flow)
        self.flow_requests[(tier, flow_label)] += 1
        self.flow_tokens[(tier, flow_label, "input")] += tokens

    def complete(
        self,
        tier: str,
        flow: str,
        duration_s: float,
        ttfb_s: float | None,
        output_tokens: int,
    ) -> None:
        """An admitted request finished (Envoy's access log); its times as the client saw them."""
        self.request_duration.observe((tier,), duration_s)
        if ttfb_s is not None:
            self.time_to_first_byte.observe((tier,), ttfb_s)
        if output_tokens:
            self.flow_tokens[(tier, self._flow(flow), "output")] += output_tokens

    def shed_request(self, tier: str, reason: str) -> None:
        self.shed[(tier, reason)] += 1

    def reject(self, status: int, reason: str | None) -> None:
        self.rejected[(str(status), reason or "other")] += 1

    def policy_reload(self, ok: bool) -> None:
        self.policy_reloads["ok" if ok else "error"] += 1
