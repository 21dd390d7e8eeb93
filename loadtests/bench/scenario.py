"""The scenario file: what load to send, to which fleet, which arms to compare, what to check.

A scenario is data, not code, so the A/B comparison is reproducible and reviewable: the same
file (and seed) gives the same workload to every arm. Validation reads the whole file and
reports every mistake as ``FILE:LINE: field.path: message`` so a typo never silently changes a
benchmark (unknown fields are errors too).

Times in a scenario are **simulated seconds** (the simulators run ``speedup`` times faster
than the wall clock); the policy file it names is read by the gateway in wall-clock seconds
(see ``loadtests/bench/README.md``), except ``policy: default``: fairlane's shipped default
policy with its durations divided by the speedup (:mod:`loadtests.bench.policy_scale`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "scenarios"

ArmKind = Literal["fifo", "least-request", "random", "fairlane"]
# Arms without the gateway: a plain Envoy straight to the simulators, with this lb policy.
ENVOY_ONLY_KINDS: tuple[str, ...] = ("fifo", "least-request", "random")
ARM_KINDS: tuple[str, ...] = (*ENVOY_ONLY_KINDS, "fairlane")
DistKind = Literal["fixed", "uniform", "lognormal"]
# Metrics a target may check; see report.metric_value for their definitions.
LATENCY_METRICS = (
    "ttft_p50",
    "ttft_p90",
    "ttft_p95",
    "ttft_p99",
    "e2e_p50",
    "e2e_p90",
    "e2e_p95",
    "e2e_p99",
    "wait_max",
    "queue_wait_max",
    "queue_wait_p99",
)
# ``throughput``: completed requests per simulated second (goodput is output tokens/s).
METRICS = (*LATENCY_METRICS, "goodput", "throughput", "share", "jain", "prefix_hit_rate")
# Metrics of the whole arm (the fleet), not of a tier, tenant or group: they take no selector.
ARM_METRICS = ("prefix_hit_rate",)
# Flags the harness sets itself, per arm; a scenario setting them would break the A/B.
# ``--profile`` alone may be overridden per backend (``backends.overrides``): a slower GPU.
RESERVED_SIM_FLAGS = (
    "--port",
    "--host",
    "--speedup",
    "--profile",
    "--scheduling-policy",
    "--model",
    "--served-model-name",
)


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message names the file and every bad field."""


@dataclass(frozen=True)
class Dist:
    """A token-count distribution, sampled with the scenario's seeded generator."""

    kind: DistKind = "fixed"
    value: int = 0
    low: int = 1
    high: int = 1
    median: float = 0.0
    sigma: float = 0.0

    @property
    def upper_bound(self) -> int:
        return self.value if self.kind == "fixed" else self.high


@dataclass(frozen=True)
class SharedPrefix:
    """Chat conversations that share prefixes, as in a real assistant fleet.

    Every conversation starts with one of ``system_prompts`` long system prompts (chosen
    uniformly, seeded) and runs ``turns`` turns; each turn re-sends the whole history (the
    system prompt, earlier user messages and answers) plus a new user message of the
    group's ``prompt_tokens``, and asks for ``max_tokens``. Requests therefore share
    prefix-cache blocks twice over: the system prompt across conversations, the history
    across turns. Only closed-loop groups (a client sends turn k+1 after turn k's answer).
    """

    system_prompts: int
    system_tokens: Dist
    turns: Dist


@dataclass(frozen=True)
class Group:
    """One population of clients sharing a key, a tier and a request shape."""

    name: str
    api_key: str
    tenant: str
    tier: str
    prompt_tokens: Dist
    max_tokens: Dist
    rate: float | None = None
    """Open loop: Poisson arrivals per simulated second."""
    concurrency: int | None = None
    """Closed loop: this many clients, each sending its next request when the last ends."""
    think_s: float = 0.0
    """Closed loop: simulated pause between a client's requests."""
    stream: bool = True
    start_s: float = 0.0
    stop_s: float | None = None
    user: str | None = None
    """Sent in ``user_header`` (fairness and priority per end user in the gateway)."""
    user_header: str = "x-user-id"
    shared_prefix: SharedPrefix | None = None
    """Multi-turn conversations over shared system prompts (else one random-word message)."""

    @property
    def closed_loop(self) -> bool:
        return self.concurrency is not None


@dataclass(frozen=True)
class Backends:
    count: int = 1
    profile: str = "llama-8b-h100"
    flags: tuple[str, ...] = ()
    overrides: tuple[tuple[int, tuple[str, ...]], ...] = ()
    """(backend index, extra flags) for an unbalanced fleet: appended after ``flags`` and
    the harness's own (the simulator's parser keeps the last value), e.g. a slower
    ``--profile`` or a tiny ``--num-gpu-blocks`` on backend 0. Arms with ``balanced: true``
    leave them out."""

    def flags_of(self, index: int, balanced: bool = False) -> tuple[str, ...]:
        """Scenario flags for backend ``index`` (its override last, unless ``balanced``)."""
        extra = () if balanced else dict(self.overrides).get(index, ())
        return (*self.flags, *extra)


@dataclass(frozen=True)
class Arm:
    name: str
    kind: ArmKind
    drop_groups: tuple[str, ...] = ()
    balanced: bool = False
    """Run every backend with the common flags only (the baseline of an unbalanced fleet)."""


@dataclass(frozen=True)
class Target:
    """One check on the results: ``metric`` of ``arm`` (over a tier, tenant or group; or the
    Jain index over ``tenants``), optionally divided by the same metric of ``baseline_arm``,
    compared with ``max`` (≤) or ``min`` (≥)."""

    name: str
    metric: str
    arm: str
    bound: float
    op: Literal["max", "min"]
    tier: str | None = None
    tenant: str | None = None
    group: str | None = None
    tenants: tuple[str, ...] = ()
    baseline_arm: str | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    duration_s: float
    speedup: float
    backends: Backends
    policy: Path
    """The fairlane arms' policy file; for ``policy: default`` the shipped default, which the
    gateway reads rescaled (``policy_rescaled``)."""
    groups: tuple[Group, ...]
    arms: tuple[Arm, ...]
    targets: tuple[Target, ...] = ()
    seed: int = 0
    warmup_s: float = 0.0
    """Simulated seconds at the start whose requests are left out of the statistics."""
    drain_s: float = 30.0
    """Simulated seconds to let running requests finish after ``duration_s``; then cancel."""
    max_requests: int = 20_000
    """Cap on requests per arm, whatever the rates say (a bounded run)."""
    model: str = "sim-llama-8b"
    path: Path | None = None
    policy_rescaled: bool = False
    """``policy: default``: the gateway reads ``policy`` with every duration divided by the
    run's ``speedup``, so the shipped policy means on the simulated fleet what it means on
    real engines, at whatever ``--speedup`` the run uses."""

    @property
    def wall_duration_s(self) -> float:
        return self.duration_s / self.speedup

    @property
    def policy_scale(self) -> float | None:
        """What the policy's durations are divided by (None: the file is used as written)."""
        return self.speedup if self.policy_rescaled else None

    def policy_file(self, directory: Path) -> Path:
        """The file ``fairlane serve --policy`` reads: ``policy`` itself, or for
        ``policy: default`` its rescaled copy, written into ``directory`` (a run's output)."""
        if not self.policy_rescaled:
            return self.policy
        from loadtests.bench.policy_scale import write_scaled_policy

        return write_scaled_policy(self.policy, self.speedup, directory)

    def group(self, name: str) -> Group:
        return next(g for g in self.groups if g.name == name)

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)

    def groups_of(self, arm: Arm) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if g.name not in arm.drop_groups)

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(g.tier for g in self.groups))

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(g.tenant for g in self.groups))

    def with_overrides(
        self,
        duration_s: float | None = None,
        speedup: float | None = None,
        arms: Sequence[str] | None = None,
        model: str | None = None,
    ) -> Scenario:
        """A copy with command-line overrides applied (and checked)."""
        where = str(self.path or self.name)
        changes: dict[str, Any] = {}
        if duration_s is not None:
            if not duration_s > 0:
                raise ScenarioError(f"{where}: --duration must be > 0, got {duration_s}")
            changes["duration_s"] = duration_s
            changes["warmup_s"] = min(self.warmup_s, duration_s / 4)
        if speedup is not None:
            if not (speedup > 0 and math.isfinite(speedup)):
                raise ScenarioError(f"{where}: --speedup must be > 0, got {speedup}")
            changes["speedup"] = speedup
            if self.policy_rescaled:
                # The default policy follows the new speedup; check it still holds there.
                problems = rescaled_policy_errors(self.policy, speedup)
                if problems:
                    raise ScenarioError(
                        f"{where}: --speedup {speedup:g}: the default policy rescaled for it "
                        "is not valid:\n" + "\n".join(problems)
                    )
        if model is not None:
            if not model.strip():
                raise ScenarioError(f"{where}: --model must not be empty")
            changes["model"] = model
        if arms is not None:
            known = {a.name for a in self.arms}
            unknown = [a for a in arms if a not in known]
            if unknown or not arms:
                raise ScenarioError(
                    f"{where}: --arms: unknown arm(s) {', '.join(unknown) or '(none given)'}; "
                    f"the scenario has {', '.join(sorted(known))}"
                )
            changes["arms"] = tuple(a for a in self.arms if a.name in arms)
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------- loading


def resolve(name_or_path: str) -> Path:
    """A path as given, else ``loadtests/scenarios/NAME[.yaml]``."""
    given = Path(name_or_path)
    if given.is_file():
        return given
    for candidate in (SCENARIO_DIR / name_or_path, SCENARIO_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))
    raise ScenarioError(
        f"{name_or_path}: no such scenario file (names under {SCENARIO_DIR}: {', '.join(known)})"
    )


@dataclass(frozen=True)
class Document:
    """A scenario file as read: its data, and its node tree for the lines of errors."""

    path: Path
    data: Any
    node: Node | None = None

    @property
    def kind(self) -> str:
        """``ab`` (arms compared on a simulated fleet, the default) or ``overhead``."""
        kind = self.data.get("kind", "ab") if isinstance(self.data, Mapping) else "ab"
        return kind if isinstance(kind, str) else "ab"


def read_document(name_or_path: str | Path) -> Document:
    """Read (not validate) a scenario file; YAML syntax errors as ``file:line:``."""
    from extproc.yamlfile import YamlSyntaxError, compose

    path = resolve(str(name_or_path))
    try:
        text = path.read_text()
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc}") from exc
    try:
        node = compose(text, str(path))
    except YamlSyntaxError as exc:
        raise ScenarioError(exc.message) from None
    return Document(path, yaml.safe_load(text), node)


def load_scenario(name_or_path: str | Path) -> Scenario:
    document = read_document(name_or_path)
    if document.kind != "ab":
        raise ScenarioError(
            f"{document.path}: kind {document.kind!r}: not an A/B scenario (run it with "
            "`fairlane bench`)"
        )
    return parse_scenario(document.data, document.path, document.node)


def parse_scenario(data: Any, path: Path, node: Node | None = None) -> Scenario:
    """Validate the whole document; raise one :class:`ScenarioError` listing every problem
    (with its line when ``node``, the document's YAML node tree, is given)."""
    reader = _Reader(path)
    scenario = reader.scenario(data)
    if reader.errors or scenario is None:
        raise reader.failure(node)
    return scenario


def line_of(node: Node | None, where: str) -> int | None:
    """The line of field ``where`` (``groups[1].rate``) in the YAML node tree: the field's
    own key, else the closest enclosing one that exists (a missing field's mapping)."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", where):
        if part.startswith("[") and isinstance(node, SequenceNode):
            index = int(part[1:-1])
            if index >= len(node.value):
                break
            node = node.value[index]
            line = node.start_mark.line + 1
        elif isinstance(node, MappingNode):
            found = next(
                ((k, v) for k, v in node.value if isinstance(k, ScalarNode) and k.value == part),
                None,
            )
            if found is None:
                break
            line, node = found[0].start_mark.line + 1, found[1]
        else:
            break
    return line


T = TypeVar("T")


class _Reader:
    """Reads fields out of plain YAML data, recording ``field: message`` errors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.errors: list[tuple[str, str]] = []

    def error(self, where: str, message: str) -> None:
        self.errors.append((where, message))

    def failure(self, node: Node | None = None) -> ScenarioError:
        """Every recorded error as ``file:line: field: message``, one a line (no line when
        the node tree is unknown: data built in code)."""
        lines = []
        for where, message in self.errors:
            line = line_of(node, "" if where == "(top level)" else where)
            at = f"{self.path}:{line}" if line is not None else f"{self.path}"
            lines.append(f"{at}: {where}: {message}")
        return ScenarioError("\n".join(lines))

    def mapping(self, data: Any, where: str, allowed: Sequence[str]) -> Mapping[str, Any] | None:
        if not isinstance(data, Mapping):
            self.error(where or "(top level)", f"must be a mapping, got {type(data).__name__}")
            return None
        for key in data:
            if key not in allowed:
                self.error(_join(where, str(key)), f"unknown field (allowed: {', '.join(allowed)})")
        return data

    def get(
        self,
        data: Mapping[str, Any],
        where: str,
        key: str,
        check: Callable[[Any], T | None],
        what: str,
        default: Any = dataclasses.MISSING,
    ) -> Any:
        loc = _join(where, key)
        if key not in data or data[key] is None:
            if default is dataclasses.MISSING:
                self.error(loc, f"required ({what})")
                return None
            return default
        value = check(data[key])
        if value is None:
            self.error(loc, f"must be {what}, got {data[key]!r}")
        return value

    # ----------------------------------------------------------------- the document

    def scenario(self, data: Any) -> Scenario | None:
        top = self.mapping(
            data,
            "",
            (
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
                "policy",
                "groups",
                "arms",
                "targets",
            ),
        )
        if top is None:
            return None
        self.get(top, "", "kind", _choice("ab", "overhead"), "ab or overhead", "ab")
        name = self.get(top, "", "name", _text, "a non-empty string")
        description = self.get(top, "", "description", _str, "a string", "")
        seed = self.get(top, "", "seed", _int(0), "an integer >= 0", 0)
        duration = self.get(top, "", "duration_s", _pos, "simulated seconds > 0")
        warmup = self.get(top, "", "warmup_s", _nonneg, "simulated seconds >= 0", 0.0)
        drain = self.get(top, "", "drain_s", _nonneg, "simulated seconds >= 0", 30.0)
        speedup = self.get(top, "", "speedup", _pos, "a number > 0")
        max_requests = self.get(top, "", "max_requests", _int(1), "an integer >= 1", 20_000)
        model = self.get(top, "", "model", _text, "a non-empty string", "sim-llama-8b")
        backends = self.backends(top.get("backends", {}))
        policy = self.policy(top, speedup)
        rescaled = is_default_policy(top.get("policy"))
        groups = self.groups(top.get("groups"))
        self.keys_in_policy(policy, groups)
        arms = self.arms(top.get("arms"), {g.name for g in groups})
        targets = self.targets(top.get("targets", []), groups, arms)
        if duration is not None and warmup is not None and warmup >= duration:
            self.error("warmup_s", f"must be below duration_s ({duration:g})")
        if self.errors:
            return None
        return Scenario(
            name=name,
            description=description,
            duration_s=duration,
            speedup=speedup,
            backends=backends,
            policy=policy,
            groups=groups,
            arms=arms,
            targets=targets,
            seed=seed,
            warmup_s=warmup,
            drain_s=drain,
            max_requests=max_requests,
            model=model,
            path=self.path,
            policy_rescaled=rescaled,
        )

    def backends(self, data: Any) -> Backends:
        where = "backends"
        raw = self.mapping(data, where, ("count", "profile", "flags", "overrides"))
        if raw is None:
            return Backends()
        count = self.get(raw, where, "count", _int(1), "an integer >= 1", 1)
        profile = self.get(raw, where, "profile", _text, "a simulator profile", "llama-8b-h100")
        flags = self.get(raw, where, "flags", _str_list, "a list of strings", [])
        if profile is not None:
            from loadtests.sim.profiles import PROFILES

            if profile not in PROFILES:
                self.error(f"{where}.profile", f"unknown profile {profile!r} ({sorted(PROFILES)})")
        for flag in flags or []:
            if flag.split("=", 1)[0] in RESERVED_SIM_FLAGS:
                self.error(
                    f"{where}.flags",
                    f"{flag} is set by the harness per arm; use the scenario field",
                )
        overrides = self.overrides(raw.get("overrides"), count or 1)
        return Backends(count or 1, profile or "", tuple(flags or ()), overrides)

    def overrides(self, data: Any, count: int) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """``{index: [flags]}``: each index a backend of the fleet, each flag list one the
        simulator accepts (checked with its own parser, so a typo fails here, not in the
        middle of a run), and no flag the harness sets per arm except ``--profile``."""
        where = "backends.overrides"
        if data is None:
            return ()
        if not isinstance(data, Mapping):
            self.error(where, f"must be a mapping of backend index to flags, got {data!r}")
            return ()
        result: list[tuple[int, tuple[str, ...]]] = []
        for key, flags in data.items():
            loc = f"{where}.{key}"
            if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < count:
                self.error(loc, f"must be a backend index in [0, {count - 1}]")
                continue
            if _str_list(flags) is None or not flags:
                self.error(loc, f"must be a non-empty list of strings, got {flags!r}")
                continue
            bad = [
                f
                for f in flags
                if f.split("=", 1)[0] in RESERVED_SIM_FLAGS and f.split("=", 1)[0] != "--profile"
            ]
            if bad:
                self.error(loc, f"{', '.join(bad)} is set by the harness per arm")
                continue
            problem = _sim_flags_problem(flags)
            if problem:
                self.error(loc, problem)
                continue
            result.append((key, tuple(flags)))
        return tuple(sorted(result))

    def policy(self, top: Mapping[str, Any], speedup: float | None = None) -> Path:
        """The policy file: ``default`` is fairlane's shipped policy
        (``extproc.policy.DEFAULT_POLICY_PATH``), also validated rescaled for ``speedup``
        when one is given (the A/B scenarios: the gateway reads it that way); anything else
        a file relative to the scenario file, used as written (in wall-clock seconds)."""
        raw = self.get(top, "", "policy", _text, "the path of a policy YAML, or default")
        if raw is None:
            return Path()
        from extproc.policy import DEFAULT_POLICY_PATH, PolicyError, load_policy

        default = is_default_policy(raw)
        path = DEFAULT_POLICY_PATH if default else Path(raw)
        if not path.is_absolute():
            path = self.path.parent / path
        if not path.is_file():
            self.error("policy", f"no such file {path}")
            return path
        try:
            load_policy(path)
        except PolicyError as exc:
            self.error("policy", f"{path} is not a valid policy:\n{exc}")
            return path
        if default and speedup is not None:
            problems = rescaled_policy_errors(path, speedup)
            if problems:
                self.error(
                    "policy",
                    f"{path} rescaled for speedup {speedup:g} is not a valid policy:\n"
                    + "\n".join(problems),
                )
        return path

    def keys_in_policy(self, path: Path, groups: Sequence[Group]) -> None:
        """Each group's key must name its tenant in the policy, or the fairlane arm would
        answer 401 (or bill another tenant) and the A/B would compare different workloads."""
        if self.errors or not path.is_file():
            return
        from extproc.policy import load_policy

        policy = load_policy(path)
        for i, group in enumerate(groups):
            tenant = policy.tenant_for_key(group.api_key)
            if tenant is None:
                self.error(f"groups[{i}].api_key", f"{group.api_key!r} is not a key in {path}")
            elif tenant.name != group.tenant:
                self.error(
                    f"groups[{i}].tenant",
                    f"{group.tenant!r}, but {path} maps its key to tenant {tenant.name!r}",
                )

    def dist(self, data: Any, where: str) -> Dist | None:
        if isinstance(data, int) and not isinstance(data, bool):
            if data < 1:
                self.error(where, f"must be >= 1, got {data}")
                return None
            return Dist("fixed", value=data)
        raw = self.mapping(data, where, ("dist", "value", "min", "max", "median", "sigma"))
        if raw is None:
            return None
        kind = self.get(
            raw,
            where,
            "dist",
            _choice("fixed", "uniform", "lognormal"),
            "fixed, uniform or lognormal",
        )
        if kind == "fixed":
            value = self.get(raw, where, "value", _int(1), "an integer >= 1")
            return Dist("fixed", value=value) if value else None
        low = self.get(raw, where, "min", _int(1), "an integer >= 1", 1)
        high = self.get(raw, where, "max", _int(1), "an integer >= 1")
        if low is not None and high is not None and high < low:
            self.error(f"{where}.max", f"must be >= min ({low})")
        if kind == "uniform":
            return Dist("uniform", low=low or 1, high=high or 1)
        if kind == "lognormal":
            median = self.get(raw, where, "median", _pos, "a number > 0")
            sigma = self.get(raw, where, "sigma", _nonneg, "a number >= 0", 0.5)
            return Dist(
                "lognormal", low=low or 1, high=high or 1, median=median or 1.0, sigma=sigma or 0.0
            )
        return None

    def groups(self, data: Any) -> tuple[Group, ...]:
        if not isinstance(data, list) or not data:
            self.error("groups", "required: a non-empty list of client groups")
            return ()
        groups: list[Group] = []
        names: set[str] = set()
        for i, item in enumerate(data):
            group = self.group(item, f"groups[{i}]")
            if group is None:
                continue
            if group.name in names:
                self.error(f"groups[{i}].name", f"duplicate group name {group.name!r}")
            names.add(group.name)
            groups.append(group)
        return tuple(groups)

    def group(self, data: Any, where: str) -> Group | None:
        raw = self.mapping(
            data,
            where,
            (
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
            ),
        )
        if raw is None:
            return None
        errors_before = len(self.errors)
        name = self.get(raw, where, "name", _text, "a non-empty string")
        api_key = self.get(raw, where, "api_key", _text, "the API key to send")
        tenant = self.get(raw, where, "tenant", _text, "the tenant name (for the report)")
        tier = self.get(raw, where, "tier", _text, "the tier label (for the report)")
        rate = self.get(raw, where, "rate", _pos, "requests per simulated second > 0", None)
        concurrency = self.get(raw, where, "concurrency", _int(1), "an integer >= 1", None)
        has_rate, has_concurrency = raw.get("rate") is not None, raw.get("concurrency") is not None
        if has_rate == has_concurrency:
            self.error(where, "needs exactly one of rate (open loop) or concurrency (closed loop)")
        think = self.get(raw, where, "think_s", _nonneg, "simulated seconds >= 0", 0.0)
        prompt = (
            self.dist(raw["prompt_tokens"], f"{where}.prompt_tokens")
            if "prompt_tokens" in raw
            else self._missing(f"{where}.prompt_tokens", "a token count or a distribution")
        )
        max_tokens = (
            self.dist(raw["max_tokens"], f"{where}.max_tokens")
            if "max_tokens" in raw
            else self._missing(f"{where}.max_tokens", "a token count or a distribution")
        )
        stream = self.get(raw, where, "stream", _bool, "true or false", True)
        start = self.get(raw, where, "start_s", _nonneg, "simulated seconds >= 0", 0.0)
        stop = self.get(raw, where, "stop_s", _pos, "simulated seconds > 0", None)
        if start is not None and stop is not None and stop <= start:
            self.error(f"{where}.stop_s", f"must be after start_s ({start:g})")
        user = self.get(raw, where, "user", _text, "a non-empty string", None)
        user_header = self.get(raw, where, "user_header", _text, "a header name", "x-user-id")
        shared = None
        if raw.get("shared_prefix") is not None:
            shared = self.shared_prefix(raw["shared_prefix"], f"{where}.shared_prefix")
            if has_rate:
                self.error(
                    f"{where}.shared_prefix",
                    "needs a closed-loop group (concurrency): a turn follows the last answer",
                )
        if len(self.errors) > errors_before:
            return None
        assert prompt is not None and max_tokens is not None
        return Group(
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
        )

    def shared_prefix(self, data: Any, where: str) -> SharedPrefix | None:
        raw = self.mapping(data, where, ("system_prompts", "system_tokens", "turns"))
        if raw is None:
            return None
        count = self.get(raw, where, "system_prompts", _int(1), "an integer >= 1")
        system = (
            self.dist(raw["system_tokens"], f"{where}.system_tokens")
            if "system_tokens" in raw
            else self._missing(f"{where}.system_tokens", "a token count or a distribution")
        )
        turns = (
            self.dist(raw["turns"], f"{where}.turns")
            if "turns" in raw
            else self._missing(f"{where}.turns", "a count or a distribution")
        )
        if count is None or system is None or turns is None:
            return None
        return SharedPrefix(count, system, turns)

    def _missing(self, where: str, what: str) -> Dist | None:
        self.error(where, f"required ({what})")
        return None

    def arms(self, data: Any, group_names: set[str]) -> tuple[Arm, ...]:
        if not isinstance(data, list) or not data:
            self.error("arms", "required: a list of arms (at least fifo and fairlane)")
            return ()
        arms: list[Arm] = []
        for i, item in enumerate(data):
            where = f"arms[{i}]"
            raw = self.mapping(item, where, ("name", "kind", "drop_groups", "balanced"))
            if raw is None:
                continue
            name = self.get(raw, where, "name", _text, "a non-empty string")
            kind = self.get(raw, where, "kind", _choice(*ARM_KINDS), " or ".join(ARM_KINDS))
            balanced = self.get(raw, where, "balanced", _bool, "true or false", False)
            drop = self.get(raw, where, "drop_groups", _str_list, "a list of group names", [])
            for g in drop or []:
                if g not in group_names:
                    self.error(f"{where}.drop_groups", f"unknown group {g!r}")
            if drop is not None and group_names and set(drop) >= group_names:
                self.error(f"{where}.drop_groups", "drops every group")
            if name in {a.name for a in arms}:
                self.error(f"{where}.name", f"duplicate arm name {name!r}")
            if name and kind:
                arms.append(Arm(name, kind, tuple(drop or ()), bool(balanced)))
        kinds = {a.kind for a in arms}
        if arms and not ("fairlane" in kinds and kinds & set(ENVOY_ONLY_KINDS)):
            self.error(
                "arms",
                "needs at least one fairlane arm and one Envoy-only arm "
                f"({', '.join(ENVOY_ONLY_KINDS)}): the A/B",
            )
        return tuple(arms)

    def targets(
        self, data: Any, groups: Sequence[Group], arms: Sequence[Arm]
    ) -> tuple[Target, ...]:
        if not isinstance(data, list):
            self.error("targets", "must be a list")
            return ()
        arm_names = {a.name for a in arms}
        tiers = {g.tier for g in groups}
        tenants = {g.tenant for g in groups}
        group_names = {g.name for g in groups}
        targets: list[Target] = []
        for i, item in enumerate(data):
            where = f"targets[{i}]"
            raw = self.mapping(
                item,
                where,
                (
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
                ),
            )
            if raw is None:
                continue
            before = len(self.errors)
            name = self.get(raw, where, "name", _text, "a non-empty string")
            metric = self.get(raw, where, "metric", _choice(*METRICS), f"one of {METRICS}")
            arm = self.get(raw, where, "arm", _text, "an arm name")
            baseline = self.get(raw, where, "baseline_arm", _text, "an arm name", None)
            for key, value in (("arm", arm), ("baseline_arm", baseline)):
                if value is not None and arm_names and value not in arm_names:
                    self.error(f"{where}.{key}", f"unknown arm {value!r}")
            selectors = {k: raw[k] for k in ("tier", "tenant", "group") if raw.get(k) is not None}
            tenant_list = self.get(raw, where, "tenants", _str_list, "a list of tenants", [])
            if metric == "jain":
                if selectors or len(tenant_list or []) < 2:
                    self.error(
                        where, "jain takes `tenants: [two or more]` and no tier/tenant/group"
                    )
            elif metric in ARM_METRICS:
                if selectors or tenant_list:
                    self.error(where, f"{metric} is measured over the whole fleet: no selector")
            elif metric is not None and len(selectors) != 1:
                self.error(where, "needs exactly one of tier, tenant, group")
            for key, known in (("tier", tiers), ("tenant", tenants), ("group", group_names)):
                if key in selectors and selectors[key] not in known:
                    self.error(f"{where}.{key}", f"unknown {key} {selectors[key]!r}")
            for t in tenant_list or []:
                if t not in tenants:
                    self.error(f"{where}.tenants", f"unknown tenant {t!r}")
            has_max, has_min = "max" in raw, "min" in raw
            if has_max == has_min:
                self.error(where, "needs exactly one bound: max (<=) or min (>=)")
                continue
            op: Literal["max", "min"] = "max" if has_max else "min"
            bound = self.get(raw, where, op, _number, "a number")
            if len(self.errors) > before:
                continue
            targets.append(
                Target(
                    name=name,
                    metric=metric,
                    arm=arm,
                    bound=float(bound),
                    op=op,
                    tier=selectors.get("tier"),
                    tenant=selectors.get("tenant"),
                    group=selectors.get("group"),
                    tenants=tuple(tenant_list or ()),
                    baseline_arm=baseline,
                )
            )
        return tuple(targets)


# --------------------------------------------------------------------------- the default policy

DEFAULT_POLICY = "default"
"""``policy: default``: fairlane's shipped policy, rescaled to the scenario's speedup."""


def is_default_policy(raw: Any) -> bool:
    """Whether a scenario's ``policy`` value names the shipped default (not a file)."""
    return isinstance(raw, str) and raw.strip() == DEFAULT_POLICY


def rescaled_policy_errors(source: Path, speedup: float) -> list[str]:
    """What is wrong with ``source`` rescaled for ``speedup`` (nothing, for a valid source
    at any sane speedup), each problem as ``SOURCE:LINE: field: message``: the line of the
    field in the file a person edits, not in the generated copy."""
    from extproc.policy import PolicyError, parse_policy
    from extproc.yamlfile import YamlSyntaxError, compose
    from loadtests.bench.policy_scale import render_scaled_policy

    name = f"{source} (rescaled x{speedup:g})"
    try:
        parse_policy(render_scaled_policy(source, speedup), name)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        return [f"{source}: cannot rescale: {exc}"]
    except PolicyError as exc:
        try:
            node = compose(source.read_text(encoding="utf-8"), str(source))
        except (OSError, YamlSyntaxError):
            node = None
        problems = []
        for error in exc.errors:
            rest = error.removeprefix(f"{name}:").partition(": ")[2]
            field = rest.partition(": ")[0]
            line = line_of(node, field) if re.fullmatch(r"[\w.\[\]-]+", field) else None
            at = f"{source}:{line}" if line is not None else str(source)
            problems.append(f"{at}: {rest} (after dividing its durations by {speedup:g})")
        return problems
    return []


# --------------------------------------------------------------------------- field checks


def _sim_flags_problem(flags: Sequence[str]) -> str | None:
    """Why ``fairlane sim`` would refuse ``flags`` (None if it accepts them)."""
    import argparse
    import contextlib
    import io

    from loadtests.sim.cli import add_arguments

    parser = argparse.ArgumentParser(prog="fairlane sim", exit_on_error=False)
    add_arguments(parser)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parser.parse_args(list(flags))
    except (argparse.ArgumentError, SystemExit) as exc:
        return f"fairlane sim refuses {' '.join(flags)}: {exc or stderr.getvalue().strip()}"
    return None


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _pos(value: Any) -> float | None:
    number = _number(value)
    return number if number is not None and number > 0 else None


def _nonneg(value: Any) -> float | None:
    number = _number(value)
    return number if number is not None and number >= 0 else None


def _int(low: int) -> Callable[[Any], int | None]:
    def check(value: Any) -> int | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
        return value if ok else None

    return check


def _choice(*options: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return value if value in options else None

    return check


def _str_list(value: Any) -> list[str] | None:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


__all__ = [
    "METRICS",
    "Arm",
    "Backends",
    "Dist",
    "Document",
    "Group",
    "Scenario",
    "ScenarioError",
    "SharedPrefix",
    "Target",
    "line_of",
    "load_scenario",
    "parse_scenario",
    "read_document",
    "resolve",
]
