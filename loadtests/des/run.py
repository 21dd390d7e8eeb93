"""One simulation: the workload, fairlane's real core and the engines on one virtual clock.

A request's way, as in the real stack: the client's body reaches ``Gateway.handle``; a
``Forward`` goes through the Envoy model to the listed engine, a ``Hold`` waits until a
grant (``Gateway.resume``) or its deadline (``Gateway.give_up``), a ``Respond`` is the
client's answer. The engine's last token schedules the completion feedback
(``Gateway.completed``) ``feedback_delay_s`` later, and every grant that frees is
forwarded. Scrape rounds read every engine every ``scrape_interval_s`` and hand the
numbers to ``Backend.record_scrape`` ``scrape_delay_s`` later, then dispatch, as the
poller does. Everything is measured in virtual seconds except the core's CPU cost.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from array import array
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.core.admission import Grant
from extproc.core.decisions import Forward, Hold, Respond
from extproc.core.events import Completion, RequestInfo
from extproc.core.feedback import BODY_BYTES_PER_TOKEN, BODY_ENVELOPE_BYTES, STREAM_BYTES_PER_TOKEN
from extproc.fleet.backend import BackendSpec
from extproc.fleet.models import ServedModels
from extproc.fleet.vllm_metrics import EngineMetrics
from extproc.policy import DEFAULT_POLICY_PATH
from loadtests.bench.workload import TEMPLATE_TOKENS
from loadtests.des.clock import EventLoop
from loadtests.des.engines import EngineNode
from loadtests.des.envoy import next_endpoint
from loadtests.des.gateway import Core, chat_body, write_policy
from loadtests.des.model import DesScenario
from loadtests.des.workload import Ask, Client, Traffic, Workload
from loadtests.sim.engine import EngineConfig, EngineRequest, Policy
from loadtests.sim.profiles import get_profile

MODEL = "sim-model"


def model_names(count: int) -> tuple[str, ...]:
    """The fleet's models: the simulators' own name alone, or ``model-0`` ... for several."""
    return (MODEL,) if count == 1 else tuple(f"model-{k}" for k in range(count))


PRIORITY_HEADER = "x-vllm-priority"


@dataclass(slots=True)
class Flight:
    """One request on its way (the engine hears of it through its ``_Sink``)."""

    ask: Ask
    request_id: str
    arrival: float
    client: Client | None = None
    """The closed-loop client that sent it (None: an open-loop arrival)."""
    hold: Hold | None = None
    forward: Forward | None = None
    tried: int = 0
    node: EngineNode | None = None
    forwarded_at: float | None = None
    first_at: float | None = None
    req: EngineRequest | None = None
    """The request on its engine now (a retry makes a new one)."""
    cancel_id: str | None = None
    """Set while admission may cancel it (``Forward.cancel_id``), until its answer starts."""
    done: bool = False
    ended_at: float | None = None
    """When the client had its answer (its last token, or the refusal)."""
    status: int = 0
    output: int = 0
    """Tokens the client received (0 unless it was answered 200)."""


@dataclass
class Stats:
    """What the run measured, over requests that arrived after the warm-up."""

    warmup_s: float
    """Requests arriving before this virtual time are not measured (start + warm-up)."""
    ttft: dict[str, array] = field(default_factory=lambda: defaultdict(lambda: array("d")))
    wait_max: dict[str, float] = field(default_factory=dict)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    served: Counter[str] = field(default_factory=Counter)
    """Closed-loop tenant -> tokens (prompt + output) of its requests finished in window."""
    sent: int = 0
    measured: int = 0
    outage: tuple[float, float] | None = None
    """(start, end) of the region outage: requests are also counted per phase of it."""
    ttft_by_phase: dict[str, dict[str, array]] = field(default_factory=dict)
    """Phase (``before``/``during``/``after`` the outage, by arrival) -> tier -> TTFTs."""
    statuses_by_phase: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    lost: int = 0
    """Requests on an engine when it died (Envoy retried them, or cut their stream)."""
    preempted: int = 0
    """Running requests the gateway cancelled to seat a more urgent one (answered 503)."""

    def phase(self, arrival: float) -> str | None:
        """The outage phase a request that arrived at ``arrival`` belongs to (None: none)."""
        if self.outage is None:
            return None
        start, end = self.outage
        return "before" if arrival < start else "during" if arrival < end else "after"


class Simulation:
    def __init__(
        self,
        scenario: DesScenario,
        workdir: Path,
        fast_forward: bool = True,
        keep_flights: bool = False,
        traffic: Traffic | None = None,
        policy_path: Path | None = None,
        engine: EngineConfig | None = None,
    ) -> None:
        """``fast_forward=False`` steps every engine step as an event (``engines``): the
        reference the fast-forward is tested against, and much slower. ``keep_flights``
        keeps every answered request in ``flights`` and the others in ``live`` (for tests
        and the A/B runs: a day's 10 M would not fit).

        By default the scenario's own workload (``Workload``) plays against the default
        policy with its tenants appended, on engines of the scenario's ``fleet``;
        ``traffic``, ``policy_path`` and ``engine`` replace them (``loadtests.des.ab``: a
        bench scenario's groups, its policy, its simulators' flags)."""
        self.scenario = scenario
        self.keep_flights = keep_flights
        self.loop = EventLoop(scenario.start_s)
        workdir.mkdir(parents=True, exist_ok=True)
        if traffic is None or policy_path is None:
            workload = Workload(scenario.open_loop, scenario.closed_loops, scenario.seed)
            tenants = workload.open_tenants() + workload.closed_tenants()
            traffic = traffic or workload
            policy_path = policy_path or write_policy(
                DEFAULT_POLICY_PATH, tenants, workdir / "policy.yaml"
            )
        self.traffic: Traffic = traffic
        fleet = scenario.fleet
        config = engine or EngineConfig(
            profile=get_profile(fleet.profile),
            max_num_seqs=fleet.max_num_seqs,
            num_gpu_blocks=fleet.num_gpu_blocks,
            policy=Policy.PRIORITY,
        )
        specs, self.nodes = [], {}
        for i in range(fleet.engines):
            region = f"r{i % fleet.regions}"
            spec = BackendSpec(
                f"10.{i // 250}.{i % 250}.1",
                8000,
                region=region,
                seats=config.max_num_seqs if fleet.declare_seats else None,
            )
            specs.append(spec)
            self.nodes[spec.address] = EngineNode(
                self.loop, spec.address, region, config, fast_forward
            )
        # Regions interleaved, so the first backend (the local region) is r0's.
        self.core = Core(policy_path, specs, self.loop)
        self.models = model_names(fleet.models)
        if fleet.models > 1:  # each block of engines serves one model, as /v1/models says
            pool = self.core.pool
            for i, backend in enumerate(pool.backends):
                name = self.models[i * fleet.models // fleet.engines]
                pool.set_models(backend, ServedModels(frozenset({name})))
        self.block_size = config.block_size
        policy = self.core.store.current
        self.scrape_interval_s = (
            scenario.knobs.scrape_interval_s or policy.backpressure.scrape_interval_s
        )
        self.held: dict[str, Flight] = {}
        self.cancellable: dict[str, Flight] = {}
        """Running requests admission may cancel, by ``cancel_id``."""
        self.flights: dict[str, Flight] = {}
        """Answered requests by id, when ``keep_flights``."""
        self.live: dict[str, Flight] = {}
        """Requests sent and not answered yet, by id, when ``keep_flights``."""
        self.stats = Stats(scenario.start_s + scenario.warmup_s)
        if scenario.outage is not None:
            outage = scenario.outage
            self.stats.outage = (outage.at_s, outage.at_s + outage.for_s)
        self._ids = 0
        self.stopped_sending = False
        self.in_progress = 0
        """Requests sent whose client has no answer yet: once sending stopped, the run
        ends when this reaches zero."""

    # Driving ----------------------------------------------------------------------------

    def run(self) -> Stats:
        loop, scenario = self.loop, self.scenario
        start = scenario.start_s
        loop.at(self.traffic.next_arrival(start), self._open_arrival)
        for client in self.traffic.clients(start):
            loop.at(client.start_s, self._closed_send, client)
        loop.at(start, self._scrape_round)
        if scenario.cost_after_warmup:
            loop.at(start + scenario.warmup_s, lambda _: self.core.restart_counting())
        if scenario.outage is not None:
            loop.at(scenario.outage.at_s, self._outage_start)
        loop.run_until(start + scenario.duration_s)
        return self.stats

    def _next_id(self) -> str:
        self._ids += 1
        return f"r{self._ids}"

    def _may_send(self) -> bool:
        if self.stats.sent >= self.scenario.max_requests:
            self.stopped_sending = True
        return not self.stopped_sending

    def _open_arrival(self, _: Any) -> None:
        if not self._may_send():
            return
        self._send(self.traffic.open_ask(), None)
        self.loop.at(self.traffic.next_arrival(self.loop.now), self._open_arrival)

    def _closed_send(self, client: Client) -> None:
        if not self._may_send():
            return
        if client.stop_s is not None and self.loop.now >= client.stop_s:
            return  # the job is over: its outstanding requests end, no new one starts
        self._send(client.next_ask(), client)

    # A request ---------------------------------------------------------------------------

    def _send(self, ask: Ask, client: Client | None) -> None:
        now = self.loop.now
        request_id = self._next_id()
        flight = Flight(ask, request_id, now, client)
        self.stats.sent += 1
        self.in_progress += 1
        if self.keep_flights:
            self.live[request_id] = flight
        info = RequestInfo(
            method="POST",
            path="/v1/chat/completions",
            headers={
                ":path": "/v1/chat/completions",
                "authorization": f"Bearer {ask.api_key}",
                "content-type": "application/json",
            },
            body=chat_body(
                self.models[self._ids % len(self.models)], ask.prompt, ask.max_tokens, ask.stream
            ),
            request_id=request_id,
        )
        decision = self.core.handle(info)
        answer = decision.answer
        if isinstance(answer, Forward):
            self._forward(flight, answer)
        elif isinstance(answer, Hold):
            flight.hold = answer
            self.held[answer.request_id] = flight
            self.loop.at(now + answer.deadline_s, self._deadline, flight)
        elif isinstance(answer, Respond):
            self._end(flight, answer.status, 0)
        self._wake(decision.grants)

    def _wake(self, grants: tuple[Grant, ...] | list[Grant]) -> None:
        """Forward what the core granted; then answer what it cancelled to make room, as
        ``extproc.transport.held`` does after every decision."""
        for grant in grants:
            flight = self.held.pop(grant.request_id, None)
            if flight is None or flight.hold is None:
                continue
            self._forward(flight, self.core.resume(flight.hold, grant))
        for cancel_id in self.core.take_preempted():
            self._preempted(cancel_id)

    def _preempted(self, cancel_id: str) -> None:
        """Admission cancelled this running request for a more urgent one: its client gets
        503 with retry-after now, Envoy resets it upstream (the engine aborts it) and the
        access log reaches the gateway later, as for any failed request."""
        flight = self.cancellable.pop(cancel_id, None)
        if flight is None or flight.done:
            return
        flight.cancel_id = None
        self.stats.preempted += 1
        answer = self.core.preempted(flight.ask.tier)
        if flight.node is not None and flight.req is not None:
            flight.node.abort(flight.req)
        node = flight.node
        self._complete(flight, answer.status, node.address if node else "", 0)

    def _deadline(self, flight: Flight) -> None:
        if flight.hold is None or self.held.pop(flight.hold.request_id, None) is None:
            return
        decision = self.core.give_up(flight.hold)
        status = decision.answer.status if isinstance(decision.answer, Respond) else 503
        self._end(flight, status, 0)
        self._wake(decision.grants)

    def _forward(self, flight: Flight, forward: Forward) -> None:
        now = self.loop.now
        flight.forward = forward
        flight.forwarded_at = now
        if forward.cancel_id is not None:
            flight.cancel_id = forward.cancel_id
            self.cancellable[forward.cancel_id] = flight
            self.core.cancellable(forward.cancel_id)
        wait = now - flight.arrival
        stats = self.stats
        if flight.arrival >= stats.warmup_s and wait > stats.wait_max.get(flight.ask.tier, 0.0):
            stats.wait_max[flight.ask.tier] = wait
        delay = self.scenario.knobs.forward_delay_s
        if delay:
            self.loop.at(now + delay, self._arrive, flight)
        else:
            self._try(flight)

    def _arrive(self, flight: Flight) -> None:
        """The forwarded request reaches Envoy's upstream ``forward_delay_s`` after the
        decision, unless it was cancelled meanwhile."""
        if not flight.done:
            self._try(flight)

    def _try(self, flight: Flight) -> None:
        """Envoy sends the request to the next listed endpoint that is up (``envoy``)."""
        forward = flight.forward
        assert forward is not None
        found = next_endpoint(forward.endpoints, flight.tried, self.nodes)
        if found is None:
            self._complete(flight, 503, "", 0)
            return
        index, node = found
        flight.tried = index + 1
        flight.node = node
        ask = flight.ask
        prompt_len = ask.prompt_tokens + TEMPLATE_TOKENS
        size = self.block_size
        shared = ask.prefix_tokens // size
        hashes: list[Any] = [f"{ask.tenant}/{k}".encode() for k in range(shared)]
        hashes += [f"{flight.request_id}/{k}".encode() for k in range(shared, prompt_len // size)]
        req = EngineRequest(
            request_id=flight.request_id,
            prompt_len=prompt_len,
            block_hashes=hashes,
            max_tokens=ask.max_tokens,
            output_len=ask.output_tokens,
            priority=int(forward.set_headers.get(PRIORITY_HEADER, "0")),
            params_max_tokens=ask.max_tokens,
            sink=_Sink(self, flight),  # the engine calls back first_token/finished on it
        )
        flight.req = req
        node.submit(req)

    def first_token(self, flight: Flight, at: float) -> None:
        if flight.done:  # cancelled in the step that made this token
            return
        flight.first_at = at
        stats = self.stats
        if flight.arrival >= stats.warmup_s:
            ttft = at + self.scenario.knobs.response_delay_s - flight.arrival
            stats.ttft[flight.ask.tier].append(ttft)
            phase = stats.phase(flight.arrival)
            if phase is not None:
                by_tier = stats.ttft_by_phase.setdefault(phase, {})
                by_tier.setdefault(flight.ask.tier, array("d")).append(ttft)

    def finished(self, flight: Flight, req: EngineRequest, at: float) -> None:
        if flight.done:  # cancelled (aborted) in its last step: the 503 was its answer
            return
        ask = flight.ask
        output = req.num_output
        if ask.stream:
            size = round(output * STREAM_BYTES_PER_TOKEN)
        else:
            size = round(BODY_ENVELOPE_BYTES + output * BODY_BYTES_PER_TOKEN)
        if flight.client is not None and flight.arrival >= self.stats.warmup_s:
            self.stats.served[ask.tenant] += ask.prompt_tokens + output
        node = flight.node
        self.loop.at(
            at + self.scenario.knobs.feedback_delay_s,
            self._feedback,
            (flight, 200, node.address if node else "", size),
        )
        self._end(flight, 200, output, self.scenario.knobs.response_delay_s)

    def lost(self, flight: Flight) -> None:
        """Its engine died: Envoy retries it if nothing reached the client yet."""
        if flight.done:
            return
        if flight.first_at is not None and flight.ask.stream:
            node = flight.node
            self._complete(flight, 0, node.address if node else "", 1)
            return
        self._try(flight)

    def _complete(self, flight: Flight, status: int, upstream: str, size: int) -> None:
        """A failed request: the client's answer now, the access log's feedback later."""
        self.loop.at(
            self.loop.now + self.scenario.knobs.feedback_delay_s,
            self._feedback,
            (flight, status, upstream, size),
        )
        self._end(flight, status if status else 502, 0)

    def _feedback(self, event: tuple[Flight, int, str, int]) -> None:
        flight, status, upstream, size = event
        now = self.loop.now
        first = None if flight.first_at is None else flight.first_at - flight.arrival
        completion = Completion(
            flight.request_id, status, upstream, now - flight.arrival, size, first
        )
        self._wake(self.core.completed(completion))

    def _end(self, flight: Flight, status: int, output: int, delay: float = 0.0) -> None:
        """The client has its answer (``delay`` from now: the way back through Envoy):
        count it; a closed-loop client sends its next."""
        if flight.done:
            return
        flight.done = True
        flight.ended_at = self.loop.now + delay
        flight.status = status
        flight.output = output
        if flight.cancel_id is not None:  # its answer started (or it failed): not cancellable
            self.cancellable.pop(flight.cancel_id, None)
            self.core.settled(flight.cancel_id)
            flight.cancel_id = None
        if self.keep_flights:
            self.flights[flight.request_id] = flight
            self.live.pop(flight.request_id, None)
        self.in_progress -= 1
        if self.in_progress == 0 and self.stopped_sending:
            self.loop.stop()
        stats = self.stats
        if flight.arrival >= stats.warmup_s:
            stats.statuses[(flight.ask.tier, status)] += 1
            stats.measured += 1
            phase = stats.phase(flight.arrival)
            if phase is not None:
                stats.statuses_by_phase[(phase, flight.ask.tier, status)] += 1
        client = flight.client
        if client is not None:
            pause = client.think_s if 200 <= status < 300 else client.refusal_pause_s
            self.loop.at(self.loop.now + delay + pause, self._closed_send, client)

    # The poller ----------------------------------------------------------------------------

    def _scrape_round(self, _: Any) -> None:
        now = self.loop.now
        read = [(node, node.metrics(now) if node.alive else None) for node in self.nodes.values()]
        self.loop.at(now + self.scenario.knobs.scrape_delay_s, self._scraped, read)
        self.loop.at(now + self.scrape_interval_s, self._scrape_round)

    def _scraped(self, read: list[tuple[EngineNode, EngineMetrics | None]]) -> None:
        by_address = self.core.pool.by_address
        for node, metrics in read:
            self.core.scraped(by_address[node.address], metrics)
        self._wake(self.core.dispatch())

    # A region lost ------------------------------------------------------------------------

    def _outage_start(self, _: Any) -> None:
        outage = self.scenario.outage
        assert outage is not None
        lost: list[EngineRequest] = []
        down = [n for n in self.nodes.values() if n.region == outage.region]
        for node in down:
            lost += node.kill()
        delay = self.scenario.knobs.health_delay_s
        self.loop.at(self.loop.now + delay, self._health, (down, False))
        self.loop.at(self.loop.now + outage.for_s, self._outage_end, down)
        self.stats.lost += len(lost)
        for req in lost:
            sink: _Sink = req.sink
            sink.sim.lost(sink.flight)

    def _outage_end(self, down: list[EngineNode]) -> None:
        for node in down:
            node.revive()
        self.loop.at(self.loop.now + self.scenario.knobs.health_delay_s, self._health, (down, True))

    def _health(self, event: tuple[list[EngineNode], bool]) -> None:
        nodes, up = event
        by_address = self.core.pool.by_address
        for node in nodes:
            by_address[node.address].health_ok = up
        if up:
            self._wake(self.core.dispatch())


@dataclass(slots=True)
class _Sink:
    """The engine's view of a flight (``engines.Watcher``)."""

    sim: Simulation
    flight: Flight

    def first_token(self, req: EngineRequest, at: float) -> None:
        self.sim.first_token(self.flight, at)

    def finished(self, req: EngineRequest, at: float) -> None:
        self.sim.finished(self.flight, req, at)


@dataclass(frozen=True)
class Measured:
    stats: Stats
    decision_us: float
    """CPU microseconds of the core's request path per request handled."""
    cpu_ns: dict[str, int]
    calls: dict[str, int]
    wall_s: float
    events: int
    engine_steps: int
    engine_steps_skipped: int
    """Of ``engine_steps``, those the decode fast-forward took without ``Engine.step``."""
    flows: int
    """Flows the scheduler tracks at the end (bounded by the busy period's)."""


def simulate(
    scenario: DesScenario, workdir: Path, fast_forward: bool = True
) -> tuple[Simulation, Measured]:
    """Run ``scenario``; the simulation (for its state) and what was measured."""
    started = time.perf_counter()
    sim = Simulation(scenario, workdir, fast_forward)
    gc.collect()
    sim.run()
    wall = time.perf_counter() - started
    return sim, Measured(
        stats=sim.stats,
        decision_us=sim.core.request_path_us(),
        cpu_ns=dict(sim.core.cpu_ns),
        calls=dict(sim.core.calls),
        wall_s=wall,
        events=sim.loop.events,
        engine_steps=sum(n.steps for n in sim.nodes.values()),
        engine_steps_skipped=sum(n.skipped for n in sim.nodes.values()),
        flows=sim.core.admission.scheduler.tracked_flows(),
    )


def core_bytes(scenario: DesScenario, engines: int, tenants: int, workdir: Path) -> int:
    """Bytes the core holds right after start (policy, pool, admission) for ``engines`` and
    ``tenants``: what ``tracemalloc`` traces while ``Core`` is built, engines and workload
    left out."""
    sized = scenario.scaled(engines, tenants, 1)
    workload = Workload(sized.open_loop, sized.closed_loops, sized.seed)
    workdir.mkdir(parents=True, exist_ok=True)
    names = workload.open_tenants() + workload.closed_tenants()
    path = write_policy(DEFAULT_POLICY_PATH, names, workdir / f"policy-{engines}x{tenants}.yaml")
    specs = [
        BackendSpec(f"10.{i // 250}.{i % 250}.1", 8000, region=f"r{i % 3}") for i in range(engines)
    ]
    del workload, names
    gc.collect()
    tracemalloc.start()
    try:
        core = Core(path, specs, time.monotonic)
        size = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del core
    return size


MEMORY_TENANTS = 10_000
"""Tenants added to measure the core's memory per tenant (``bench``)."""


def _is_the_run(scenario: DesScenario, engines: int, tenants: int, sent: int) -> bool:
    """Whether the sweep's point ``engines`` x ``tenants`` would simulate exactly what the
    scenario's own run did: its size, no outage (points have none), and a run that ended
    by its duration before the point's request cap (``scale-day --duration 120``)."""
    return (
        scenario.fleet.engines == engines
        and scenario.open_loop.tenants == tenants
        and scenario.outage is None
        and sent < min(scenario.sweep_requests, scenario.max_requests)
    )


def bench(scenario: DesScenario, out: Path) -> dict[str, Any]:
    """The scenario's run, its decision-cost sweep and the core's memory; the results."""
    from loadtests.des import report

    work = out / "work"
    sim, measured = simulate(scenario, work)
    aging = report.aging_bound_s(sim.core.store.current.tiers)
    del sim
    main = report.run_summary(scenario, measured, aging)
    sweep: dict[str, dict[str, Any]] = {}
    for engines, tenants in scenario.sweep:
        if _is_the_run(scenario, engines, tenants, measured.stats.sent):
            sweep[f"{engines}x{tenants}"] = main  # the same simulation: not run twice
            continue
        sized = scenario.scaled(engines, tenants, scenario.sweep_requests)
        _, point = simulate(sized, work / f"sweep-{engines}x{tenants}")
        sweep[f"{engines}x{tenants}"] = report.run_summary(sized, point, aging)
    by_models: dict[str, dict[str, Any]] = {}
    for models, engines in scenario.model_sweep:
        factor = engines / scenario.fleet.engines
        tenants = max(1, round(scenario.open_loop.tenants * factor))
        cap = max(1, round(scenario.max_requests * factor))
        sized = scenario.scaled(engines, tenants, cap, models=models)
        _, point = simulate(sized, work / f"models-{models}x{engines}")
        by_models[f"{models}x{engines}"] = report.run_summary(sized, point, aging)
    memory: dict[str, float] = {}
    if scenario.sweep:
        low = min(scenario.sweep)
        high = max(scenario.sweep)
        base = core_bytes(scenario, low[0], low[1], work)
        # The cost per tenant is linear (1,270 bytes each from 1k to 11k tenants, 1,288 from
        # 1k to 100k), and building 100k tenants under tracemalloc takes minutes: at most
        # MEMORY_TENANTS more tenants are built.
        tenants = min(high[1], low[1] + MEMORY_TENANTS)
        more_tenants = core_bytes(scenario, low[0], tenants, work)
        more_engines = core_bytes(scenario, high[0], low[1], work)
        if tenants > low[1]:
            memory["per_tenant"] = (more_tenants - base) / (tenants - low[1])
        if high[0] > low[0]:
            memory["per_engine"] = (more_engines - base) / (high[0] - low[0])
    return report.write(out, scenario, main, sweep, memory, by_models)
