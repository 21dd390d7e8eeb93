"""Reading a policy file: the whole file is validated, every problem reported as
``file:line: field.path: message`` (line numbers from PyYAML's node marks), and a ``Policy``
exists only when nothing is wrong.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from extproc.policy.keys import (
    ENV_PREFIX,
    FILE_PREFIX,
    SHA256_PREFIX,
    key_digest,
    key_hint,
    key_label,
    parse_hex_digest,
)
from extproc.policy.model import (
    MAX_MODEL_NAME_CHARS,
    AliasTarget,
    Backpressure,
    Budget,
    Condition,
    Fairness,
    Gate,
    Match,
    Policy,
    PolicyError,
    Routing,
    Rule,
    RuntimeAdapter,
    Tenant,
    Tier,
)
from extproc.policy.models import allowed
from extproc.yamlfile import LocatedReader, YamlSyntaxError, compose, join_path, kind_of

# --------------------------------------------------------------------------- parsing

_TIER_NAME = re.compile(r"[a-z][a-z0-9_-]*")
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")
_WHITESPACE = re.compile(r"\s")
_TOP_KEYS = (
    "tiers",
    "tenants",
    "rules",
    "max_body_bytes",
    "on_escalation",
    "max_in_flight_per_backend",
    "user_header",
    "fairness",
    "backpressure",
    "routing",
    "models",
)
_ROUTING_KEYS = (
    "queue_weight",
    "kv_cache_weight",
    "prefix_weight",
    "region_weight",
    "sticky_margin",
    "lora_weight",
    "prefix_lookahead",
)
_FAIRNESS_KEYS = ("flow", "input_weight", "output_weight", "default_output_tokens")
_BACKPRESSURE_KEYS = ("scrape_interval_s", "stale_after_s")
_AGING_KEYS = ("seconds_per_rank", "max_ranks")
_GATE_KEYS = ("max_waiting", "max_kv_cache_usage", "max_itl_ms", "max_in_flight")
_TIER_KEYS = (
    "name",
    "priority",
    "queue_limit",
    "queue_deadline_s",
    "slo_ttft_ms",
    "slo_latency_s",
    "aliases",
    "aging",
    "reserved_share",
    "reserved_idle_s",
    "hedge_after_ms",
    "gate",
    "early_shed_from",
    "preemptible",
)
_TENANT_KEYS = (
    "name",
    "api_keys",
    "tiers",
    "default_tier",
    "weight",
    "budget",
    "user_budget",
    "models",
    "default_model",
)
_MODELS_KEYS = ("aliases", "adapters")
_ADAPTER_KEYS = ("base", "path")
_ALIAS_TARGET_KEYS = ("model", "weight")
_GLOB_CHARS = re.compile(r"[*?\[]")
_BUDGET_KEYS = ("tokens_per_minute", "requests_per_minute", "concurrent")
_RULE_KEYS = ("name", "match", "tier", "workload", "strip_path_prefix", "add_path_prefix")
_MATCH_KEYS = ("path_prefix", "path_regex", "headers", "body")
_HEADER_OPS = ("equals", "in", "present", "regex")
_BODY_OPS = ("equals", "in", "present", "gt", "ge", "lt", "le", "regex")
_NUMBER_OPS = ("gt", "ge", "lt", "le")

T = TypeVar("T")


def parse_policy(
    text: str, filename: str = "<policy>", base_dir: str | os.PathLike[str] | None = None
) -> Policy:
    """Validate the whole policy in ``text``; raise ``PolicyError`` listing every problem.

    ``env:`` and ``file:`` API keys are read now; a relative ``file:`` path is taken from
    ``base_dir`` (default: ``filename``'s directory)."""
    try:
        root = compose(text, filename)
    except YamlSyntaxError as exc:
        raise PolicyError([exc.message]) from None
    reader = LocatedReader(filename)
    if root is None:
        reader.error(None, "", "the policy is empty (it needs at least `tiers` and `tenants`)")
        raise PolicyError(reader.errors)
    keys_dir = Path(base_dir) if base_dir is not None else Path(filename).parent
    policy = _read_policy(reader, root, keys_dir)
    if reader.errors or policy is None:
        raise PolicyError(reader.errors)
    return policy


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """Read and validate the policy file at ``path``."""
    return _parse_bytes(Path(path).read_bytes(), str(path))


def _parse_bytes(data: bytes, filename: str) -> Policy:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise PolicyError([f"{filename}:{line}: the file is not valid UTF-8"]) from None
    return parse_policy(text, filename)


def _read_policy(reader: LocatedReader, root: Node, keys_dir: Path) -> Policy | None:
    top = reader.mapping(root, "", _TOP_KEYS)
    if not isinstance(root, MappingNode):
        return None
    for required in ("tiers", "tenants"):
        if required not in top:
            reader.error(root, required, "is required")
    tiers, broken = _read_tiers(reader, top["tiers"]) if "tiers" in top else ([], {})
    _check_reserved_shares(reader, top.get("tiers"), tiers)
    tier_ranks = broken | {tier.name: tier.rank for tier in tiers}
    aliases = _read_models(reader, top["models"]) if "models" in top else _NO_ALIASES
    tenants = (
        _read_tenants(reader, top["tenants"], tier_ranks, keys_dir, aliases)
        if "tenants" in top
        else []
    )
    rules = _read_rules(reader, top["rules"], tier_ranks) if "rules" in top else []
    settings = _read_settings(reader, top)
    unlisted = reader.warned[_PLAINTEXT] - PLAINTEXT_WARNINGS_LISTED
    if unlisted > 0:
        reader.warnings.append(
            f"{reader.filename}: warning: {unlisted} more plaintext API keys, not listed: "
            f"{_PLAINTEXT_ADVICE}"
        )
    if reader.errors or not tiers or not tenants:
        return None
    return Policy(
        tiers=tuple(tiers),
        tenants=tuple(tenants),
        rules=tuple(rules),
        model_aliases=aliases.read,
        runtime_adapters=aliases.adapters,
        source=reader.filename,
        warnings=tuple(reader.warnings),
        key_files=_key_files(tenants, keys_dir),
        **settings,
    )


def _check_reserved_shares(reader: LocatedReader, node: Node | None, tiers: list[Tier]) -> None:
    """Reservations are shares of one fleet: together they cannot exceed all of it."""
    total = sum(tier.reserved_share for tier in tiers)
    if total > 1.0 + 1e-9:
        shares = ", ".join(f"{t.name} {t.reserved_share:g}" for t in tiers if t.reserved_share)
        reader.error(node, "tiers", f"reserved_share adds up to {total:g} (> 1): {shares}")


def _read_settings(reader: LocatedReader, top: dict[str, Node]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if "max_body_bytes" in top:
        settings["max_body_bytes"] = reader.integer(top["max_body_bytes"], "max_body_bytes", 1)
    if "max_in_flight_per_backend" in top:
        node = top["max_in_flight_per_backend"]
        settings["max_in_flight_per_backend"] = reader.integer(node, "max_in_flight_per_backend", 1)
    if "on_escalation" in top:
        node = top["on_escalation"]
        mode = reader.string(node, "on_escalation")
        if mode is not None and mode not in ("downgrade", "reject"):
            reader.error(node, "on_escalation", f"must be 'downgrade' or 'reject', not {mode!r}")
        settings["on_escalation"] = mode
    if "user_header" in top:
        name = reader.string(top["user_header"], "user_header")
        if name is not None and not _HEADER_NAME.fullmatch(name):
            reader.error(top["user_header"], "user_header", "must be a lower-case header name")
        settings["user_header"] = name
    if "fairness" in top:
        settings["fairness"] = _read_fairness(reader, top["fairness"])
    if "backpressure" in top:
        settings["backpressure"] = _read_backpressure(reader, top["backpressure"])
    if "routing" in top:
        settings["routing"] = _read_routing(reader, top["routing"])
    return settings


def _read_routing(reader: LocatedReader, node: Node) -> Routing:
    items = reader.mapping(node, "routing", _ROUTING_KEYS)
    values: dict[str, Any] = {}
    for key, item in items.items():
        if key == "prefix_lookahead":
            value: float | None = reader.integer(item, f"routing.{key}", 0)
        else:
            value = reader.number(item, f"routing.{key}", 0.0)
        if value is not None:
            values[key] = value
    return Routing(**values)


def _read_fairness(reader: LocatedReader, node: Node) -> Fairness:
    items = reader.mapping(node, "fairness", _FAIRNESS_KEYS)
    values: dict[str, Any] = {}
    if "flow" in items:
        flow = reader.string(items["flow"], "fairness.flow")
        if flow is not None and flow not in ("tenant", "user"):
            reader.error(
                items["flow"], "fairness.flow", f"must be 'tenant' or 'user', not {flow!r}"
            )
        values["flow"] = flow
    for key in ("input_weight", "output_weight"):
        if key in items:
            values[key] = reader.number(items[key], f"fairness.{key}", 0.0)
    if "default_output_tokens" in items:
        node_ = items["default_output_tokens"]
        values["default_output_tokens"] = reader.integer(node_, "fairness.default_output_tokens", 1)
    return Fairness(**{k: v for k, v in values.items() if v is not None})


def _read_backpressure(reader: LocatedReader, node: Node) -> Backpressure:
    items = reader.mapping(node, "backpressure", _BACKPRESSURE_KEYS)
    values: dict[str, float] = {}
    for key in _BACKPRESSURE_KEYS:
        if key in items:
            value = reader.positive(items[key], f"backpressure.{key}")
            if value is not None:
                values[key] = value
    defaults = Backpressure()
    interval = values.get("scrape_interval_s", defaults.scrape_interval_s)
    stale = values.get("stale_after_s", defaults.stale_after_s)
    if stale <= interval:
        where = items.get("stale_after_s", node)
        reader.error(
            where,
            "backpressure.stale_after_s",
            f"must be above scrape_interval_s ({interval:g}), not {stale:g}",
        )
    return Backpressure(**values)


def _required(
    reader: LocatedReader, node: Node, items: dict[str, Node], path: str, *keys: str
) -> bool:
    missing = [key for key in keys if key not in items]
    for key in missing:
        reader.error(node, join_path(path, key), "is required")
    return not missing


def _read_tiers(reader: LocatedReader, node: Node) -> tuple[list[Tier], dict[str, int]]:
    """The valid tiers, and the names of invalid ones (so that tenants and rules naming
    them are not also reported as naming an unknown tier)."""
    tiers: list[Tier] = []
    broken: dict[str, int] = {}
    words: dict[str, str] = {}  # name or alias -> path where first used
    items = reader.sequence(node, "tiers")
    if isinstance(node, SequenceNode) and not items:
        reader.error(node, "tiers", "must list at least one tier")
    for i, tier_node in enumerate(items):
        tier = _read_tier(reader, tier_node, f"tiers[{i}]", rank=len(tiers))
        if tier is None:
            name = _scalar_field(tier_node, "name")
            if isinstance(name, str):
                broken[name] = i
            continue
        ok = True
        for word, word_path in [(tier.name, f"tiers[{i}].name")] + [
            (alias, f"tiers[{i}].aliases") for alias in tier.aliases
        ]:
            if word in words:
                reader.error(tier_node, word_path, f"{word!r} is already used by {words[word]}")
                ok = False
            else:
                words[word] = word_path
        if ok:
            tiers.append(tier)
    return tiers, broken


def _scalar_field(node: Node, key: str) -> object:
    """The plain value of ``key`` in a mapping node, if it has one."""
    if isinstance(node, MappingNode):
        for key_node, value_node in node.value:
            if key_node.value == key and isinstance(value_node, ScalarNode):
                return value_node.value
    return None


def _read_tier(reader: LocatedReader, node: Node, path: str, rank: int) -> Tier | None:
    items = reader.mapping(node, path, _TIER_KEYS)
    errors_before = len(reader.errors)
    _required(reader, node, items, path, "name", "priority", "queue_limit", "queue_deadline_s")
    fields: dict[str, Any] = {}
    for key, read in _TIER_FIELDS.items():
        if key in items and not (key in _NULLABLE_TIER_FIELDS and _is_null(items[key])):
            fields[key] = read(reader, items[key], f"{path}.{key}")
    if "aging" in items:
        fields.update(_read_aging(reader, items["aging"], f"{path}.aging"))
    if "gate" in items:
        fields["gate"] = _read_gate(reader, items["gate"], f"{path}.gate")
    if len(reader.errors) != errors_before:
        return None
    fields["aliases"] = tuple(fields.get("aliases", ()))
    return Tier(rank=rank, **fields)


def _read_aging(reader: LocatedReader, node: Node, path: str) -> dict[str, float]:
    """``aging: {seconds_per_rank: S, max_ranks: N}``: climb one rank per S s, at most N."""
    items = reader.mapping(node, path, _AGING_KEYS)
    if not _required(reader, node, items, path, "seconds_per_rank", "max_ranks"):
        return {}
    per_rank = reader.positive(items["seconds_per_rank"], f"{path}.seconds_per_rank")
    cap = reader.number(items["max_ranks"], f"{path}.max_ranks", 0.0)
    if per_rank is None or cap is None:
        return {}
    return {"aging_rate": 1.0 / per_rank, "aging_cap": cap}


def _read_gate(reader: LocatedReader, node: Node, path: str) -> Gate | None:
    """The tier's backpressure bounds; a key left out keeps ``Gate``'s default, ``null``
    removes that bound."""
    items = reader.mapping(node, path, _GATE_KEYS)
    values: dict[str, Any] = {}
    for key, item in items.items():
        where = f"{path}.{key}"
        if _is_null(item):
            values["max_itl_s" if key == "max_itl_ms" else key] = None
        elif key in ("max_waiting", "max_in_flight"):
            values[key] = reader.integer(item, where, 0)
        elif key == "max_kv_cache_usage":
            values[key] = reader.number(item, where, 0.0, 1.0)
        else:
            ms = reader.positive(item, where)
            values["max_itl_s"] = None if ms is None else ms / 1000
    try:
        return Gate(**values)
    except (TypeError, ValueError) as exc:
        reader.error(node, path, str(exc))
        return None


_NULLABLE_TIER_FIELDS = ("slo_ttft_ms", "slo_latency_s", "early_shed_from", "hedge_after_ms")
_TIER_FIELDS: dict[str, Callable[[LocatedReader, Node, str], Any]] = {
    "reserved_share": lambda r, n, p: r.number(n, p, 0.0, 1.0),
    "reserved_idle_s": lambda r, n, p: r.number(n, p, 0.0),
    "hedge_after_ms": lambda r, n, p: r.integer(n, p, 1),
    "early_shed_from": lambda r, n, p: r.number(n, p, 0.0, 1.0),
    "name": lambda r, n, p: r.string(n, p, _TIER_NAME),
    "priority": lambda r, n, p: r.integer(n, p),
    "queue_limit": lambda r, n, p: r.integer(n, p, 0),
    "queue_deadline_s": lambda r, n, p: r.positive(n, p),
    "slo_ttft_ms": lambda r, n, p: r.integer(n, p, 1),
    "slo_latency_s": lambda r, n, p: r.positive(n, p),
    "aliases": lambda r, n, p: r.strings(n, p, _TIER_NAME),
    "preemptible": lambda r, n, p: r.typed(n, p, bool, "true or false"),
}


def _is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag.endswith(":null")


def _read_tenants(
    reader: LocatedReader,
    node: Node,
    tier_ranks: dict[str, int],
    keys_dir: Path = Path(),
    aliases: _Aliases | None = None,
) -> list[Tenant]:
    tenants: list[Tenant] = []
    names: set[str] = set()  # a set, not a scan of ``tenants``: policies may list 100,000
    key_owner: dict[bytes, str] = {}  # digest -> tenant: one key, one tenant, any form
    items = reader.sequence(node, "tenants")
    if isinstance(node, SequenceNode) and not items:
        reader.error(node, "tenants", "must list at least one tenant")
    for i, tenant_node in enumerate(items):
        path = f"tenants[{i}]"
        tenant = _read_tenant(
            reader, tenant_node, path, tier_ranks, key_owner, keys_dir, aliases or _NO_ALIASES
        )
        if tenant is None:
            continue
        if tenant.name in names:
            reader.error(tenant_node, f"{path}.name", f"tenant {tenant.name!r} is defined twice")
            continue
        names.add(tenant.name)
        tenants.append(tenant)
    return tenants


def _read_tenant(
    reader: LocatedReader,
    node: Node,
    path: str,
    tier_ranks: dict[str, int],
    key_owner: dict[bytes, str],
    keys_dir: Path,
    aliases: _Aliases,
) -> Tenant | None:
    items = reader.mapping(node, path, _TENANT_KEYS)
    errors_before = len(reader.errors)
    _required(reader, node, items, path, "name", "api_keys", "tiers")
    name = reader.string(items["name"], f"{path}.name", _TENANT_NAME) if "name" in items else None
    keys = (
        _read_api_keys(
            reader, items["api_keys"], f"{path}.api_keys", name or path, key_owner, keys_dir
        )
        if "api_keys" in items
        else []
    )
    tiers = (
        _read_tier_refs(reader, items["tiers"], f"{path}.tiers", tier_ranks)
        if "tiers" in items
        else []
    )
    default = tiers[0] if tiers else None
    if "default_tier" in items:
        default = reader.string(items["default_tier"], f"{path}.default_tier")
        if default is not None and default not in tiers:
            reader.error(
                items["default_tier"],
                f"{path}.default_tier",
                f"{default!r} is not one of this tenant's tiers ({', '.join(tiers)})",
            )
    weight = reader.positive(items["weight"], f"{path}.weight") if "weight" in items else 1.0
    budgets = {
        key: _read_budget(reader, items[key], f"{path}.{key}")
        for key in ("budget", "user_budget")
        if key in items
    }
    models = (
        _read_model_globs(reader, items["models"], f"{path}.models") if "models" in items else []
    )
    default_model = None
    if "default_model" in items:
        default_model = _model_name(reader, items["default_model"], f"{path}.default_model")
    if len(reader.errors) != errors_before or name is None or default is None or weight is None:
        return None
    tenant = Tenant(
        name,
        tuple(entry for entry, _ in keys),
        tuple(tiers),
        default,
        weight,
        key_digests=tuple(digest for _, digest in keys),
        models=tuple(models),
        default_model=default_model,
        **budgets,
    )
    if (
        default_model is not None
        and aliases.judges(default_model)
        and not allowed(aliases.read, tenant, default_model)
    ):
        what = "alias " if default_model in aliases.read else ""
        but = ": allow the alias or every one of its targets" if what else ""
        reader.error(
            items["default_model"],
            f"{path}.default_model",
            f"{what}{default_model!r} is not allowed by this tenant's models "
            f"({', '.join(models)}){but}",
        )
        return None
    return tenant


def _read_model_globs(reader: LocatedReader, node: Node, path: str) -> list[str]:
    """A tenant's ``models``: names or shell-style globs, each at most the longest name."""
    globs: list[str] = []
    for glob_path, glob_node, glob in reader.located_strings(node, path):
        if _short_enough(reader, glob_node, glob_path, glob):
            globs.append(glob)
    return globs


def _model_name(reader: LocatedReader, node: Node, path: str) -> str | None:
    """One model's name (not a glob): a default model, an alias or an alias's target."""
    name = reader.string(node, path)
    if name is None or not _short_enough(reader, node, path, name):
        return None
    if _GLOB_CHARS.search(name):
        reader.error(node, path, f"{name!r} is a pattern, not a model name (no *, ? or [)")
        return None
    return name


def _short_enough(reader: LocatedReader, node: Node, path: str, name: str) -> bool:
    if len(name) <= MAX_MODEL_NAME_CHARS:
        return True
    reader.error(node, path, f"must be at most {MAX_MODEL_NAME_CHARS} characters, not {len(name)}")
    return False


@dataclass(frozen=True, slots=True)
class _Aliases:
    read: dict[str, tuple[AliasTarget, ...]]
    """The valid aliases."""
    broken: set[str]
    """The names of invalid ones, so that a tenant whose ``default_model`` names one is not
    also reported as not allowed to use it."""
    known: bool = True
    """False when the ``models`` section itself could not be read: which names are aliases
    is unknown, so no ``default_model`` is judged (the section's own error is reported)."""

    adapters: dict[str, RuntimeAdapter] = field(default_factory=dict)
    """The valid runtime adapters (``models.adapters``)."""

    def judges(self, name: str) -> bool:
        return self.known and name not in self.broken


_NO_ALIASES = _Aliases({}, set())


def _read_models(reader: LocatedReader, node: Node) -> _Aliases:
    """``models: {aliases: {NAME: MODEL | [{model: MODEL, weight: W}, ...]},
    adapters: {NAME: {base: MODEL, path: PATH}}}``."""
    errors_before = len(reader.errors)
    items = reader.mapping(node, "models", _MODELS_KEYS)
    adapters = _read_adapters(reader, items["adapters"]) if "adapters" in items else {}
    if "aliases" not in items:
        known = len(reader.errors) == errors_before
        return _Aliases({}, set(), known=known, adapters=adapters)
    aliases_node = items["aliases"]
    if not isinstance(aliases_node, MappingNode):
        reader.error(
            aliases_node, "models.aliases", f"must be a mapping, not {kind_of(aliases_node)}"
        )
        return _Aliases({}, set(), known=False)
    values = reader.mapping(aliases_node, "models.aliases", None)
    key_nodes = {key.value: key for key, _ in aliases_node.value if isinstance(key, ScalarNode)}
    read: dict[str, list[tuple[str, Node, AliasTarget]]] = {}
    broken: set[str] = set()
    for name, value_node in values.items():
        path = join_path("models.aliases", name)
        errors_before = len(reader.errors)
        _model_name(reader, key_nodes.get(name, value_node), path)
        targets = _read_alias_targets(reader, value_node, path)
        if len(reader.errors) != errors_before:
            broken.add(name)
        else:
            read[name] = targets
    for name, targets in read.items():
        for target_path, target_node, target in targets:
            if target.model != name and target.model in values:
                reader.error(
                    target_node,
                    target_path,
                    f"{target.model!r} is an alias itself: aliases resolve in one step, "
                    "so point it at a served model",
                )
                broken.add(name)
    for name in adapters.keys() & values.keys():
        reader.error(
            key_nodes.get(name, aliases_node),
            join_path("models.aliases", name),
            f"{name!r} is also a runtime adapter (models.adapters): a name is one or the other",
        )
        broken.add(name)
    return _Aliases(
        {
            name: tuple(target for _, _, target in targets)
            for name, targets in read.items()
            if name not in broken
        },
        broken,
        adapters=adapters,
    )


def _read_adapters(reader: LocatedReader, node: Node) -> dict[str, RuntimeAdapter]:
    """``models.adapters``: each adapter's name -> ``{base: MODEL, path: PATH}``."""
    if not isinstance(node, MappingNode):
        reader.error(node, "models.adapters", f"must be a mapping, not {kind_of(node)}")
        return {}
    values = reader.mapping(node, "models.adapters", None)
    key_nodes = {key.value: key for key, _ in node.value if isinstance(key, ScalarNode)}
    adapters: dict[str, RuntimeAdapter] = {}
    for name, value_node in values.items():
        path = join_path("models.adapters", name)
        errors_before = len(reader.errors)
        _model_name(reader, key_nodes.get(name, value_node), path)
        fields = reader.mapping(value_node, path, _ADAPTER_KEYS)
        if not _required(reader, value_node, fields, path, "base", "path"):
            continue
        base = _model_name(reader, fields["base"], f"{path}.base")
        where = reader.string(fields["path"], f"{path}.path")
        if where is not None and not where.strip():
            reader.error(fields["path"], f"{path}.path", "must not be empty")
        if base is not None and base == name:
            reader.error(fields["base"], f"{path}.base", "an adapter is not its own base")
        if len(reader.errors) == errors_before and base is not None and where is not None:
            adapters[name] = RuntimeAdapter(base, where)
    return adapters


def _read_alias_targets(
    reader: LocatedReader, node: Node, path: str
) -> list[tuple[str, Node, AliasTarget]]:
    """An alias's value: one model's name (all requests go there), or a list of
    ``{model, weight}`` (requests are shared by weight); each with its path and node."""
    if isinstance(node, ScalarNode) and not _is_null(node):
        model = _model_name(reader, node, path)
        return [] if model is None else [(path, node, AliasTarget(model))]
    if not isinstance(node, SequenceNode):
        reader.error(
            node,
            path,
            f"must be a model's name or a list of {{model, weight}}, not {kind_of(node)}",
        )
        return []
    if not node.value:
        reader.error(node, path, "must list at least one target")
    targets: list[tuple[str, Node, AliasTarget]] = []
    for i, item in enumerate(node.value):
        item_path = f"{path}[{i}]"
        fields = reader.mapping(item, item_path, _ALIAS_TARGET_KEYS)
        if not _required(reader, item, fields, item_path, "model", "weight"):
            continue
        model_path, weight_path = f"{item_path}.model", f"{item_path}.weight"
        model = _model_name(reader, fields["model"], model_path)
        weight = reader.positive(fields["weight"], weight_path)
        if weight is not None and not math.isfinite(weight):
            reader.error(fields["weight"], weight_path, f"must be a finite number, not {weight}")
            weight = None
        if model is None or weight is None:
            continue
        if any(seen.model == model for _, _, seen in targets):
            reader.error(fields["model"], model_path, f"{model!r} is listed twice")
            continue
        targets.append((model_path, fields["model"], AliasTarget(model, weight)))
    return targets


def _read_budget(reader: LocatedReader, node: Node, path: str) -> Budget | None:
    """``{tokens_per_minute: N, requests_per_minute: N, concurrent: N}``, each optional
    (left out or ``null``: no such limit) but at least one set; ``budget: null`` is none."""
    if _is_null(node):
        return None
    items = reader.mapping(node, path, _BUDGET_KEYS)
    values = {
        key: reader.integer(item, f"{path}.{key}", 1)
        for key, item in items.items()
        if not _is_null(item)
    }
    if isinstance(node, MappingNode) and not values:
        reader.error(node, path, f"sets no limit (give {', '.join(_BUDGET_KEYS)})")
    if None in values.values():
        return None
    return Budget(**values) if values else None


def _read_api_keys(
    reader: LocatedReader,
    node: Node,
    path: str,
    owner: str,
    key_owner: dict[bytes, str],
    keys_dir: Path,
) -> list[tuple[str, bytes]]:
    """The tenant's keys, each with its digest; a key may belong to one tenant only, or
    identity is ambiguous (compared by digest, so whatever form each entry takes)."""
    if isinstance(node, SequenceNode) and not node.value:
        reader.error(node, path, "must list at least one key")
    keys: list[tuple[str, bytes]] = []
    for key_path, key_node, entry in reader.located_strings(node, path, shown=key_label):
        digest = _key_entry_digest(reader, key_node, key_path, entry, keys_dir)
        if digest is None:
            continue
        if digest in key_owner:
            reader.error(
                key_node,
                key_path,
                f"key {key_label(entry)} is already used by tenant {key_owner[digest]!r}",
            )
            continue
        key_owner[digest] = owner
        keys.append((entry, digest))
    return keys


_PLAINTEXT = "plaintext key"
PLAINTEXT_WARNINGS_LISTED = 20
"""Plain keys warned about one by one, with their line; the rest in one line."""
_PLAINTEXT_ADVICE = (
    "write it as sha256:HEX (`fairlane hash-key -` prints it), env:NAME or file:PATH "
    "to keep the secret out of the policy"
)


def _key_entry_digest(
    reader: LocatedReader, node: Node, path: str, entry: str, keys_dir: Path
) -> bytes | None:
    """The SHA-256 of the key an ``api_keys`` entry stands for (``extproc.policy.keys``),
    reading its variable or file; None after recording why there is none."""
    if entry.startswith(SHA256_PREFIX):
        digest = parse_hex_digest(entry)
        if digest is None:
            reader.error(node, path, "sha256: must be followed by 64 hex digits")
        return digest
    if entry.startswith(ENV_PREFIX):
        key = _env_key(reader, node, path, entry[len(ENV_PREFIX) :])
    elif entry.startswith(FILE_PREFIX):
        key = _file_key(reader, node, path, entry[len(FILE_PREFIX) :], keys_dir)
    else:
        if _WHITESPACE.search(entry):
            reader.error(node, path, "must not contain whitespace")
            return None
        advice = f"warning: plaintext API key {key_hint(entry)}: {_PLAINTEXT_ADVICE}"
        reader.warn_at_most(_PLAINTEXT, PLAINTEXT_WARNINGS_LISTED, node, path, advice)
        return key_digest(entry)
    if key is None:
        return None
    if not key or _WHITESPACE.search(key):
        # never echo the value: it is a secret, and this message may reach a log
        what = "is empty" if not key else "contains whitespace"
        reader.error(node, path, f"the key in {entry} {what}")
        return None
    return key_digest(key)


def _env_key(reader: LocatedReader, node: Node, path: str, name: str) -> str | None:
    if not name:
        reader.error(node, path, "env: must be followed by an environment variable's name")
        return None
    value = os.environ.get(name)
    if value is None:
        reader.error(node, path, f"environment variable {name} is not set")
    return value


def _key_file_path(name: str, keys_dir: Path) -> Path:
    return keys_dir / Path(name).expanduser()


def _key_files(tenants: list[Tenant], keys_dir: Path) -> tuple[Path, ...]:
    """The files the tenants' ``file:`` keys were read from: the store watches them."""
    names = {
        e[len(FILE_PREFIX) :] for t in tenants for e in t.api_keys if e.startswith(FILE_PREFIX)
    }
    return tuple(sorted({_key_file_path(name, keys_dir) for name in names}))


def _file_key(
    reader: LocatedReader, node: Node, path: str, name: str, keys_dir: Path
) -> str | None:
    if not name:
        reader.error(node, path, "file: must be followed by a path")
        return None
    file = _key_file_path(name, keys_dir)
    try:
        return file.read_bytes().decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        reader.error(node, path, f"key file {file} is not UTF-8 text")
    except OSError as exc:
        reader.error(node, path, f"cannot read key file {file}: {exc.strerror or exc}")
    return None


def _read_tier_refs(
    reader: LocatedReader, node: Node, path: str, tier_ranks: dict[str, int]
) -> list[str]:
    if isinstance(node, SequenceNode) and not node.value:
        reader.error(node, path, "must list at least one tier")
    names: list[str] = []
    for name_path, name_node, name in reader.located_strings(node, path):
        if name in tier_ranks:
            names.append(name)
        else:
            reader.error(name_node, name_path, _unknown_tier(name, tier_ranks))
    return names


def _unknown_tier(name: str, tier_ranks: dict[str, int]) -> str:
    return f"unknown tier {name!r} (tiers are: {', '.join(tier_ranks) or 'none'})"


def _read_rules(reader: LocatedReader, node: Node, tier_ranks: dict[str, int]) -> list[Rule]:
    rules: list[Rule] = []
    names: set[str] = set()
    for i, rule_node in enumerate(reader.sequence(node, "rules")):
        rule = _read_rule(reader, rule_node, f"rules[{i}]", tier_ranks)
        if rule is None:
            continue
        if rule.name in names:
            reader.error(rule_node, f"rules[{i}].name", f"rule {rule.name!r} is defined twice")
            continue
        names.add(rule.name)
        rules.append(rule)
    return rules


def _read_rule(
    reader: LocatedReader, node: Node, path: str, tier_ranks: dict[str, int]
) -> Rule | None:
    items = reader.mapping(node, path, _RULE_KEYS)
    if not _required(reader, node, items, path, "name", "match"):
        return None
    errors_before = len(reader.errors)
    name = reader.string(items["name"], f"{path}.name")
    match = _read_match(reader, items["match"], f"{path}.match")
    tier = workload = strip = add = None
    if "tier" in items:
        tier = reader.string(items["tier"], f"{path}.tier")
        if tier is not None and tier not in tier_ranks:
            reader.error(items["tier"], f"{path}.tier", _unknown_tier(tier, tier_ranks))
    if "workload" in items:
        workload = reader.string(items["workload"], f"{path}.workload", _TENANT_NAME)
    if "strip_path_prefix" in items:
        strip = _read_path_prefix(reader, items["strip_path_prefix"], f"{path}.strip_path_prefix")
        prefix = match.path_prefix if match else None
        if strip is not None and match is not None and not (prefix or "").startswith(strip):
            reader.error(
                items["strip_path_prefix"],
                f"{path}.strip_path_prefix",
                f"needs match.path_prefix to start with {strip!r}, so it always applies",
            )
    if "add_path_prefix" in items:
        add = _read_path_prefix(reader, items["add_path_prefix"], f"{path}.add_path_prefix")
    if tier is None and workload is None and strip is None and add is None:
        reader.error(node, path, "does nothing: set tier, workload or a path rewrite")
    if len(reader.errors) != errors_before or name is None or match is None:
        return None
    return Rule(name, match, tier, workload, strip, add)


def _read_path_prefix(reader: LocatedReader, node: Node, path: str) -> str | None:
    value = reader.string(node, path)
    if value is not None and not value.startswith("/"):
        reader.error(node, path, f"must start with '/', not {value!r}")
        return None
    return value


def _read_match(reader: LocatedReader, node: Node, path: str) -> Match | None:
    items = reader.mapping(node, path, _MATCH_KEYS)
    if isinstance(node, MappingNode) and not items:
        reader.error(node, path, "must test something (an empty match would match every request)")
    errors_before = len(reader.errors)
    prefix = None
    if "path_prefix" in items:
        prefix = _read_path_prefix(reader, items["path_prefix"], f"{path}.path_prefix")
    regex = None
    if "path_regex" in items:
        regex = reader.regex(items["path_regex"], f"{path}.path_regex")
    headers: tuple[Condition, ...] = ()
    body: tuple[Condition, ...] = ()
    if "headers" in items:
        headers = tuple(_read_conditions(reader, items["headers"], f"{path}.headers", _HEADER_OPS))
    if "body" in items:
        body = tuple(_read_conditions(reader, items["body"], f"{path}.body", _BODY_OPS))
    if len(reader.errors) != errors_before or not isinstance(node, MappingNode):
        return None
    return Match(prefix, regex, headers, body)


def _read_conditions(
    reader: LocatedReader, node: Node, path: str, ops: tuple[str, ...]
) -> Iterator[Condition]:
    """``field: value`` (equals), ``field: [a, b]`` (in) or ``field: {op: operand, ...}``."""
    is_headers = ops is _HEADER_OPS
    for name, value_node in reader.mapping(node, path, None).items():
        sub = join_path(path, name)
        if is_headers and not _HEADER_NAME.fullmatch(name):
            reader.error(value_node, sub, "header names must be lower-case tokens")
            continue
        if isinstance(value_node, MappingNode):
            for op, operand_node in reader.mapping(value_node, sub, ops).items():
                cond = _read_condition(reader, operand_node, f"{sub}.{op}", name, op, is_headers)
                if cond is not None:
                    yield cond
        else:
            op = "in" if isinstance(value_node, SequenceNode) else "equals"
            cond = _read_condition(reader, value_node, sub, name, op, is_headers)
            if cond is not None:
                yield cond


def _read_condition(
    reader: LocatedReader, node: Node, path: str, field: str, op: str, is_headers: bool
) -> Condition | None:
    operand: Any
    if op == "present":
        operand = reader.typed(node, path, bool, "true or false")
    elif op == "regex":
        operand = reader.regex(node, path)
    elif op in _NUMBER_OPS:
        operand = reader.typed(node, path, (int, float), "a number")
    elif op == "in":
        values = [
            _read_operand(reader, item, f"{path}[{i}]", is_headers)
            for i, item in enumerate(reader.sequence(node, path))
        ]
        operand = None if None in values else tuple(values)
    else:
        operand = _read_operand(reader, node, path, is_headers)
    if operand is None:
        return None
    return Condition(field, op, operand)  # type: ignore[arg-type]


def _read_operand(reader: LocatedReader, node: Node, path: str, is_headers: bool) -> Any:
    """A value to compare with: header values are strings; body values any JSON scalar."""
    if is_headers:
        value = reader.typed(node, path, str, "a string (quote numbers and booleans)")
        return value
    if not isinstance(node, ScalarNode) or _is_null(node):
        reader.error(node, path, f"must be a string, number or boolean, not {kind_of(node)}")
        return None
    return reader.scalar(node)
