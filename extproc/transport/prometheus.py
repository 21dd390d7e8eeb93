"""The gateway's own Prometheus metrics: live state read at scrape time, plus counters.

Queue depths, in-flight counts, backend state and the policy's SLOs are read from the
admission state when Prometheus scrapes, so the request path pays nothing for them. What
happened to requests (admitted, shed, rejected, waits, latencies, fairness shares) is counted
on the request path by ``extproc.core.counters`` as plain Python and turned into metric families
here. The endpoint runs on the service's own event loop (not prometheus_client's thread), so
reading the state needs no locks; a scrape costs work proportional to the series, which are
bounded: tiers and backends come from configuration, reasons from the code, and client-chosen
values (users, models) from ``BoundedLabel``.

The names, their labels and what they mean are listed in docs/reference/metrics.md.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from extproc.core.admission import Admission
from extproc.core.bands import pool_of, tier_of
from extproc.core.counters import GatewayStats, Histogram
from extproc.core.overload import OverloadControl
from extproc.fleet.membership import CHANGES, Membership
from extproc.fleet.vllm_metrics import OPTIONAL
from extproc.state.replica import SharedState
from extproc.transport.kv_feeds import KVEventFeeds

if TYPE_CHECKING:
    from extproc.policy import PolicyStore

BACKEND_LABELS = ["backend", "region"]
MODELS_PER_BACKEND = 64
"""Model names exported per engine: a bounded label, whatever an engine lists."""


def _counter(
    name: str, doc: str, labels: list[str], values: Iterable[tuple[Sequence[str], int]]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, count in values:
        family.add_metric(list(key), count)
    return family


def _histogram(
    name: str, doc: str, labels: list[str], histograms: Mapping[tuple[str, ...], Histogram]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=labels)
    for key, histogram in histograms.items():
        family.add_metric(list(key), list(histogram.cumulative()), histogram.total)
    return family


KV_STREAM_COUNTERS = (
    "messages",
    "events",
    "gaps",
    "gaps_lost",
    "replays_ok",
    "replays_failed",
    "restarts",
    "decode_errors",
)
"""A KV event subscriber's counters, each a ``kind`` of ``fairlane_kv_events_total``."""


class PortStats(Protocol):
    """What the gRPC server tells of its port (``extproc.transport.h2grpc.GrpcServer``)."""

    @property
    def open_connections(self) -> int: ...

    @property
    def open_streams(self) -> int: ...

    @property
    def refused_connections(self) -> int: ...


class GatewayCollector(Collector):
    def __init__(
        self,
        admission: Admission,
        stats: GatewayStats,
        policies: PolicyStore | None = None,
        overload: OverloadControl | None = None,
        state: SharedState | None = None,
        membership: Membership | None = None,
        kv_feeds: KVEventFeeds | None = None,
        port: PortStats | None = None,
    ) -> None:
        self.admission = admission
        self.port = port
        self.kv_feeds = kv_feeds
        self.stats = stats
        self.policies = policies
        self.overload = overload
        self.state = state
        self.membership = membership

    def collect(self) -> Iterator[Metric]:
        yield from self._queues()
        yield from self._slos()
        yield from self._seats()
        yield from self._backends()
        yield from self._fleet()
        yield from self._prefix()
        yield from self._outcomes()
        yield from self._latencies()
        yield from self._overload()
        yield from self._port()
        yield from self._budgets()
        yield from self._replicas()

    def _queues(self) -> Iterable[Metric]:
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
        by_pool = GaugeMetricFamily(
            "fairlane_pool_queue_depth",
            "Requests held in the gateway's queue, per tier and model pool (the pool is "
            "empty on a fleet of one model).",
            labels=["tier", "pool"],
        )
        depths: Counter[str] = Counter()
        waits: dict[str, float] = {}
        for band, count in scheduler.depths().items():  # a tier's bands: one per model pool
            tier = tier_of(band)
            by_pool.add_metric([tier, pool_of(band)], count)
            depths[tier] += count
            waits[tier] = max(waits.get(tier, 0.0), scheduler.oldest_wait_s(band))
        for tier, count in depths.items():
            depth.add_metric([tier], count)
            oldest.add_metric([tier], waits[tier])
        by_tier = GaugeMetricFamily(
            "fairlane_tier_in_flight",
            "Requests released upstream and not yet seen to finish, per tier.",
            labels=["tier"],
        )
        counts = self.admission.in_flight_by_tier()
        for configured in self.admission.policy.tiers:  # 0s too: a vanished line reads as no data
            by_tier.add_metric([configured.name], counts.pop(configured.name, 0))
        for removed, count in counts.items():  # a tier a reload removed, still finishing
            by_tier.add_metric([removed], count)
        return (depth, by_pool, oldest, by_tier)

    def _slos(self) -> Iterable[Metric]:
        """The policy's promises, so alerts and dashboards compare against them by tier."""
        ttft = GaugeMetricFamily(
            "fairlane_tier_slo_ttft_seconds",
            "The tier's time-to-first-token objective from the policy (slo_ttft_ms).",
            labels=["tier"],
        )
        latency = GaugeMetricFamily(
            "fairlane_tier_slo_latency_seconds",
            "The tier's end-to-end latency objective from the policy (slo_latency_s).",
            labels=["tier"],
        )
        for tier in self.admission.policy.tiers:
            if tier.slo_ttft_ms is not None:
                ttft.add_metric([tier.name], tier.slo_ttft_ms / 1000)
            if tier.slo_latency_s is not None:
                latency.add_metric([tier.name], tier.slo_latency_s)
        return (ttft, latency)

    def _seats(self) -> Iterable[Metric]:
        """What admission plans with: each backend's seats (and where that count comes
        from), the fleet's total and each tier's reserve, so an operator can see why batch
        is held back and whether a backend's real size was learned."""
        seats = GaugeMetricFamily(
            "fairlane_backend_seats",
            "Requests the backend's engine runs at once, as the gateway plans with it; source: "
            "declared (deployment), learned (requests waited while KV had room), fallback "
            "(not learned yet: a step more than the engine was seen running).",
            labels=[*BACKEND_LABELS, "source"],
        )
        for backend in self.admission.pool.backends:
            count = backend.seats  # one series per backend: its current source only
            seats.add_metric([backend.address, backend.region, count.source], count.count)
        fleet = GaugeMetricFamily(
            "fairlane_fleet_seats",
            "Seats of the healthy backends (each capped at max_in_flight_per_backend; a "
            "count not learned yet one more, as it is being probed): what reservations are "
            "shares of.",
        )
        fleet.add_metric([], self.admission.capacity)
        reserved = GaugeMetricFamily(
            "fairlane_tier_reserved_seats",
            "Seats a tier keeps from less urgent tiers, sized to its recent demand and capped "
            "by its reserved_share (0 without one); enforced while the tier is active.",
            labels=["tier"],
        )
        by_rank = self.admission.reserved()
        for tier in self.admission.policy.tiers:
            reserved.add_metric([tier.name], by_rank.get(tier.rank, 0))
        return (seats, fleet, reserved)

    def _backends(self) -> Iterable[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=BACKEND_LABELS)

        in_flight = gauge(
            "fairlane_backend_in_flight",
            "Requests released to a backend and not yet seen to finish.",
        )
        cancellable = gauge(
            "fairlane_backend_cancellable",
            "Requests running on the backend that a more urgent request may cancel "
            "(non-streamed, of a preemptible tier, answer not started).",
        )
        healthy = gauge(
            "fairlane_backend_healthy",
            "1 when the backend may be picked: health check and last scrape passed, not "
            "cooling off.",
        )
        cooling = gauge(
            "fairlane_backend_cooling_off",
            "1 while the backend is set aside after failed completions in a row.",
        )
        waiting = gauge(
            "fairlane_backend_waiting",
            "The engine's waiting queue (vllm:num_requests_waiting) as last scraped.",
        )
        running = gauge(
            "fairlane_backend_running",
            "The engine's running batch (vllm:num_requests_running) as last scraped.",
        )
        kv = gauge(
            "fairlane_backend_kv_cache_usage_ratio",
            "The engine's KV-cache use, 0..1 (vllm:kv_cache_usage_perc), as last scraped.",
        )
        age = gauge(
            "fairlane_backend_metrics_age_seconds",
            "Seconds since the backend's last good metrics scrape (+Inf before the first).",
        )
        stale = gauge(
            "fairlane_backend_metrics_stale",
            "1 when the last good scrape is older than the policy's stale_after_s: every gate "
            "then treats the backend as saturated.",
        )
        absent = GaugeMetricFamily(
            "fairlane_backend_metrics_absent",
            "1 for an optional series the backend's /metrics lacks, so what it feeds is off "
            "for that backend (vllm:inter_token_latency_seconds: the tiers' ITL bounds; "
            "vllm:cache_config_info: the KV projection), 0 when the last good scrape had it.",
            labels=[*BACKEND_LABELS, "series"],
        )
        now = self.admission.pool.clock()
        stale_after = self.admission.policy.backpressure.stale_after_s
        for backend in self.admission.pool.backends:
            labels = [backend.address, backend.region]
            in_flight.add_metric(labels, backend.in_flight)
            cancellable.add_metric(labels, self.admission.cancellable_on(backend.address))
            healthy.add_metric(labels, int(backend.healthy))
            cooling.add_metric(labels, int(backend.cooling_off))
            metrics = backend.metrics
            seconds = math.inf if metrics is None else max(0.0, now - metrics.scraped_at)
            age.add_metric(labels, seconds)
            stale.add_metric(labels, int(seconds > stale_after))
            if metrics is not None:
                waiting.add_metric(labels, metrics.waiting)
                running.add_metric(labels, metrics.running)
                kv.add_metric(labels, metrics.kv_cache_usage)
                missing = metrics.absent
                for series in OPTIONAL:
                    absent.add_metric([*labels, series], int(series in missing))
        return (in_flight, cancellable, healthy, cooling, waiting, running, kv, age, stale, absent)

    def _fleet(self) -> Iterable[Metric]:
        """Who is in the fleet and how it changed (``dns://`` backends come and go)."""
        state = GaugeMetricFamily(
            "fairlane_backend_membership",
            "1 for the backend's place in the fleet: serving, warming (joined, no traffic "
            "until its first good scrape) or draining (left DNS, requests in flight finish).",
            labels=[*BACKEND_LABELS, "state"],
        )
        served = GaugeMetricFamily(
            "fairlane_backend_model",
            "1 for each model the engine answers to (its /v1/models: base names, and LoRA "
            "adapters with their base as parent; at most 64 per engine).",
            labels=[*BACKEND_LABELS, "model", "parent"],
        )
        for backend in self.admission.pool.backends:
            state.add_metric([backend.address, backend.region, backend.membership], 1)
            models = backend.models
            if models is not None:
                names = [(name, "") for name in sorted(models.bases)]
                names += sorted(models.adapters.items())
                for name, parent in names[:MODELS_PER_BACKEND]:
                    served.add_metric([backend.address, backend.region, name, parent], 1)
        yield state
        yield served
        membership = self.membership
        changes = membership.changes if membership is not None else {}
        yield _counter(
            "fairlane_fleet_changes",
            "Backends that joined (from DNS), began draining (gone from DNS), returned while "
            "draining, or were removed (drained).",
            ["change"],
            (((change,), changes.get(change, 0)) for change in CHANGES),
        )
        failures = CounterMetricFamily(
            "fairlane_dns_failures",
            "Failed resolutions of a dns:// backend (timeout, no server, NXDOMAIN); its "
            "last known addresses stay in use.",
            labels=["name"],
        )
        addresses = GaugeMetricFamily(
            "fairlane_dns_addresses",
            "Addresses a dns:// backend resolved to last.",
            labels=["name"],
        )
        failing = GaugeMetricFamily(
            "fairlane_dns_failing",
            "1 while the latest resolution of a dns:// backend failed.",
            labels=["name"],
        )
        if membership is not None:
            for source in membership.sources:
                failures.add_metric([source.url], membership.failures[source.url])
                addresses.add_metric([source.url], len(membership.addresses(source)))
                failing.add_metric([source.url], int(source.url in membership.failing))
        yield from (failures, addresses, failing)

    def _prefix(self) -> Iterable[Metric]:
        yield _counter(
            "fairlane_prefix_matches",
            "Grants per backend by the index that matched their prompt's prefix there: "
            "precise (the engine's KV events) or approximate (what was sent there: no events "
            "configured, or the event stream is not followed from a known point).",
            ["backend", "index"],
            self.admission.prefix_index.items(),
        )
        yield _counter(
            "fairlane_prefix_predicted_tokens",
            "Prompt tokens the prefix index said the chosen backend holds, at grant, per "
            "backend and index: compare with the engine's vllm:prefix_cache_hits_total (far "
            "fewer predicted than hit: the index is wrong, e.g. a --tokenizer other than the "
            "engine's model).",
            ["backend", "index"],
            self.admission.prefix_tokens.items(),
        )
        live = GaugeMetricFamily(
            "fairlane_backend_kv_events_live",
            "1 while the backend's KV event index is complete (the picker trusts it), 0 "
            "while it is not (after a late join or a gap that could not be replayed): its "
            "prefix affinity is approximate meanwhile. Only backends with kv-events.",
            labels=BACKEND_LABELS,
        )
        blocks = GaugeMetricFamily(
            "fairlane_backend_kv_index_blocks",
            "KV blocks the engine holds by its own events.",
            labels=BACKEND_LABELS,
        )
        stream = CounterMetricFamily(
            "fairlane_kv_events",
            "The engines' KV event streams: messages (batches), events, gaps (sequence "
            "jumps), gaps_lost (not replayable: the index was cleared), replays_ok, "
            "replays_failed, restarts (the sequence started over), decode_errors.",
            labels=[*BACKEND_LABELS, "kind"],
        )
        subscribers = self.kv_feeds.subscribers if self.kv_feeds is not None else {}
        for backend in self.admission.pool.backends:
            index = backend.kv_index
            if index is None:
                continue
            labels = [backend.address, backend.region]
            live.add_metric(labels, int(index.live))
            blocks.add_metric(labels, len(index))
            subscriber = subscribers.get(backend.address)
            if subscriber is not None:
                for kind in KV_STREAM_COUNTERS:
                    stream.add_metric([*labels, kind], getattr(subscriber, kind))
        yield from (live, blocks, stream)
        engine = self.admission.engine
        if engine is not None:
            tokenizer = engine.tokenizer
            yield _counter(
                "fairlane_prompt_pieces",
                "Pieces of prompts read for precise matching, by whether their token ids were "
                "cached (hit) or tokenized (miss), by requests and by the read-later loop.",
                ["cache"],
                [(("hit",), tokenizer.cache.hits), (("miss",), tokenizer.cache.misses)],
            )
            waiting = GaugeMetricFamily(
                "fairlane_prompts_read_later",
                "Prompts whose reading one request's budget of new text stopped, waiting to "
                "be read on between requests (a backlog that grows means the loop does not "
                "keep up, or the service is overloaded and reads none).",
            )
            waiting.add_metric([], len(tokenizer.later))
            yield waiting

    def _outcomes(self) -> Iterable[Metric]:
        stats = self.stats
        yield _counter(
            "fairlane_requests_admitted",
            "Requests released upstream, per tier and model (models past a bound are 'other').",
            ["tier", "model"],
            stats.admitted.items(),
        )
        yield _counter(
            "fairlane_requests_shed",
            "Requests a tier's queue turned away: queue_full, early_shed (429), "
            "queue_deadline_exceeded, no_usable_metrics (no backend's metrics could be "
            "read), tier_removed (503); and preempted (503: cancelled while it ran, to seat a "
            "more urgent request).",
            ["tier", "reason"],
            stats.shed.items(),
        )
        yield _counter(
            "fairlane_requests_rejected",
            "Requests refused before any queue (bad key, bad JSON, ...), per status and reason.",
            ["status", "reason"],
            stats.rejected.items(),
        )
        yield _counter(
            "fairlane_picks",
            "Requests sent to a backend, per backend and why it was chosen: prefix (it held "
            "the prompt's prefix within the sticky margin), load (best score), only (the one "
            "candidate), failover (outside the local region).",
            ["backend", "reason"],
            self.admission.picks.items(),
        )
        yield _counter(
            "fairlane_flow_requests",
            "Requests admitted per fairness flow (tenant, or tenant/user; bounded, then 'other').",
            ["tier", "flow"],
            stats.flow_requests.items(),
        )
        yield _counter(
            "fairlane_flow_tokens",
            "Tokens served per fairness flow: input at admission, output estimated at completion.",
            ["tier", "flow", "kind"],
            stats.flow_tokens.items(),
        )
        reloads = self.policies.reloads if self.policies is not None else {}
        yield _counter(
            "fairlane_policy_reloads",
            "Policy file changes: ok (swapped in) or error (refused, previous policy kept).",
            ["result"],
            (((result,), count) for result, count in reloads.items()),
        )

    def _latencies(self) -> Iterable[Metric]:
        stats = self.stats
        yield _histogram(
            "fairlane_queue_wait_seconds",
            "Time admitted requests waited in the gateway's queue, per tier.",
            ["tier"],
            stats.queue_wait.by_labels,
        )
        yield _histogram(
            "fairlane_time_to_first_byte_seconds",
            "Time to the first response byte sent to the client (Envoy's access log; queue "
            "time included), per tier.",
            ["tier"],
            stats.time_to_first_byte.by_labels,
        )
        yield _histogram(
            "fairlane_request_duration_seconds",
            "Time from the request's first byte to the response's last, as the client saw it "
            "(Envoy's access log), per tier.",
            ["tier"],
            stats.request_duration.by_labels,
        )
        yield _histogram(
            "fairlane_service_processing_seconds",
            "The service's own work per request (decode, classify, queue, pick, encode), "
            "without time held in a queue or spent in grpc.",
            [],
            {(): stats.service_time},
        )

    def _overload(self) -> Iterable[Metric]:
        if self.overload is None:
            return
        yield GaugeMetricFamily(
            "fairlane_overload_shed_ratio",
            "Share of new requests Envoy is told to turn away (503) before they reach the "
            "service, because the service is behind (0 while it keeps up).",
            value=self.overload.shed_fraction,
        )
        yield GaugeMetricFamily(
            "fairlane_overload_behind_seconds",
            "How far behind the service was in the last control period: the larger of its "
            "event loop's lag and how old requests were when it decided them.",
            value=self.overload.last_lag_s,
        )

    def _port(self) -> Iterable[Metric]:
        """The gRPC port Envoy calls: what is open on it now, and what its limits refused."""
        port = self.port
        if port is None:
            return
        yield GaugeMetricFamily(
            "fairlane_grpc_connections",
            "Connections open on the service's gRPC port (Envoy opens a few per worker).",
            value=port.open_connections,
        )
        yield GaugeMetricFamily(
            "fairlane_grpc_streams",
            "HTTP/2 streams open on the service's gRPC port: held requests, requests being "
            "decided, the completion feeds.",
            value=port.open_streams,
        )
        yield CounterMetricFamily(
            "fairlane_grpc_connections_refused",
            "Connections closed at once because the port's connection limit was reached.",
            value=port.refused_connections,
        )

    def _budgets(self) -> Iterable[Metric]:
        """Tenants' budgets (``extproc.core.budgets``): only tenants that have one."""
        budgets = self.admission.budgets
        yield _counter(
            "fairlane_budget_rejections",
            "Requests refused with 429 rate_limit_exceeded because a budget was spent, per "
            "tenant and limit (tokens_per_minute, requests_per_minute, concurrent; user_... "
            "for a user_budget's).",
            ["tenant", "limit"],
            budgets.rejections.items(),
        )
        used = GaugeMetricFamily(
            "fairlane_budget_used_ratio",
            "Share of a budgeted tenant's limit in use, fleet-wide: tokens and requests used, "
            "draining at the per-minute rate; requests in progress for concurrent; user_... "
            "limits: the tenant's most used user.",
            labels=["tenant", "limit"],
        )
        for (tenant, limit), ratio in sorted(
            budgets.used_ratios(self.admission.pool.clock()).items()
        ):
            used.add_metric([tenant, limit], ratio)
        yield used

    def _replicas(self) -> Iterable[Metric]:
        """Shared state (``--state``); nothing when the service runs alone."""
        state = self.state
        if state is None:
            return
        stats = state.stats
        yield GaugeMetricFamily(
            "fairlane_state_shared",
            "1 while this replica shares state through Redis, 0 while it is cut off and "
            "schedules alone on its share of each backend.",
            value=1.0 if state.shared else 0.0,
        )
        yield GaugeMetricFamily(
            "fairlane_state_replicas",
            "Replicas alive at the last exchange, this one included.",
            value=state.replicas_seen,
        )
        yield CounterMetricFamily(
            "fairlane_state_exchanges_total",
            "Exchanges with Redis that succeeded (one round trip each).",
            value=stats.exchanges,
        )
        yield CounterMetricFamily(
            "fairlane_state_exchange_failures_total",
            "Exchanges with Redis that failed or timed out.",
            value=stats.failures,
        )
        yield CounterMetricFamily(
            "fairlane_state_cut_offs_total",
            "Times this replica lost Redis and began scheduling alone.",
            value=stats.cut_offs,
        )
        yield CounterMetricFamily(
            "fairlane_state_exchange_seconds_total",
            "Wall time spent in exchanges with Redis (over exchanges: the mean round trip).",
            value=stats.exchange_seconds,
        )
        peers = GaugeMetricFamily(
            "fairlane_backend_peer_in_flight",
            "Requests the other replicas have in flight on a backend (their leases), as of "
            "the last exchange.",
            labels=BACKEND_LABELS,
        )
        for backend in self.admission.pool.backends:
            peers.add_metric([backend.address, backend.region], backend.peer_in_flight)
        yield peers


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
