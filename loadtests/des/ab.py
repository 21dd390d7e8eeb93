"""An A/B bench scenario's fairlane arm as a discrete-event simulation.

``fairlane bench batch-flood`` runs real processes; this runs the same arm on the virtual
clock (``loadtests.des.run``), so the two can be compared (``loadtests.des.crosscheck``). By
construction both have the same requests (the bench's seeded generator,
``loadtests.bench.workload``), the same policy (its durations put back into simulated
seconds: ``policy_scale.rescale_policy`` by ``1 / speedup``), the same engines (the
simulators' flags read by the simulator's own parser, on ``priority`` scheduling) and the
same figures (the bench's ``RequestRecord`` and ``stats.arm_summary``: same windows,
percentiles and service shares). What the real arm has and this does not is its processes'
own time (Envoy, the ext_proc round trips, HTTP, the access log, the scrapes, the
simulators' CPU per step); at speedup 20 each wall millisecond of it is 20 simulated ones.
``WallCosts`` turns those wall times into the simulation's delays and a longer engine step.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from loadtests.bench.client import RequestRecord
from loadtests.bench.policy_scale import rescale_policy
from loadtests.bench.results import ArmSummary
from loadtests.bench.scenario import Group, Scenario, ScenarioError
from loadtests.bench.stats import arm_summary
from loadtests.bench.workload import (
    TEMPLATE_TOKENS,
    RequestShape,
    client_shapes,
    open_loop_schedule,
    prompt_text,
)
from loadtests.des.model import DesScenario, Fleet, Knobs
from loadtests.des.run import Flight, Simulation
from loadtests.des.workload import Ask, Client, OpenLoop
from loadtests.sim.cli import add_arguments, config_from_args
from loadtests.sim.engine import EngineConfig

ARM = "fairlane"
"""The arm simulated: the gateway in front of engines on ``priority``."""


@dataclass(frozen=True)
class WallCosts:
    """Wall seconds the real arm spends outside the engine model, each multiplied by the
    speedup into the simulation's delays. Defaults: what ``fairlane bench overhead``
    measures for the request path (Envoy + ext_proc: 1.2-1.5 ms p50 added to Envoy's own
    ~0.3 ms), Envoy's access log flushed every ``completion_flush_s`` (1 ms at x20) plus
    its gRPC, a scrape's render and parse."""

    forward_s: float = 0.0015
    """From the client's send (or a grant) to the engine having the request."""
    response_s: float = 0.0003
    """From the engine's token to the client reading it (Envoy relays it)."""
    feedback_s: float = 0.0015
    """From the last token to the completion in the gateway (access log + gRPC)."""
    scrape_s: float = 0.001
    """From a scrape's send to its record."""
    step_s: float = 0.0
    """Added to every engine step: the simulator's runner starts a step only after it has
    handed out the last one's tokens, so its CPU per step (HTTP chunks, the engine's
    Python) makes each real step that much longer. It depends on the machine's load, so
    ``crosscheck`` measures it from the real run's inter-token latency."""

    def knobs(self, speedup: float) -> Knobs:
        """The path's latencies in simulated seconds at ``speedup``."""
        return Knobs(
            scrape_delay_s=self.scrape_s * speedup,
            feedback_delay_s=self.feedback_s * speedup,
            forward_delay_s=self.forward_s * speedup,
            response_delay_s=self.response_s * speedup,
        )


def unsupported(scenario: Scenario) -> list[str]:
    """What of ``scenario`` the translation cannot carry (empty: it can run)."""
    problems = []
    if not any(a.kind == ARM for a in scenario.arms):
        problems.append("no fairlane arm")
    if scenario.backends.overrides:
        problems.append("per-backend overrides (backends.overrides)")
    if scenario.replicas > 1 or scenario.shared_state:
        problems.append("replicas / shared state")
    for group in scenario.groups:
        if group.shared_prefix is not None:
            problems.append(f"group {group.name}: shared_prefix conversations")
        if group.user is not None:
            problems.append(f"group {group.name}: a user header")
        if group.direct:
            problems.append(f"group {group.name}: sent straight to the backends (direct)")
    return problems


def engine_config(scenario: Scenario, step_s: float = 0.0) -> EngineConfig:
    """The engine the fairlane arm's simulators run: ``backends.flags`` read by the
    simulator's own parser, with the flags the harness sets (``arms.sim_argv``); every
    step ``step_s`` simulated seconds longer (``WallCosts.step_s``)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    argv = [
        "--profile",
        scenario.backends.profile,
        "--scheduling-policy",
        "priority",
        *scenario.backends.flags,
    ]
    config = config_from_args(parser.parse_args(argv)).engine_config()
    if step_s:
        profile = dataclasses.replace(config.profile, base_s=config.profile.base_s + step_s)
        config = dataclasses.replace(config, profile=profile)
    return config


def policy_file(scenario: Scenario, directory: Path) -> Path:
    """The scenario's policy in simulated seconds: a hand-written x20 file is in wall
    seconds (multiplied back by the speedup); ``policy: default`` already is in real, that
    is simulated, seconds."""
    directory.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load(scenario.policy.read_text(encoding="utf-8"))
    if not scenario.policy_rescaled:
        data = rescale_policy(data, 1.0 / scenario.speedup)
    path = directory / f"policy-{scenario.policy.stem}-simulated.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def ask(group: Group, shape: RequestShape, seed: int) -> Ask:
    """The bench's request ``shape`` as the simulation's ``Ask``: the same prompt words (its
    chat rendering is ``shape.prompt_tokens``), ``ignore_eos`` so exactly ``max_tokens``."""
    words = max(1, shape.prompt_tokens - TEMPLATE_TOKENS)
    return Ask(
        tenant=group.tenant,
        tier=group.tier,
        group=group.name,
        prompt=prompt_text(shape.prompt_tokens, seed, group.name, shape.client, shape.index),
        prompt_tokens=words,
        prefix_tokens=0,
        output_tokens=shape.max_tokens,
        max_tokens=shape.max_tokens,
        stream=group.stream,
        api_key=group.api_key,
    )


class BenchTraffic:
    """The arm's groups as ``Traffic``: open-loop groups' schedules merged in time order,
    one ``Client`` per closed-loop client, each with its own seeded request sequence."""

    def __init__(self, scenario: Scenario, groups: tuple[Group, ...]) -> None:
        self.scenario = scenario
        self.groups = groups
        arrivals = [
            (shape.at_s or 0.0, group, shape)
            for group in groups
            if not group.closed_loop
            for shape in open_loop_schedule(
                group, scenario.seed, scenario.duration_s, scenario.max_requests
            )
        ]
        arrivals.sort(key=lambda a: a[0])
        self._arrivals = iter(arrivals)
        self._next: Ask | None = None

    def next_arrival(self, t: float) -> float:
        for at_s, group, shape in self._arrivals:
            self._next = ask(group, shape, self.scenario.seed)
            return at_s
        return math.inf

    def open_ask(self) -> Ask:
        assert self._next is not None
        return self._next

    def clients(self, start_s: float) -> list[Client]:
        clients = []
        for group in self.groups:
            if not group.closed_loop:
                continue
            assert group.concurrency is not None
            stop = min(group.stop_s or self.scenario.duration_s, self.scenario.duration_s)
            for k in range(group.concurrency):
                shapes = client_shapes(group, self.scenario.seed, k)
                clients.append(
                    Client(
                        group.tenant,
                        _asker(group, shapes, self.scenario.seed),
                        max(group.start_s, start_s),
                        stop,
                        group.think_s,
                        group.think_s,  # the bench's client pauses alike after a failure
                    )
                )
        return clients


def _asker(group: Group, shapes: Iterator[RequestShape], seed: int) -> Callable[[], Ask]:
    return lambda: ask(group, next(shapes), seed)


def des_scenario(scenario: Scenario, knobs: Knobs) -> DesScenario:
    """The run's frame: the fleet, the window (sending stops at ``duration_s``, requests
    still running get ``drain_s`` more, as the bench's client waits), the cap."""
    return DesScenario(
        name=f"{scenario.name}-des",
        description=scenario.description,
        seed=scenario.seed,
        duration_s=scenario.duration_s + scenario.drain_s,
        warmup_s=scenario.warmup_s,
        max_requests=scenario.max_requests,
        fleet=Fleet(
            engines=scenario.backends.count,
            regions=1,
            profile=scenario.backends.profile,
            declare_seats=False,  # the bench's backends are URLs without #seats
        ),
        open_loop=OpenLoop(tenants=1, rate_per_s=0.0),  # unused: BenchTraffic plays
        closed_loops=(),
        knobs=knobs,
        path=scenario.path,
    )


def records(sim: Simulation, knobs: Knobs) -> list[RequestRecord]:
    """Every request the simulation sent, as the bench's client would have recorded it:
    what the client sees is ``response_delay_s`` after the engine; a request still running
    at the end is unfinished (the bench cancels it after the drain)."""
    out = []
    for index, flight in enumerate((*sim.flights.values(), *sim.live.values())):
        out.append(_record(flight, index, knobs.response_delay_s, sim.loop.now))
    return out


def _record(flight: Flight, index: int, delay: float, now: float) -> RequestRecord:
    ask_ = flight.ask
    record = RequestRecord(
        arm=f"{ARM}-des",
        group=ask_.group,
        tenant=ask_.tenant,
        tier=ask_.tier,
        index=index,
        client=0,
        start_s=flight.arrival,
        prompt_tokens_sent=ask_.prompt_tokens + TEMPLATE_TOKENS,
        max_tokens=ask_.max_tokens,
        stream=ask_.stream,
        status=flight.status,
    )
    if not flight.done:
        record.unfinished = True
        record.end_s = now
        return record
    assert flight.ended_at is not None
    record.end_s = flight.ended_at
    record.e2e_s = flight.ended_at - flight.arrival
    record.ok = flight.status == 200
    if record.ok:
        record.prompt_tokens = ask_.prompt_tokens + TEMPLATE_TOKENS
        record.completion_tokens = flight.output
        first = flight.first_at if ask_.stream else None
        record.ttft_s = record.e2e_s if first is None else first + delay - flight.arrival
    return record


def simulate_arm(
    scenario: Scenario, workdir: Path, costs: WallCosts | None = None
) -> tuple[list[RequestRecord], ArmSummary]:
    """Run ``scenario``'s fairlane arm on the virtual clock; its records and the bench's
    summary of them. ``costs``: the real stack's own time (default ``WallCosts()``)."""
    problems = unsupported(scenario)
    if problems:
        where = scenario.path or scenario.name
        raise ScenarioError(f"{where}: cannot run as a simulation: {'; '.join(problems)}")
    costs = costs or WallCosts()
    knobs = costs.knobs(scenario.speedup)
    arm = next(a for a in scenario.arms if a.kind == ARM)
    sim = Simulation(
        des_scenario(scenario, knobs),
        workdir,
        keep_flights=True,
        traffic=BenchTraffic(scenario, scenario.groups_of(arm)),
        policy_path=policy_file(scenario, workdir),
        engine=engine_config(scenario, costs.step_s * scenario.speedup),
    )
    sim.run()
    found = records(sim, knobs)
    return found, arm_summary(scenario, found)


def inter_token_s(records: Sequence[RequestRecord]) -> float | None:
    """The median time between a streamed answer's tokens (simulated seconds), over the
    successful streamed requests: how fast the engines stepped (None: none streamed)."""
    gaps = [
        (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)
        for r in records
        if r.ok and r.stream and r.e2e_s is not None and r.ttft_s is not None
        if r.completion_tokens > 1
    ]
    return statistics.median(gaps) if gaps else None
