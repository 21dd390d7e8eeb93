"""Validating an A/B scenario file into a :class:`Scenario`, every mistake at once.

Each problem is reported as ``FILE:LINE: field.path: message`` (unknown fields are errors
too), so a typo never silently changes a benchmark; the groups' keys are checked against
the policy, so the fairlane arm never answers 401 to a workload the FIFO arm serves.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from loadtests.bench.scenario.document import Document, ScenarioError, read_document
from loadtests.bench.scenario.fields import (
    Field,
    FieldReader,
    Section,
    boolean,
    choice,
    integer_at_least,
    non_negative,
    number,
    positive,
    read_whole,
    string,
    string_list,
    text,
)
from loadtests.bench.scenario.groups import read_groups
from loadtests.bench.scenario.model import (
    ARM_KINDS,
    ARM_METRICS,
    ENVOY_ONLY_KINDS,
    METRICS,
    PREFIX_INDEXES,
    RESERVED_ENGINE_FLAGS,
    RESERVED_SIM_FLAGS,
    Arm,
    Backends,
    EngineSetup,
    Group,
    Scenario,
    Target,
)
from loadtests.bench.scenario.policy import is_default_policy, read_policy

SCENARIO_FIELDS = (
    "kind",
    "name",
    "description",
    "seed",
    "duration_s",
    "warmup_s",
    "drain_s",
    "speedup",
    "max_requests",
    "model",
    "backends",
    "engine",
    "policy",
    "groups",
    "arms",
    "targets",
)
TARGET_FIELDS = (
    "name",
    "metric",
    "arm",
    "baseline_arm",
    "tier",
    "tenant",
    "group",
    "tenants",
    "max",
    "min",
    "either",
    "baseline_metric",
    "allowance_s",
)


def load_scenario(name_or_path: str | Path) -> Scenario:
    document = read_document(name_or_path)
    if document.kind != "ab":
        raise ScenarioError(
            f"{document.path}: kind {document.kind!r}: not an A/B scenario (run it with "
            "`fairlane bench`)"
        )
    return parse_document(document)


def parse_scenario(data: Any, path: Path) -> Scenario:
    """Validate scenario data built in code (errors name ``path`` without lines)."""
    return parse_document(Document(path, data))


def parse_document(document: Document) -> Scenario:
    """Validate the whole document; raise one :class:`ScenarioError` listing every problem."""
    return read_whole(document, _read_scenario)


def _read_scenario(reader: FieldReader, root: Field) -> Scenario | None:
    top = reader.section(root, SCENARIO_FIELDS)
    if top is None:
        return None
    reader.get(top, "kind", choice("ab", "overhead"), "ab or overhead", "ab")
    name = reader.get(top, "name", text, "a non-empty string")
    description = reader.get(top, "description", string, "a string", "")
    seed = reader.get(top, "seed", integer_at_least(0), "an integer >= 0", 0)
    duration = reader.get(top, "duration_s", positive, "simulated seconds > 0")
    warmup = reader.get(top, "warmup_s", non_negative, "simulated seconds >= 0", 0.0)
    drain = reader.get(top, "drain_s", non_negative, "simulated seconds >= 0", 30.0)
    speedup = reader.get(top, "speedup", positive, "a number > 0")
    max_requests = reader.get(top, "max_requests", integer_at_least(1), "an integer >= 1", 20_000)
    model = reader.get(top, "model", text, "a non-empty string", "sim-llama-8b")
    before_fleet = len(reader.errors)
    backends = _read_backends(reader, top)
    fleet_read = len(reader.errors) == before_fleet
    engine = _read_engine(reader, top)
    policy = read_policy(reader, top, speedup)
    policy_field = top.get("policy")
    rescaled = policy_field is not None and is_default_policy(reader.value(policy_field))
    groups = read_groups(reader, top)
    _check_keys_in_policy(reader, policy, groups)
    if fleet_read and model is not None:
        _check_models_served(reader, backends, model, groups)
    arms = _read_arms(reader, top, {g.name for g, _ in groups})
    targets = _read_targets(reader, top, [g for g, _ in groups], arms)
    if duration is not None and warmup is not None and warmup >= duration:
        reader.error_in(top, "warmup_s", f"must be below duration_s ({duration:g})")
    if reader.errors:
        return None
    return Scenario(
        name=name,
        description=description,
        duration_s=duration,
        speedup=speedup,
        backends=backends,
        policy=policy,
        groups=tuple(g for g, _ in groups),
        arms=arms,
        targets=targets,
        seed=seed,
        warmup_s=warmup,
        drain_s=drain,
        max_requests=max_requests,
        model=model,
        path=reader.path,
        policy_rescaled=rescaled,
        engine=engine,
    )


# --------------------------------------------------------------------------- the fleet


def _read_backends(reader: FieldReader, top: Section) -> Backends:
    field = top.get("backends")
    if field is None:
        return Backends()
    raw = reader.section(field, ("count", "profile", "flags", "overrides", "models"))
    if raw is None:
        return Backends()
    count = reader.get(raw, "count", integer_at_least(1), "an integer >= 1", 1)
    profile = reader.get(raw, "profile", text, "a simulator profile", "llama-8b-h100")
    flags = reader.get(raw, "flags", string_list, "a list of strings", [])
    if profile is not None:
        from loadtests.sim.profiles import PROFILES

        if profile not in PROFILES:
            reader.error_in(raw, "profile", f"unknown profile {profile!r} ({sorted(PROFILES)})")
    for flag in flags or []:
        if flag.split("=", 1)[0] in RESERVED_SIM_FLAGS:
            reader.error_in(raw, "flags", f"{flag} {_reserved_hint(flag)}")
    overrides = _read_overrides(reader, raw.get("overrides"), count or 1)
    models = _read_models(reader, raw.get("models"), count or 1)
    return Backends(count or 1, profile or "", tuple(flags or ()), overrides, models)


def _read_engine(reader: FieldReader, top: Section) -> EngineSetup | None:
    """``engine``: the real engines ``--engine`` starts (count, flags, env, kv_events)."""
    field = top.get("engine")
    if field is None or reader.value(field) is None:
        return None
    raw = reader.section(field, ("count", "flags", "env", "kv_events"))
    if raw is None:
        return None
    count = reader.get(raw, "count", integer_at_least(1), "an integer >= 1", 1)
    flags = reader.get(raw, "flags", string_list, "a list of strings", [])
    env = reader.get(raw, "env", _string_map, "a mapping of names to strings", {})
    kv_events = reader.get(raw, "kv_events", boolean, "true or false", False)
    for flag in flags or []:
        if flag.split("=", 1)[0] in RESERVED_ENGINE_FLAGS:
            reader.error_in(raw, "flags", f"{flag} is set by the harness for each engine")
    if count is None or flags is None or env is None or kv_events is None:
        return None
    return EngineSetup(count, tuple(flags), tuple(sorted(env.items())), kv_events)


def _string_map(value: Any) -> dict[str, str] | None:
    if isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        return value
    return None


def _reserved_hint(flag: str) -> str:
    """Why a harness flag may not be given, and what to write instead."""
    if flag.split("=", 1)[0] in ("--model", "--served-model-name"):
        return "is set by the harness; name the models with model or backends.models"
    return "is set by the harness per arm; use the scenario field"


def _read_models(
    reader: FieldReader, field: Field | None, count: int
) -> tuple[tuple[str, ...], ...]:
    """``[NAME or [NAME, ...], ...]``: what each backend serves, one entry per backend in
    order (several names: its ``--served-model-name`` aliases, the first its ``--model``)."""
    if field is None or reader.value(field) is None:
        return ()
    items = reader.items(field)
    if items is None:
        value = reader.value(field)
        reader.error(field, f"must be a list: one model name per backend, got {value!r}")
        return ()
    if len(items) != count:
        reader.error(
            field, f"must name the model of each of the {count} backends (count), got {len(items)}"
        )
    models: list[tuple[str, ...]] = []
    for item in items:
        value = reader.value(item)
        names = [value] if isinstance(value, str) else value
        if not names or string_list(names) is None or not all(n.strip() for n in names):
            reader.error(item, f"must be a model name or a list of names, got {value!r}")
        elif len(set(names)) < len(names):
            reader.error(item, f"names a model twice: {value!r}")
        else:
            models.append(tuple(names))
    return tuple(models) if len(models) == count else ()


def _check_models_served(
    reader: FieldReader, backends: Backends, default: str, groups: Sequence[tuple[Group, Section]]
) -> None:
    """Each group's model must be one a backend answers to (a name it serves, or an adapter
    its ``--lora-modules`` load), or every request of the group would be a 404 in every
    arm and there would be nothing to compare."""
    served: set[str] = set()
    for index in range(backends.count):
        served.update(backends.names_of(index, default))
        served.update(_adapters(backends.flags_of(index)))
    known = ", ".join(sorted(served))
    for group, section in groups:
        model = group.model or default
        if model in served:
            continue
        if group.model:
            message = f"{model!r}: no backend serves it (they serve {known})"
            reader.error_in(section, "model", message)
        else:
            reader.error_in(
                section,
                "model",
                f"the scenario's model {model!r}: no backend serves it (they serve {known}); "
                "name one here or serve it in backends.models",
            )


def _read_overrides(
    reader: FieldReader, field: Field | None, count: int
) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """``{index: [flags]}``: each index a backend of the fleet, each flag list one the
    simulator accepts (checked with its own parser, so a typo fails here, not in the
    middle of a run), and no flag the harness sets per arm except ``--profile``."""
    if field is None or reader.value(field) is None:
        return ()
    pairs = reader.pairs(field)
    if pairs is None:
        data = reader.value(field)
        reader.error(field, f"must be a mapping of backend index to flags, got {data!r}")
        return ()
    result: list[tuple[int, tuple[str, ...]]] = []
    for key, item in pairs:
        problem = _override_problem(key, reader.value(item), count)
        if problem:
            reader.error(item, problem)
        else:
            result.append((key, tuple(reader.value(item))))
    return tuple(sorted(result))


def _override_problem(key: Any, flags: Any, count: int) -> str | None:
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < count:
        return f"must be a backend index in [0, {count - 1}]"
    if string_list(flags) is None or not flags:
        return f"must be a non-empty list of strings, got {flags!r}"
    bad = [
        f
        for f in flags
        if f.split("=", 1)[0] in RESERVED_SIM_FLAGS and f.split("=", 1)[0] != "--profile"
    ]
    if bad:
        return f"{', '.join(bad)} {_reserved_hint(bad[0])}"
    return _sim_flags_problem(flags)


def _sim_flags_problem(flags: Sequence[str]) -> str | None:
    """Why ``fairlane sim`` would refuse ``flags`` (None if it accepts them)."""
    parsed = _sim_args(flags)
    return parsed if isinstance(parsed, str) else None


def _sim_args(flags: Sequence[str]) -> argparse.Namespace | str:
    """``flags`` as ``fairlane sim``'s own parser reads them, or why it refuses them."""
    import contextlib
    import io

    from loadtests.sim.cli import add_arguments

    parser = argparse.ArgumentParser(prog="fairlane sim", exit_on_error=False)
    add_arguments(parser)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_args(list(flags))
    except (argparse.ArgumentError, SystemExit) as exc:
        return f"fairlane sim refuses {' '.join(flags)}: {exc or stderr.getvalue().strip()}"


def _adapters(flags: Sequence[str]) -> list[str]:
    """The LoRA adapters ``flags`` load at start-up (``--lora-modules``; none when the
    simulator would refuse the flags, which is reported where they are given)."""
    parsed = _sim_args(flags)
    if isinstance(parsed, str):
        return []
    return [module.name for module in parsed.lora_modules or ()]


def _check_keys_in_policy(
    reader: FieldReader, path: Path, groups: Sequence[tuple[Group, Section]]
) -> None:
    """Each group's key must name its tenant in the policy, or the fairlane arm would
    answer 401 (or bill another tenant) and the A/B would compare different workloads."""
    if reader.errors or not path.is_file():
        return
    from extproc.policy import load_policy

    policy = load_policy(path)
    for group, section in groups:
        tenant = policy.tenant_for_key(group.api_key)
        if tenant is None:
            reader.error_in(section, "api_key", f"{group.api_key!r} is not a key in {path}")
        elif tenant.name != group.tenant:
            reader.error_in(
                section,
                "tenant",
                f"{group.tenant!r}, but {path} maps its key to tenant {tenant.name!r}",
            )


# --------------------------------------------------------------------------- arms, targets


def _read_arms(reader: FieldReader, top: Section, group_names: set[str]) -> tuple[Arm, ...]:
    items = reader.items(top.get("arms"))
    if not items:
        reader.error_in(top, "arms", "required: a list of arms (at least fifo and fairlane)")
        return ()
    arms: list[Arm] = []
    for item in items:
        raw = reader.section(item, ("name", "kind", "drop_groups", "balanced", "prefix_index"))
        if raw is None:
            continue
        name = reader.get(raw, "name", text, "a non-empty string")
        kind = reader.get(raw, "kind", choice(*ARM_KINDS), " or ".join(ARM_KINDS))
        balanced = reader.get(raw, "balanced", boolean, "true or false", False)
        prefix = reader.get(
            raw, "prefix_index", choice(*PREFIX_INDEXES), " or ".join(PREFIX_INDEXES), "approximate"
        )
        if prefix == "precise" and kind != "fairlane":
            reader.error_in(raw, "prefix_index", "precise needs a fairlane arm (its picker)")
        drop = reader.get(raw, "drop_groups", string_list, "a list of group names", [])
        for g in drop or []:
            if g not in group_names:
                reader.error_in(raw, "drop_groups", f"unknown group {g!r}")
        if drop is not None and group_names and set(drop) >= group_names:
            reader.error_in(raw, "drop_groups", "drops every group")
        if name in {a.name for a in arms}:
            reader.error_in(raw, "name", f"duplicate arm name {name!r}")
        if name and kind:
            arms.append(Arm(name, kind, tuple(drop or ()), bool(balanced), prefix or "approximate"))
    kinds = {a.kind for a in arms}
    if arms and not ("fairlane" in kinds and kinds & set(ENVOY_ONLY_KINDS)):
        reader.error_in(
            top,
            "arms",
            "needs at least one fairlane arm and one Envoy-only arm "
            f"({', '.join(ENVOY_ONLY_KINDS)}): the A/B",
        )
    return tuple(arms)


def _read_targets(
    reader: FieldReader, top: Section, groups: Sequence[Group], arms: Sequence[Arm]
) -> tuple[Target, ...]:
    field = top.get("targets")
    items = [] if field is None else reader.items(field)
    if items is None:
        reader.error_in(top, "targets", "must be a list")
        return ()
    known = _Known(groups, arms)
    read = [r for item in items if (r := _read_target(reader, item, known)) is not None]
    # An either label names a set of alternatives: one target alone under a label is a typo
    # in the other's label, or a requirement that silently lost its alternative.
    # (counted over every target, valid or not: a broken alternative has its own error)
    raw_labels = (v.get("either") for item in items if isinstance(v := reader.value(item), dict))
    labels = Counter(label for label in raw_labels if isinstance(label, str))
    for target, raw in read:
        if target.either is not None and labels[target.either] == 1:
            alone = f"{target.either!r}: no other target has it (alternatives: two or more)"
            reader.error_in(raw, "either", alone)
    return tuple(t for t, _ in read)


class _Known:
    """What a target may name: the scenario's arms, tiers, tenants and groups."""

    def __init__(self, groups: Sequence[Group], arms: Sequence[Arm]) -> None:
        self.arms = {a.name for a in arms}
        self.tiers = {g.tier for g in groups}
        self.tenants = {g.tenant for g in groups}
        self.groups = {g.name for g in groups}


def _read_target(reader: FieldReader, item: Field, known: _Known) -> tuple[Target, Section] | None:
    raw = reader.section(item, TARGET_FIELDS)
    if raw is None:
        return None
    before = len(reader.errors)
    name = reader.get(raw, "name", text, "a non-empty string")
    metric = reader.get(raw, "metric", choice(*METRICS), f"one of {METRICS}")
    arm = reader.get(raw, "arm", text, "an arm name")
    baseline = reader.get(raw, "baseline_arm", text, "an arm name", None)
    for key, value in (("arm", arm), ("baseline_arm", baseline)):
        if value is not None and known.arms and value not in known.arms:
            reader.error_in(raw, key, f"unknown arm {value!r}")
    selectors = _selectors(reader, raw)
    tenants = reader.get(raw, "tenants", string_list, "a list of tenants", [])
    _check_scope(reader, raw, metric, selectors, tenants or [], known)
    if ("max" in raw) == ("min" in raw):
        reader.error(item, "needs exactly one bound: max (<=) or min (>=)")
        return None
    op: Literal["max", "min"] = "max" if "max" in raw else "min"
    bound = reader.get(raw, op, number, "a number")
    either = reader.get(raw, "either", text, "a label shared with the alternative targets", None)
    baseline_metric = reader.get(
        raw, "baseline_metric", choice(*METRICS), f"one of {METRICS}", None
    )
    allowance = reader.get(raw, "allowance_s", non_negative, "seconds >= 0", 0.0)
    if (baseline_metric is not None or allowance) and baseline is None:
        reader.error_in(raw, "baseline_arm", "is required with baseline_metric or allowance_s")
    if len(reader.errors) > before:
        return None
    target = Target(
        name=name,
        metric=metric,
        arm=arm,
        bound=float(bound),
        op=op,
        tier=selectors.get("tier"),
        tenant=selectors.get("tenant"),
        group=selectors.get("group"),
        tenants=tuple(tenants or ()),
        baseline_arm=baseline,
        either=either,
        baseline_metric=baseline_metric,
        allowance_s=float(allowance),
    )
    return target, raw


def _selectors(reader: FieldReader, raw: Section) -> dict[str, Any]:
    """The target's tier, tenant or group: what it is measured over."""
    selectors = {}
    for key in ("tier", "tenant", "group"):
        field = raw.get(key)
        if field is not None and (value := reader.value(field)) is not None:
            selectors[key] = value
    return selectors


def _check_scope(
    reader: FieldReader,
    raw: Section,
    metric: str | None,
    selectors: dict[str, Any],
    tenants: list[str],
    known: _Known,
) -> None:
    """A target is measured over exactly one known tier, tenant or group; Jain's index over
    two or more known tenants; a fleet metric over the whole arm."""
    if metric == "jain":
        if selectors or len(tenants) < 2:
            reader.error(raw.place, "jain takes `tenants: [two or more]` and no tier/tenant/group")
    elif metric in ARM_METRICS:
        if selectors or tenants:
            reader.error(raw.place, f"{metric} is measured over the whole fleet: no selector")
    elif metric is not None and len(selectors) != 1:
        reader.error(raw.place, "needs exactly one of tier, tenant, group")
    for key, names in (("tier", known.tiers), ("tenant", known.tenants), ("group", known.groups)):
        if key in selectors and selectors[key] not in names:
            reader.error_in(raw, key, f"unknown {key} {selectors[key]!r}")
    for t in tenants:
        if t not in known.tenants:
            reader.error_in(raw, "tenants", f"unknown tenant {t!r}")
