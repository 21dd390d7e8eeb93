"""Reading a scenario's client groups: who sends what, how often, in what shape.

Each group is one population of clients (a key, a tenant, a tier, a request shape, open or
closed loop); its token counts are distributions sampled with the scenario's seed.
"""

from __future__ import annotations

from loadtests.bench.scenario.fields import (
    Field,
    FieldReader,
    Section,
    boolean,
    choice,
    integer_at_least,
    non_negative,
    positive,
    text,
)
from loadtests.bench.scenario.model import Dist, Group, SharedPrefix

GROUP_FIELDS = (
    "name",
    "api_key",
    "tenant",
    "tier",
    "rate",
    "concurrency",
    "think_s",
    "prompt_tokens",
    "max_tokens",
    "stream",
    "start_s",
    "stop_s",
    "user",
    "user_header",
    "shared_prefix",
    "direct",
    "model",
)
DIST_FIELDS = ("dist", "value", "min", "max", "median", "sigma")
SHARED_PREFIX_FIELDS = ("system_prompts", "system_tokens", "turns")


def read_groups(reader: FieldReader, top: Section) -> list[tuple[Group, Section]]:
    """Every valid group, with its section (later checks point at its fields' lines)."""
    items = reader.items(top.get("groups"))
    if not items:
        reader.error_in(top, "groups", "required: a non-empty list of client groups")
        return []
    groups: list[tuple[Group, Section]] = []
    for item in items:
        read = read_group(reader, item)
        if read is None:
            continue
        group, section = read
        if group.name in {g.name for g, _ in groups}:
            reader.error_in(section, "name", f"duplicate group name {group.name!r}")
        groups.append((group, section))
    return groups


def read_group(reader: FieldReader, field: Field) -> tuple[Group, Section] | None:
    raw = reader.section(field, GROUP_FIELDS)
    if raw is None:
        return None
    errors_before = len(reader.errors)
    name = reader.get(raw, "name", text, "a non-empty string")
    api_key = reader.get(raw, "api_key", text, "the API key to send")
    tenant = reader.get(raw, "tenant", text, "the tenant name (for the report)")
    tier = reader.get(raw, "tier", text, "the tier label (for the report)")
    rate = reader.get(raw, "rate", positive, "requests per simulated second > 0", None)
    concurrency = reader.get(raw, "concurrency", integer_at_least(1), "an integer >= 1", None)
    has_rate = _present(reader, raw, "rate")
    if has_rate == _present(reader, raw, "concurrency"):
        reader.error(
            raw.place, "needs exactly one of rate (open loop) or concurrency (closed loop)"
        )
    think = reader.get(raw, "think_s", non_negative, "simulated seconds >= 0", 0.0)
    prompt = _required_dist(reader, raw, "prompt_tokens", "a token count or a distribution")
    max_tokens = _required_dist(reader, raw, "max_tokens", "a token count or a distribution")
    stream = reader.get(raw, "stream", boolean, "true or false", True)
    start = reader.get(raw, "start_s", non_negative, "simulated seconds >= 0", 0.0)
    stop = reader.get(raw, "stop_s", positive, "simulated seconds > 0", None)
    if start is not None and stop is not None and stop <= start:
        reader.error_in(raw, "stop_s", f"must be after start_s ({start:g})")
    user = reader.get(raw, "user", text, "a non-empty string", None)
    user_header = reader.get(raw, "user_header", text, "a header name", "x-user-id")
    shared = _shared_prefix(reader, raw, has_rate)
    direct = reader.get(raw, "direct", boolean, "true or false", False)
    model = reader.get(raw, "model", text, "a model name", None)
    if len(reader.errors) > errors_before:
        return None
    assert prompt is not None and max_tokens is not None
    group = Group(
        name=name,
        api_key=api_key,
        tenant=tenant,
        tier=tier,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        rate=rate,
        concurrency=concurrency,
        think_s=think,
        stream=stream,
        start_s=start,
        stop_s=stop,
        user=user,
        user_header=user_header.lower(),
        shared_prefix=shared,
        direct=direct,
        model=model,
    )
    return group, raw


def _present(reader: FieldReader, raw: Section, key: str) -> bool:
    """Set and not null (``rate: null`` is as good as no rate)."""
    field = raw.get(key)
    return field is not None and reader.value(field) is not None


def _shared_prefix(reader: FieldReader, raw: Section, has_rate: bool) -> SharedPrefix | None:
    field = raw.get("shared_prefix")
    if field is None or reader.value(field) is None:
        return None
    shared = read_shared_prefix(reader, field)
    if has_rate:
        reader.error(
            field, "needs a closed-loop group (concurrency): a turn follows the last answer"
        )
    return shared


def read_shared_prefix(reader: FieldReader, field: Field) -> SharedPrefix | None:
    raw = reader.section(field, SHARED_PREFIX_FIELDS)
    if raw is None:
        return None
    count = reader.get(raw, "system_prompts", integer_at_least(1), "an integer >= 1")
    system = _required_dist(reader, raw, "system_tokens", "a token count or a distribution")
    turns = _required_dist(reader, raw, "turns", "a count or a distribution")
    if count is None or system is None or turns is None:
        return None
    return SharedPrefix(count, system, turns)


def read_dist(reader: FieldReader, field: Field) -> Dist | None:
    """A token count: a fixed integer, or ``{dist: fixed|uniform|lognormal, ...}``."""
    data = reader.value(field)
    if isinstance(data, int) and not isinstance(data, bool):
        if data < 1:
            reader.error(field, f"must be >= 1, got {data}")
            return None
        return Dist("fixed", value=data)
    raw = reader.section(field, DIST_FIELDS)
    if raw is None:
        return None
    kind = reader.get(
        raw, "dist", choice("fixed", "uniform", "lognormal"), "fixed, uniform or lognormal"
    )
    if kind == "fixed":
        value = reader.get(raw, "value", integer_at_least(1), "an integer >= 1")
        return Dist("fixed", value=value) if value else None
    low = reader.get(raw, "min", integer_at_least(1), "an integer >= 1", 1)
    high = reader.get(raw, "max", integer_at_least(1), "an integer >= 1")
    if low is not None and high is not None and high < low:
        reader.error_in(raw, "max", f"must be >= min ({low})")
    if kind == "uniform":
        return Dist("uniform", low=low or 1, high=high or 1)
    if kind == "lognormal":
        median = reader.get(raw, "median", positive, "a number > 0")
        sigma = reader.get(raw, "sigma", non_negative, "a number >= 0", 0.5)
        return Dist(
            "lognormal", low=low or 1, high=high or 1, median=median or 1.0, sigma=sigma or 0.0
        )
    return None


def _required_dist(reader: FieldReader, raw: Section, key: str, what: str) -> Dist | None:
    field = raw.get(key)
    if field is None:
        reader.error_in(raw, key, f"required ({what})")
        return None
    return read_dist(reader, field)
