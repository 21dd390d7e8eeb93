"""Which models a tenant may use, and which served model a client's name stands for.

Pure functions over the policy, for the request path: no I/O, no randomness of their own
(the caller passes the random ``draw``, so tests pin it).

The rule for a request: the tenant may ask for a name when ``may_request`` says so, i.e.
when its ``models`` allow the name it asked for, or, for an alias, every one of the alias's
targets. The alias's own name is enough so that an operator can grant ``gpt-4o-mini`` and
re-point it at another served model later without editing every tenant; failing that, all
targets are needed, not only the one drawn, so that a request is allowed or refused the
same way every time rather than by the luck of a canary's draw.
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase

from extproc.policy.model import AliasTarget, ModelAliases, Policy, Tenant


def may_use(tenant: Tenant, model: str) -> bool:
    """Whether ``tenant``'s ``models`` allow ``model``: a listed name, or a match of a
    listed shell-style glob (``fnmatchcase``: case-sensitive, ``*`` also matches ``/``).
    A tenant that lists no models may use every model."""
    if not tenant.models:
        return True
    return any(fnmatchcase(model, pattern) for pattern in tenant.models)


def may_request(policy: Policy, tenant: Tenant, requested: str) -> bool:
    """Whether ``tenant`` may ask for the model ``requested``: its ``models`` allow that
    name, or it is an alias and they allow every one of the alias's targets (the module
    docstring says why). Check the name the client sent, before ``resolve_model``."""
    return allowed(policy.model_aliases, tenant, requested)


def allowed(aliases: ModelAliases, tenant: Tenant, name: str) -> bool:
    """``may_request`` over an alias table alone, for the parser, which checks a tenant's
    ``default_model`` before there is a ``Policy``."""
    if may_use(tenant, name):
        return True
    targets = aliases.get(name)
    return targets is not None and all(may_use(tenant, t.model) for t in targets)


def resolve_model(policy: Policy, tenant: Tenant, requested: str | None, draw: float) -> str | None:
    """The served model a request goes to.

    ``requested`` is the body's ``model``; None takes ``tenant.default_model`` (None when
    the tenant has none: the request goes as it is). An alias in ``policy.model_aliases``
    becomes one of its targets, chosen by ``draw`` in [0, 1) over the cumulative weights
    (targets 90 and 10: a draw below 0.9 gives the first, from 0.9 the second); any other
    name is returned as it is. Aliases resolve in one step (the policy allows no chains).

    Whether the tenant may ask for it is the caller's check, on the name asked for (the
    alias, not the target drawn): ``may_request(policy, tenant, requested)``; the parser
    has already checked ``default_model`` the same way."""
    if not 0.0 <= draw < 1.0:
        raise ValueError(f"draw must be in [0, 1), got {draw}")
    name = tenant.default_model if requested is None else requested
    if name is None:
        return None
    targets = policy.model_aliases.get(name)
    if targets is None:
        return name
    return pick_target(targets, draw).model


def pick_target(targets: tuple[AliasTarget, ...], draw: float) -> AliasTarget:
    """The target whose share of the total weight ``draw`` (in [0, 1)) falls in, the
    targets' shares laid end to end in their order."""
    total = math.fsum(t.weight for t in targets)
    reached = 0.0
    for target in targets:
        reached += target.weight
        if draw < reached / total:
            return target
    return targets[-1]  # rounding: the shares summed to a hair under 1
