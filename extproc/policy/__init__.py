"""The YAML policy: tiers, tenants, model aliases and classification rules, validated and
hot-reloaded.

A policy file is the operator's whole say over scheduling, so a mistake in it must be found
before it serves traffic: ``parse_policy`` checks the entire file and reports *every*
problem as ``file:line: field.path: message`` (line numbers come from PyYAML's node marks),
rather than stopping at the first. Nothing is half-applied: a ``Policy`` exists only when
the whole file is valid, and ``PolicyStore`` swaps it in with a single attribute assignment.

Per-request code only reads ``Policy``; every lookup it needs (API key -> tenant, word ->
tier, tenant -> most urgent allowed tier) is a dict built once when the policy is made. API
keys are held as SHA-256 digests whatever form the file gives them in (``keys.py``).
Which models a tenant may ask for and which served model a name resolves to are pure
functions over it (``models.py``).
"""

from pathlib import Path

from extproc.policy.keys import hashed_form, key_hint, key_label
from extproc.policy.model import (
    DEFAULT_MAX_BODY_BYTES,
    AliasTarget,
    Backpressure,
    Budget,
    Condition,
    EscalationMode,
    Fairness,
    Match,
    ModelAliases,
    Policy,
    PolicyError,
    Routing,
    Rule,
    Tenant,
    Tier,
)
from extproc.policy.models import may_request, may_use, resolve_model
from extproc.policy.parse import load_policy, parse_policy
from extproc.policy.store import PolicyListener, PolicyStore

DEFAULT_POLICY_PATH = (Path(__file__).resolve().parent.parent / "default_policy.yaml").resolve()
"""The policy used when none is given: ``extproc/default_policy.yaml``, package data. In the
repository it is a symlink to ``policies/default.yaml``, which this path resolves to (so
messages name the file people edit); a wheel holds a copy of it, so an installed fairlane
needs no checkout (``tests/packaging/test_wheel.py``)."""

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_POLICY_PATH",
    "AliasTarget",
    "Backpressure",
    "Budget",
    "Condition",
    "EscalationMode",
    "Fairness",
    "Match",
    "ModelAliases",
    "Policy",
    "PolicyError",
    "PolicyListener",
    "PolicyStore",
    "Routing",
    "Rule",
    "Tenant",
    "Tier",
    "hashed_form",
    "key_hint",
    "key_label",
    "load_policy",
    "may_request",
    "may_use",
    "parse_policy",
    "resolve_model",
]
