"""``fairlane check POLICY``: validate a policy file and show what it means.

Run it before deploying a policy (or in CI): it exits 1 with one ``file:line: field:
message`` line per problem, the same errors a running service logs when it refuses to
reload the file, and otherwise prints the tiers, tenants (with the models each may use),
model aliases, runtime adapters and rules as the gateway will use them.
API keys are never printed, only their first characters (or where they come from:
``sha256:1f2e…``, ``env:NAME``, ``file:PATH``). What works but should change is a warning
on stderr with its ``file:line``, without failing: a plaintext key in the policy, with the
forms that keep the secret out of the file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from extproc.policy import (
    DEFAULT_POLICY_PATH,
    AliasTarget,
    Policy,
    PolicyError,
    Rule,
    Tenant,
    Tier,
    key_label,
    load_policy,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "policy",
        metavar="POLICY",
        nargs="?",
        type=Path,
        default=DEFAULT_POLICY_PATH,
        help="the policy YAML to check (default: the embedded default policy)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        count = len(exc.errors)
        print(f"{args.policy}: {count} error{'s' if count != 1 else ''}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{args.policy}: cannot read: {exc.strerror or exc}", file=sys.stderr)
        return 1
    for warning in policy.warnings:
        print(warning, file=sys.stderr)
    describe(policy, sys.stdout)
    return 0


def describe(policy: Policy, out: TextIO) -> None:
    """The human summary: settings, then tiers, tenants, model aliases, runtime adapters
    and rules as tables."""
    print(
        f"{policy.source}: OK, {len(policy.tiers)} tiers, {len(policy.tenants)} tenants, "
        f"{len(policy.rules)} rules, {len(policy.model_aliases)} model aliases",
        file=out,
    )
    print(
        f"max_body_bytes {policy.max_body_bytes}, "
        f"max_in_flight_per_backend {policy.max_in_flight_per_backend}, "
        f"on_escalation {policy.on_escalation}, user_header {policy.user_header}",
        file=out,
    )
    fairness, backpressure = policy.fairness, policy.backpressure
    print(
        f"fairness per {fairness.flow}: cost {fairness.input_weight:g} x input + "
        f"{fairness.output_weight:g} x output tokens (default output "
        f"{fairness.default_output_tokens}); metrics scraped every "
        f"{backpressure.scrape_interval_s:g}s, stale after {backpressure.stale_after_s:g}s",
        file=out,
    )
    sections: list[tuple[Sequence[str], list[Sequence[str]]]] = [
        (_TIER_HEADINGS, [_tier_row(tier) for tier in policy.tiers]),
        (_SCHEDULING_HEADINGS, [_scheduling_row(tier) for tier in policy.tiers]),
        (_TENANT_HEADINGS, [_tenant_row(tenant) for tenant in policy.tenants]),
    ]
    if policy.model_aliases:
        rows = [
            _alias_row(alias, target, targets)
            for alias, targets in policy.model_aliases.items()
            for target in targets
        ]
        sections.append((_ALIAS_HEADINGS, rows))
    if policy.runtime_adapters:
        adapters: list[Sequence[str]] = [
            (n, a.base, a.path) for n, a in policy.runtime_adapters.items()
        ]
        sections.append((_ADAPTER_HEADINGS, adapters))
    if policy.rules:
        sections.append((_RULE_HEADINGS, [_rule_row(rule) for rule in policy.rules]))
    for headings, rows in sections:
        print(file=out)
        for line in table(headings, rows):
            print(line, file=out)


_TIER_HEADINGS = ("TIER", "RANK", "VLLM PRIORITY", "QUEUE LIMIT", "DEADLINE", "SLO", "ALIASES")
_ADAPTER_HEADINGS = ("RUNTIME ADAPTER", "BASE", "LOADED FROM")
_SCHEDULING_HEADINGS = ("TIER", "GATE", "RESERVED", "AGING", "EARLY SHED")
_TENANT_HEADINGS = (
    "TENANT",
    "TIERS",
    "DEFAULT TIER",
    "WEIGHT",
    "MODELS",
    "DEFAULT MODEL",
    "KEYS",
)
_ALIAS_HEADINGS = ("MODEL ALIAS", "SERVED MODEL", "WEIGHT", "SHARE")
_RULE_HEADINGS = ("RULE", "MATCH", "TIER", "WORKLOAD", "PATH")


def _tier_row(tier: Tier) -> Sequence[str]:
    slo = []
    if tier.slo_ttft_ms is not None:
        slo.append(f"ttft {tier.slo_ttft_ms}ms")
    if tier.slo_latency_s is not None:
        slo.append(f"latency {tier.slo_latency_s:g}s")
    return (
        tier.name,
        str(tier.rank),
        str(tier.priority),
        str(tier.queue_limit),
        f"{tier.queue_deadline_s:g}s",
        ", ".join(slo) or "-",
        ", ".join(tier.aliases) or "-",
    )


def _scheduling_row(tier: Tier) -> Sequence[str]:
    gate = tier.gate
    bounds = []
    if gate.max_waiting is not None:
        bounds.append("empty queue" if gate.max_waiting <= 1 else f"waiting < {gate.max_waiting}")
    if gate.max_kv_cache_usage is not None:
        bounds.append(f"kv <= {gate.max_kv_cache_usage:.0%}")
    if gate.max_itl_s is not None:
        bounds.append(f"itl <= {gate.max_itl_s * 1000:g}ms")
    if gate.max_in_flight is not None:
        bounds.append(f"in flight < {gate.max_in_flight}")
    aging = "-"
    if tier.aging_rate and tier.aging_cap:
        aging = f"1 rank / {1 / tier.aging_rate:g}s, <= {tier.aging_cap:g}"
    return (
        tier.name,
        ", ".join(bounds) or "fresh metrics",
        f"{tier.reserved_share:.0%}" if tier.reserved_share else "-",
        aging,
        f"from {tier.early_shed_from:.0%} full" if tier.early_shed_from is not None else "-",
    )


def _tenant_row(tenant: Tenant) -> Sequence[str]:
    keys = ", ".join(key_label(entry) for entry in tenant.api_keys)
    return (
        tenant.name,
        ", ".join(tenant.tiers),
        tenant.default_tier,
        f"{tenant.weight:g}",
        ", ".join(tenant.models) or "all",
        tenant.default_model or "-",
        f"{len(tenant.api_keys)} ({keys})",
    )


def _alias_row(alias: str, target: AliasTarget, targets: tuple[AliasTarget, ...]) -> Sequence[str]:
    """One row per target: the alias's share of requests that go to it."""
    share = target.weight / sum(t.weight for t in targets)
    return (alias, target.model, f"{target.weight:g}", f"{share:.1%}".replace(".0%", "%"))


def _rule_row(rule: Rule) -> Sequence[str]:
    match = rule.match
    tests = []
    if match.path_prefix is not None:
        tests.append(f"path {match.path_prefix}*")
    if match.path_regex is not None:
        tests.append(f"path ~ {match.path_regex.pattern}")
    for where, conditions in (("header", match.headers), ("body", match.body)):
        tests.extend(f"{where} {c.field} {c.op} {_operand(c.operand)}" for c in conditions)
    path = "-"
    if rule.rewrites_path:
        path = f"{rule.strip_path_prefix or ''} -> {rule.add_path_prefix or ''}"
    return (rule.name, "; ".join(tests), rule.tier or "-", rule.workload or "-", path)


def _operand(value: object) -> str:
    pattern = getattr(value, "pattern", None)
    if isinstance(pattern, str):
        return pattern
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def table(headings: Sequence[str], rows: list[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [headings, *rows]) for i in range(len(headings))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [headings, *rows]
    ]
