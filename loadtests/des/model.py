"""A ``kind: des`` scenario file: the fleet, the tenants, the load and the models' knobs.

Read with the bench's located reader, so every mistake is ``FILE:LINE: field: message``
and the whole file is checked at once. Example: ``loadtests/scenarios/scale-smoke.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from loadtests.bench.scenario.document import Document
from loadtests.bench.scenario.fields import (
    Field,
    FieldReader,
    Section,
    choice,
    integer_at_least,
    non_negative,
    positive,
    read_whole,
    string,
    text,
)
from loadtests.des.workload import ClosedLoop, OpenLoop, Sizes
from loadtests.sim.profiles import PROFILES


@dataclass(frozen=True)
class Fleet:
    engines: int
    regions: int = 3
    profile: str = "llama-8b-l4"
    max_num_seqs: int = 16
    num_gpu_blocks: int = 2500
    declare_seats: bool = True
    """Tell the gateway each engine's seats (``#seats=N``), as a deployment file would."""
    models: int = 1
    """Models the fleet serves, each on its own block of engines (``/v1/models`` as read);
    requests are spread evenly over them."""


@dataclass(frozen=True)
class Knobs:
    """The parts that are models, not fairlane: how stale a scrape is, how late feedback."""

    scrape_interval_s: float | None = None
    """None: the policy's ``backpressure.scrape_interval_s``."""
    scrape_delay_s: float = 0.005
    """From a scrape's send to its record (the engine renders /metrics meanwhile)."""
    feedback_delay_s: float = 0.02
    """From a request's last token to its completion in the gateway (Envoy's access log)."""
    health_delay_s: float = 1.0
    """How long a dead engine still looks healthy (the health check's interval)."""
    forward_delay_s: float = 0.0
    """From the gateway's decision (or a grant) to the engine having the request: Envoy's
    and the ext_proc round trips' own time (0: the scale runs leave the transport out)."""
    response_delay_s: float = 0.0
    """From an engine's token to the client reading it (Envoy relaying it)."""


@dataclass(frozen=True)
class Outage:
    region: str
    at_s: float
    for_s: float


@dataclass(frozen=True)
class DesScenario:
    name: str
    description: str
    seed: int
    duration_s: float
    warmup_s: float
    max_requests: int
    fleet: Fleet
    open_loop: OpenLoop
    closed_loops: tuple[ClosedLoop, ...]
    knobs: Knobs = Knobs()
    outage: Outage | None = None
    sweep: tuple[tuple[int, int], ...] = ()
    """(engines, tenants) points of the decision-cost curve."""
    model_sweep: tuple[tuple[int, int], ...] = ()
    """(models, engines) points: the decision cost as one fleet becomes many pools, with
    the same load and tenants per engine, each run for ``duration_s`` (its request cap
    scaled with its engines, so that every point covers the same virtual time)."""
    cost_after_warmup: bool = False
    """Count the core's CPU from the end of the warm-up: the steady state, without the
    start's burst (closed loops all sending their first requests at once)."""
    sweep_requests: int = 20_000
    path: Path | None = None
    start_s: float = 0.0
    """Virtual time the run starts at (seconds from midnight of the diurnal day): a slice
    of ``scale-day`` from noon is ``start_s: 43200`` with a short ``duration_s``. The run
    covers ``[start_s, start_s + duration_s]``; the warm-up counts from ``start_s``."""

    def scaled(
        self, engines: int, tenants: int, max_requests: int, models: int | None = None
    ) -> DesScenario:
        """The same load per engine on ``engines`` engines with ``tenants`` tenants (and
        ``models`` models, when given)."""
        factor = engines / self.fleet.engines
        closed = tuple(
            replace(c, concurrency=max(1, round(c.concurrency * factor))) for c in self.closed_loops
        )
        return replace(
            self,
            name=f"{self.name}-{engines}x{tenants}",
            max_requests=max_requests,
            fleet=replace(
                self.fleet,
                engines=engines,
                regions=min(self.fleet.regions, engines),
                models=self.fleet.models if models is None else models,
            ),
            open_loop=replace(
                self.open_loop, tenants=tenants, rate_per_s=self.open_loop.rate_per_s * factor
            ),
            closed_loops=closed,
            outage=None,
            sweep=(),
            model_sweep=(),
            sweep_requests=0,
        )


TOP = (
    "kind",
    "name",
    "description",
    "seed",
    "duration_s",
    "warmup_s",
    "max_requests",
    "fleet",
    "open_loop",
    "closed_loops",
    "knobs",
    "outage",
    "sweep",
    "model_sweep",
    "cost_after_warmup",
    "sweep_requests",
    "start_s",
)


def parse_des(document: Document) -> DesScenario:
    """The scenario in ``document``; ``ScenarioError`` listing every problem."""
    return read_whole(document, lambda r, root: _read(r, root, document.path))


def _read(r: FieldReader, root: Field, path: Path) -> DesScenario | None:
    top = r.section(root, TOP)
    if top is None:
        return None
    count = integer_at_least(1)
    fleet = _fleet(r, top)
    open_loop = _open_loop(r, top)
    closed = _closed(r, top)
    knobs = _knobs(r, top)
    outage = _outage(r, top)
    sweep = _sweep(r, top)
    model_sweep = _pairs(r, top, "model_sweep", "[models, engines]")
    scenario = DesScenario(
        name=r.get(top, "name", string, "a string"),
        description=r.get(top, "description", text, "text", ""),
        seed=r.get(top, "seed", integer_at_least(0), "an integer >= 0", 1),
        duration_s=r.get(top, "duration_s", positive, "simulated seconds > 0"),
        warmup_s=r.get(top, "warmup_s", non_negative, "simulated seconds >= 0", 0.0),
        max_requests=r.get(top, "max_requests", count, "an integer >= 1"),
        fleet=fleet,  # type: ignore[arg-type]
        open_loop=open_loop,  # type: ignore[arg-type]
        closed_loops=closed,
        knobs=knobs,
        outage=outage,
        sweep=sweep,
        model_sweep=model_sweep,
        cost_after_warmup=r.get(top, "cost_after_warmup", _bool, "true or false", False),
        sweep_requests=r.get(top, "sweep_requests", count, "an integer >= 1", 20_000),
        path=path,
        start_s=r.get(top, "start_s", non_negative, "simulated seconds >= 0", 0.0),
    )
    if fleet is None or open_loop is None or r.errors:
        return None
    return scenario


def _fleet(r: FieldReader, top: Section) -> Fleet | None:
    field = top.get("fleet")
    allowed = (
        "engines",
        "regions",
        "profile",
        "max_num_seqs",
        "num_gpu_blocks",
        "declare_seats",
        "models",
    )
    s = r.section(field, allowed) if field is not None else None
    if s is None:
        r.error_in(top, "fleet", "required (a mapping with engines)") if field is None else None
        return None
    count = integer_at_least(1)
    return Fleet(
        engines=r.get(s, "engines", count, "an integer >= 1"),
        regions=r.get(s, "regions", count, "an integer >= 1", 3),
        profile=r.get(
            s, "profile", choice(*PROFILES), f"one of {', '.join(PROFILES)}", "llama-8b-l4"
        ),
        max_num_seqs=r.get(s, "max_num_seqs", count, "an integer >= 1", 16),
        num_gpu_blocks=r.get(s, "num_gpu_blocks", count, "an integer >= 1", 2500),
        declare_seats=r.get(s, "declare_seats", _bool, "true or false", True),
        models=r.get(s, "models", count, "an integer >= 1", 1),
    )


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _sizes(r: FieldReader, s: Section, default: Sizes) -> Sizes:
    def pair(key: str, low: int, high: int) -> tuple[int, int]:
        value = r.get(s, key, _range, "[min, max] integers with 1 <= min <= max", None)
        return value if value is not None else (low, high)

    prompt = pair("prompt_tokens", default.prompt_min, default.prompt_max)
    output = pair("output_tokens", default.output_min, default.output_max)
    return Sizes(prompt[0], prompt[1], output[0], output[1])


def _range(value: Any) -> tuple[int, int] | None:
    ok = (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and 1 <= value[0] <= value[1]
    )
    return (value[0], value[1]) if ok else None


def _open_loop(r: FieldReader, top: Section) -> OpenLoop | None:
    field = top.get("open_loop")
    allowed = (
        "tenants",
        "rate_per_s",
        "zipf_s",
        "chat_every",
        "amplitude",
        "day_s",
        "chat",
        "api",
        "stream_chat",
    )
    s = r.section(field, allowed) if field is not None else None
    if s is None:
        r.error_in(top, "open_loop", "required (a mapping with tenants)") if field is None else None
        return None
    base = OpenLoop(tenants=1, rate_per_s=0.0)
    sizes = {}
    for key, default in (("chat", base.chat), ("api", base.api)):
        sub = s.get(key)
        inner = r.section(sub, ("prompt_tokens", "output_tokens")) if sub is not None else None
        sizes[key] = _sizes(r, inner, default) if inner is not None else default
    return OpenLoop(
        tenants=r.get(s, "tenants", integer_at_least(1), "an integer >= 1"),
        rate_per_s=r.get(s, "rate_per_s", non_negative, "requests per second >= 0"),
        zipf_s=r.get(s, "zipf_s", non_negative, "a number >= 0", base.zipf_s),
        chat_every=r.get(s, "chat_every", integer_at_least(0), "an integer >= 0", base.chat_every),
        amplitude=r.get(s, "amplitude", _fraction, "a number in [0, 1)", 0.0),
        day_s=r.get(s, "day_s", positive, "seconds > 0", base.day_s),
        chat=sizes["chat"],
        api=sizes["api"],
        stream_chat=r.get(s, "stream_chat", _bool, "true or false", True),
    )


def _fraction(value: Any) -> float | None:
    number = non_negative(value)
    return number if number is not None and number < 1 else None


def _closed(r: FieldReader, top: Section) -> tuple[ClosedLoop, ...]:
    loops = []
    allowed = (
        "name",
        "tier",
        "count",
        "concurrency",
        "prompt_tokens",
        "output_tokens",
        "stream",
        "start_s",
        "stop_s",
    )
    for item in r.items(top.get("closed_loops")) or []:
        s = r.section(item, allowed)
        if s is None:
            continue
        start = r.get(s, "start_s", non_negative, "simulated seconds >= 0", 0.0)
        stop = r.get(s, "stop_s", positive, "simulated seconds > 0", None)
        if start is not None and stop is not None and stop <= start:
            r.error_in(s, "stop_s", f"must be after start_s ({start:g}), got {stop:g}")
        loops.append(
            ClosedLoop(
                name=r.get(s, "name", string, "a string"),
                tier=r.get(
                    s, "tier", choice("interactive", "api", "batch"), "a tier of the default policy"
                ),
                count=r.get(s, "count", integer_at_least(1), "an integer >= 1"),
                concurrency=r.get(s, "concurrency", integer_at_least(1), "an integer >= 1"),
                sizes=_sizes(r, s, Sizes(128, 512, 64, 256)),
                stream=r.get(s, "stream", _bool, "true or false", False),
                start_s=start,
                stop_s=stop,
            )
        )
    return tuple(loops)


def _knobs(r: FieldReader, top: Section) -> Knobs:
    field = top.get("knobs")
    if field is None:
        return Knobs()
    allowed = (
        "scrape_interval_s",
        "scrape_delay_s",
        "feedback_delay_s",
        "health_delay_s",
        "forward_delay_s",
        "response_delay_s",
    )
    s = r.section(field, allowed)
    if s is None:
        return Knobs()
    d = Knobs()
    return Knobs(
        scrape_interval_s=r.get(s, "scrape_interval_s", positive, "seconds > 0", None),
        scrape_delay_s=r.get(s, "scrape_delay_s", non_negative, "seconds >= 0", d.scrape_delay_s),
        feedback_delay_s=r.get(
            s, "feedback_delay_s", non_negative, "seconds >= 0", d.feedback_delay_s
        ),
        health_delay_s=r.get(s, "health_delay_s", non_negative, "seconds >= 0", d.health_delay_s),
        forward_delay_s=r.get(
            s, "forward_delay_s", non_negative, "seconds >= 0", d.forward_delay_s
        ),
        response_delay_s=r.get(
            s, "response_delay_s", non_negative, "seconds >= 0", d.response_delay_s
        ),
    )


def _outage(r: FieldReader, top: Section) -> Outage | None:
    field = top.get("outage")
    if field is None:
        return None
    s = r.section(field, ("region", "at_s", "for_s"))
    if s is None:
        return None
    return Outage(
        region=r.get(s, "region", string, "a region name (r0, r1, ...)"),
        at_s=r.get(s, "at_s", non_negative, "simulated seconds >= 0"),
        for_s=r.get(s, "for_s", positive, "simulated seconds > 0"),
    )


def _sweep(r: FieldReader, top: Section) -> tuple[tuple[int, int], ...]:
    return _pairs(r, top, "sweep", "[engines, tenants]")


def _pairs(r: FieldReader, top: Section, key: str, shape: str) -> tuple[tuple[int, int], ...]:
    points = []
    for item in r.items(top.get(key)) or []:
        value = r.value(item)
        ok = isinstance(value, list) and len(value) == 2
        if not ok or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value
        ):
            r.error(item, f"must be {shape} integers >= 1, got {value!r}")
            continue
        points.append((value[0], value[1]))
    return tuple(points)
