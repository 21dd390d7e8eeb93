"""The YAML policy: tiers, tenants and classification rules, validated and hot-reloaded.

A policy file is the operator's whole say over scheduling, so a mistake in it must be found
before it serves traffic: ``parse_policy`` checks the entire file and reports *every*
problem as ``file:line: field.path: message`` (line numbers come from PyYAML's node marks),
rather than stopping at the first. Nothing is half-applied: a ``Policy`` exists only when
the whole file is valid, and ``PolicyStore`` swaps it in with a single attribute assignment.

Per-request code only reads ``Policy``; every lookup it needs (API key -> tenant, word ->
tier, tenant -> most urgent allowed tier) is a dict built once when the policy is made.
"""

from pathlib import Path

from extproc.policy.model import (
    DEFAULT_MAX_BODY_BYTES,
    Backpressure,
    Condition,
    EscalationMode,
    Fairness,
    Match,
    Policy,
    PolicyError,
    Routing,
    Rule,
    Tenant,
    Tier,
)
from extproc.policy.parse import key_hint, load_policy, parse_policy
from extproc.policy.store import PolicyListener, PolicyStore

_EXTPROC = Path(__file__).resolve().parent.parent
_PACKAGED_DEFAULT = _EXTPROC / "default_policy.yaml"
_REPO_DEFAULT = _EXTPROC.parent / "policies" / "default.yaml"
DEFAULT_POLICY_PATH = _REPO_DEFAULT if _REPO_DEFAULT.is_file() else _PACKAGED_DEFAULT
"""The policy used when none is given: the checkout's ``policies/default.yaml`` when
running from a source tree (editable install), else the copy shipped inside the package
(``extproc/default_policy.yaml``, a symlink in the repository that wheels turn into a file)."""

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_POLICY_PATH",
    "Backpressure",
    "Condition",
    "EscalationMode",
    "Fairness",
    "Match",
    "Policy",
    "PolicyError",
    "PolicyListener",
    "PolicyStore",
    "Routing",
    "Rule",
    "Tenant",
    "Tier",
    "key_hint",
    "load_policy",
    "parse_policy",
]
