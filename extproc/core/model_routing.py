"""Which model a request is for, and whether the fleet serves it: decided before it queues.

A request names a model, or its tenant's ``default_model`` stands in; a policy alias
becomes one of its served targets (weighted: a canary), and the body is rewritten to the
served name. An engine answers only to the names its ``/v1/models`` lists
(``extproc.fleet.models``). A model that no engine serves, or that the caller's tenant may
not use, gets the same 404 ``model_not_found`` from the gateway (so the answer reveals
nothing) and never reaches an engine. A model that is served, but by no engine that is
healthy now, waits in its queue like any request, and at its deadline gets a 503 that says
so, with ``retry-after``. ``GET /v1/models`` is answered here, from what the live fleet
serves, filtered by what the caller's key may use.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence

from extproc.core.classify import RequestClass
from extproc.core.errors import Rejection
from extproc.fleet.backend import Backend, BackendPool
from extproc.fleet.models import (
    NOTHING_LOADABLE,
    Loadable,
    ServedModels,
    fleet_models,
    may_serve,
    needs_load,
    several_models,
)
from extproc.policy import Policy, Tenant
from extproc.policy.models import may_request, may_use, resolve_model

MODELS_PATH = "/v1/models"
MODEL_RETRY_AFTER_S = 1


def not_found(model: str) -> Rejection:
    return Rejection(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def route_model(
    policy: Policy, pool: BackendPool, request: RequestClass, draw: float
) -> RequestClass:
    """``request`` for the served model it goes to (``draw`` in [0, 1) picks a canary's
    target); 404 for a model the tenant may not ask for or no engine serves, 400 for none
    at all when the fleet serves several (an engine would pick its own, the wrong pool)."""
    asked = request.model
    if asked is not None and not may_request(policy, request.tenant, asked):
        raise not_found(asked)
    served = resolve_model(policy, request.tenant, asked, draw)
    if served is None:
        if several_models(pool.backends):
            raise Rejection(
                400,
                "the request names no model and this gateway serves several: set 'model'",
                code="model_required",
                param="model",
            )
        return request
    if pool.backends and not pool.serving(served):
        raise not_found(asked or served)
    return request if served == asked else dataclasses.replace(request, model=served)


def model_unavailable(pool: BackendPool, model: str | None, tier: str) -> Rejection | None:
    """The 503 for a request whose wait ended while no healthy engine served its model
    (nor could load it: a runtime adapter whose loads failed); None when one does (the
    request waited for room, not for its model)."""
    if model is None:
        return None
    now, loadable = pool.clock(), pool.loadable
    for backend in pool.backends:
        if not (backend.healthy and may_serve(backend, model, loadable)):
            continue
        if now >= backend.no_loads_until or not needs_load(backend.models, model, loadable):
            return None
    return Rejection(
        503,
        f"no engine serving `{model}` is available right now; retry later",
        code="model_unavailable",
        headers={"retry-after": str(MODEL_RETRY_AFTER_S)},
        tier=tier,
    )


def models_answer(
    backends: Sequence[Backend], tenant: Tenant, loadable: Loadable = NOTHING_LOADABLE
) -> bytes | None:
    """OpenAI's model list of what the live fleet serves that ``tenant`` may use, runtime
    adapters whose base it serves included; None while no engine's models are known (the
    request then goes to an engine, as before)."""
    if all(b.models is None for b in backends):
        return None
    served: ServedModels = fleet_models(b for b in backends if b.healthy)
    adapters = dict(served.adapters)
    for name, base in loadable.items():
        if base in served.bases:
            adapters.setdefault(name, base)
    created = int(time.time())
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": "fairlane", "parent": None}
        for name in sorted(served.bases)
        if may_use(tenant, name)
    ]
    data += [
        {"id": name, "object": "model", "created": created, "owned_by": "fairlane", "parent": base}
        for name, base in sorted(adapters.items())
        if may_use(tenant, name)
    ]
    return json.dumps({"object": "list", "data": data}, separators=(",", ":")).encode()
