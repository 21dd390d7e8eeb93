"""The gateway's own Prometheus metrics, read from live state at scrape time.

Queue depths, in-flight counts and backend health are read from the admission state when
Prometheus scrapes, so the request path pays nothing for them. Counters of outcomes are
plain ``Counter`` increments on the request path. The endpoint runs on the service's own
event loop (not prometheus_client's thread), so reading the state needs no locks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.admission import Admission


class Outcomes:
    """What happened to requests: forwarded per tier, rejected per reason."""

    def __init__(self) -> None:
        self.forwarded: Counter[str] = Counter()
        self.rejected: Counter[tuple[str, str]] = Counter()

    def forward(self, tier: str) -> None:
        self.forwarded[tier] += 1

    def reject(self, status: int, reason: str | None) -> None:
        self.rejected[(str(status), reason or "other")] += 1


class GatewayCollector(Collector):
    def __init__(self, admission: Admission, outcomes: Outcomes) -> None:
        self.admission = admission
        self.outcomes = outcomes

    def collect(self) -> Iterator[Metric]:
        scheduler = self.admission.scheduler
        depth = GaugeMetricFamily(
            "fairlane_queue_depth",
            "Requests held in the gateway's queue, per tier.",
            labels=["tier"],
        )
        oldest = GaugeMetricFamily(
            "fairlane_queue_oldest_wait_seconds",
            "How long the oldest request held in a tier's queue has waited (starvation).",
            labels=["tier"],
        )
        for tier, count in scheduler.depths().items():
            depth.add_metric([tier], count)
            oldest.add_metric([tier], scheduler.oldest_wait_s(tier))
        yield depth
        yield oldest
        by_tier = GaugeMetricFamily(
            "fairlane_tier_in_flight",
            "Requests released upstream and not yet seen to finish, per tier.",
            labels=["tier"],
        )
        for tier, count in self.admission.in_flight_by_tier().items():
            by_tier.add_metric([tier], count)
        yield by_tier
        in_flight = GaugeMetricFamily(
            "fairlane_backend_in_flight",
            "Requests released to a backend and not yet seen to finish.",
            labels=["backend", "region"],
        )
        healthy = GaugeMetricFamily(
            "fairlane_backend_healthy",
            "1 when the backend's health check passes.",
            labels=["backend", "region"],
        )
        for backend in self.admission.pool.backends:
            in_flight.add_metric([backend.address, backend.region], backend.in_flight)
            healthy.add_metric([backend.address, backend.region], int(backend.healthy))
        yield in_flight
        yield healthy
        forwarded = CounterMetricFamily(
            "fairlane_requests_forwarded", "Requests released upstream, per tier.", labels=["tier"]
        )
        for tier, count in self.outcomes.forwarded.items():
            forwarded.add_metric([tier], count)
        yield forwarded
        rejected = CounterMetricFamily(
            "fairlane_requests_rejected",
            "Requests the gateway answered itself, per HTTP status and reason.",
            labels=["status", "reason"],
        )
        for (status, reason), count in self.outcomes.rejected.items():
            rejected.add_metric([status, reason], count)
        yield rejected
        picks = CounterMetricFamily(
            "fairlane_picks",
            "Requests sent to a backend, per backend and why it was chosen: prefix (it held "
            "the prompt's prefix within the sticky margin), load (best score), only (the one "
            "candidate).",
            labels=["backend", "reason"],
        )
        for (address, reason), count in self.admission.picks.items():
            picks.add_metric([address, reason], count)
        yield picks


async def start_metrics_server(
    collector: Collector, host: str, port: int
) -> tuple[web.AppRunner, int]:
    """Serve ``/metrics`` on the running loop; returns the runner and the bound port."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), content_type="text/plain", charset="utf-8"
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, int(bound)
