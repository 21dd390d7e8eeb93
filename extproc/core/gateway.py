"""One request's way through the gateway: classify, queue, prioritise, route.

Plain synchronous Python with no asyncio, grpc or protobuf: the servicer hands in a
``RequestInfo`` and gets back a ``Decision`` whose answer is a ``Forward`` (send it upstream,
rewritten), a ``Respond`` (answer the client) or a ``Hold`` (keep the request in Envoy while
it waits in a queue). A held request comes back through ``resume`` once admission grants it,
or ``give_up`` when its deadline passes or its client leaves. Every call that may free a
seat also returns the grants it made for other held requests; the transport wakes them.
Every client error is a ``Rejection`` turned into an OpenAI-shaped ``Respond`` here, so
nothing a client sends can break the stream for the next request.
"""

from __future__ import annotations

import json
import logging
import random
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import Any

from extproc.core.admission import Admission, Grant
from extproc.core.bands import tier_of
from extproc.core.body import parse_body, with_member
from extproc.core.classify import RequestClass, authenticate, classify
from extproc.core.counters import GatewayStats
from extproc.core.decisions import AdapterLoad, Decision, Forward, Hold, Respond
from extproc.core.errors import Rejection, error_body
from extproc.core.events import Completion, RequestInfo
from extproc.core.feedback import settle
from extproc.core.gates import unusable_metrics, unusable_since
from extproc.core.model_routing import (
    MODEL_RETRY_AFTER_S,
    MODELS_PATH,
    model_unavailable,
    models_answer,
    route_model,
)
from extproc.core.overload import OverloadControl
from extproc.core.picker import choose
from extproc.fleet.models import needs_load
from extproc.policy import PolicyStore
from extproc.wire import (
    HEDGE_ON_TIMEOUT_HEADER,
    MAX_RETRIES_HEADER,
    PER_TRY_TIMEOUT_HEADER,
    QUEUE_MS_KEY,
    RATELIMIT_METADATA,
    TIER_HEADER,
    TIER_KEY,
)

log = logging.getLogger("fairlane.gateway")

#: Headers the gateway itself sets or consumes: a client's copy never reaches a backend.
PRIORITY_HEADER = "x-vllm-priority"
TENANT_HEADER = "x-fairlane-tenant"
_STRIPPED_EXACT = frozenset(
    {
        "x-priority",  # the client's tier ask, consumed by classify
        "authorization",  # tenant keys stay at the gateway
        "x-api-key",
        "x-target-cluster",
        PRIORITY_HEADER,  # overwritten on generation requests, removed on the others
    }
)
_STRIPPED_PREFIXES = ("x-fairlane-",)

#: What a request turned away because the service is overloaded is told to wait.
OVERLOAD_RETRY_AFTER_S = 1

#: What a request cancelled for a more urgent one is told to wait before sending it again.
PREEMPTED_RETRY_AFTER_S = 1

#: A new request is refused at once (not held to its deadline) once no backend has had
#: usable metrics for this long: long enough for the first scrapes at start-up and for a
#: scrape that timed out twice to be retried, short against a tier's queue deadline.
NO_METRICS_GRACE_S = 5.0

#: What a request refused because no backend has usable metrics is told to wait.
NO_METRICS_RETRY_AFTER_S = 5

#: Envoy holds a request at most this long past its queue deadline before giving up on us.
HOLD_MARGIN_S = 5.0
MAX_HOLD_S = 3600.0


def client_headers_to_strip(
    headers: Mapping[str, str], overwritten: Collection[str] = ()
) -> tuple[str, ...]:
    """Client headers that must not reach a backend: the gateway's own, its tenant key.

    Headers the gateway overwrites anyway (``overwritten``, and the destination header the
    codec always sets) are left out, so no mutation both removes and sets one name.
    """
    return tuple(
        name
        for name in headers
        if (name in _STRIPPED_EXACT or name.startswith(_STRIPPED_PREFIXES))
        and name not in overwritten
    )


def _overloaded(tier: str) -> Rejection:
    return Rejection(
        429,
        "the gateway is overloaded; retry later",
        code="gateway_overloaded",
        headers={"retry-after": str(OVERLOAD_RETRY_AFTER_S)},
        tier=tier,
    )


def _new_request_id() -> str:
    return uuid.uuid4().hex


class Gateway:
    """The per-request decisions, over the live policy and the admission gate.

    ``new_request_id`` names a request whose client sent no id, or one already in use;
    injected so that tests and the simulator decide what ids look like. ``overload`` says
    when the service itself is overloaded (``extproc.core.overload``); the least urgent
    tier is then turned away here, before it costs a queue entry.
    """

    def __init__(
        self,
        policies: PolicyStore,
        admission: Admission,
        new_request_id: Callable[[], str] = _new_request_id,
        overload: OverloadControl | None = None,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.policies = policies
        self.admission = admission
        self.stats = GatewayStats()
        self._new_request_id = new_request_id
        self._draw = draw
        """A number in [0, 1) per request: which of a canary alias's targets it goes to."""
        self.overload = overload or OverloadControl()
        self._started_at = admission.pool.clock()

    def handle(self, info: RequestInfo) -> Decision:
        """A new request: forward it, answer it, or hold it in its tier's queue."""
        try:
            return self._handle(info)
        except Rejection as rejection:
            return Decision(self.respond_to(rejection))
        except Exception:  # a bug must cost one request, never the service
            log.exception("unexpected error handling %s %s", info.method, info.path)
            self.stats.reject(500, "internal_error")
            return Decision(Respond(500, error_body(500, "internal gateway error")))

    def refuse_early(self, info: RequestInfo) -> Respond | None:
        """While overloaded, the answer for a request known from its headers alone to be of
        the least urgent tier: its key's tenant may use no other. Answered before its body
        is read, that refusal costs the service a fraction of one made on the body. None:
        decide it on the body as usual (a bad key, too, is answered there)."""
        policy = self.policies.current
        if not self.overload.overloaded or len(policy.tiers) < 2:
            return None
        try:
            tenant = authenticate(policy, info)
        except Rejection:
            return None
        lowest = policy.lowest_tier
        if policy.top_tier(tenant) is not lowest:
            return None
        self.overload.handled(least_urgent=True)
        return self.respond_to(_overloaded(lowest.name))

    def resume(self, hold: Hold, grant: Grant) -> Forward:
        """A held request's grant arrived: send it upstream."""
        self.overload.handled(self._least_urgent(hold.tier))
        return self.forward(hold.info, hold.body, hold.request, grant, hold.request_id)

    def _least_urgent(self, tier: str) -> bool:
        """Whether ``tier`` is the least urgent of several (the overload's first to go)."""
        tiers = self.policies.current.tiers
        return len(tiers) > 1 and tiers[-1].name == tier

    def give_up(self, hold: Hold, cancelled: bool = False) -> Decision:
        """A held request's wait ended without a grant: its deadline passed (a 503, that
        says so, or that no backend has usable metrics when none has), or its client went
        away (``cancelled``: nobody to answer). Takes it out of its queue, or gives back a
        grant made in the same instant."""
        grants = tuple(self.admission.abandon(hold.request_id))
        if cancelled:
            return Decision(None, grants)
        model = hold.request.model
        rejection = (
            self._no_usable_metrics(hold.tier)
            or model_unavailable(self.admission.pool, model, hold.tier)
            or Rejection(
                503,
                f"request waited {hold.deadline_s:g}s in the {hold.tier!r} queue "
                "without a backend becoming free",
                code="queue_deadline_exceeded",
                tier=hold.tier,
            )
        )
        return Decision(self.respond_to(rejection), grants)

    def _no_usable_metrics(self, tier: str, grace_s: float = 0.0) -> Rejection | None:
        """The 503 for a request of ``tier`` that no backend can take because none has
        usable metrics (every scrape failing, stale or not made yet), and has not for
        ``grace_s``; None when some backend has them. Without it a client waits out its
        queue deadline to hear that a backend did not "become free", when in fact none
        could ever be a candidate (``extproc.core.gates.unusable_metrics``)."""
        pool = self.admission.pool
        now = pool.clock()
        stale_after_s = self.policies.current.backpressure.stale_after_s
        problems = unusable_metrics(pool.backends, now, stale_after_s)
        if problems is None:
            return None
        if grace_s and now - unusable_since(pool.backends, self._started_at) <= grace_s:
            return None  # start-up, or a blip: the request waits for the next scrapes
        return Rejection(
            503,
            "no backend has usable metrics: " + ", ".join(problems),
            code="no_usable_metrics",
            headers={"retry-after": str(NO_METRICS_RETRY_AFTER_S)},
            tier=tier,
        )

    def respond_to(self, rejection: Rejection) -> Respond:
        if rejection.tier is not None:
            self.stats.shed_request(rejection.tier, rejection.code or "other")
        else:
            self.stats.reject(rejection.status, rejection.code)
        return Respond(rejection.status, rejection.body, rejection.headers)

    def _handle(self, info: RequestInfo) -> Decision:
        policy = self.policies.current
        if not info.body and info.method in ("GET", "HEAD"):
            return Decision(self._forward_bodiless(info))
        body = parse_body(policy, info)
        request = classify(policy, info, body)
        request = route_model(policy, self.admission.pool, request, self._draw())
        tier = request.tier
        least_urgent = self._least_urgent(tier.name)
        self.overload.handled(least_urgent)
        if least_urgent and self.overload.overloaded:
            raise _overloaded(tier.name)
        refusal = self._no_usable_metrics(tier.name, NO_METRICS_GRACE_S)
        if refusal is not None:
            raise refusal
        request_id = info.request_id
        if not request_id or self.admission.knows(request_id):
            request_id = self._new_request_id()  # a client reused an id: keep ours unique
        granted = self.admission.submit(request_id, request)
        others = tuple(g for g in granted if g.request_id != request_id)
        try:
            return Decision(self._answer_submitted(info, body, request, request_id), others)
        except Exception:  # the grants made for others must still reach them
            log.exception("unexpected error answering %s %s", info.method, info.path)
            self.stats.reject(500, "internal_error")
            return Decision(Respond(500, error_body(500, "internal gateway error")), others)

    def _answer_submitted(
        self, info: RequestInfo, body: dict[str, Any], request: RequestClass, request_id: str
    ) -> Forward | Hold:
        """Forward a request admission granted on submission; hold one it queued."""
        own = self.admission.grant_of(request_id)
        if own is not None:
            return self.forward(info, body, request, own, request_id)
        deadline_s = request.tier.queue_deadline_s
        hold = Hold(
            request_id=request_id,
            hold_s=min(MAX_HOLD_S, deadline_s + HOLD_MARGIN_S),
            deadline_s=deadline_s,
            tier=request.tier.name,
            info=info,
            body=body,
            request=request,
        )
        return hold

    def _forward_bodiless(self, info: RequestInfo) -> Forward | Respond:
        """``GET /v1/models`` and friends: authenticated, not queued (they cost no GPU). The
        model list is the gateway's own answer when it knows what the engines serve."""
        tenant = authenticate(self.policies.current, info)
        pool = self.admission.pool
        if info.path.partition("?")[0] == MODELS_PATH:
            listed = models_answer(pool.backends, tenant, pool.loadable)
            if listed is not None:
                return Respond(200, listed, {"content-type": "application/json"})
        policy = self.policies.current
        chosen = choose(
            pool.healthy(), pool.backends, None, policy.routing, policy.max_in_flight_per_backend
        )
        if chosen is None:
            raise Rejection(503, "no healthy backend", code="no_backend")
        return Forward(
            body=b"",
            endpoints=tuple(b.address for b in chosen.backends),
            remove_headers=client_headers_to_strip(info.headers),
        )

    def forward(
        self,
        info: RequestInfo,
        body: dict[str, Any],
        request: RequestClass,
        grant: Grant,
        request_id: str,
    ) -> Forward:
        """The request as a backend must see it: vLLM priority in body and header."""
        set_headers = {
            PRIORITY_HEADER: str(grant.priority),
            TIER_HEADER: request.tier.name,
            TENANT_HEADER: request.tenant.name,
        }
        if request.path != info.path:
            set_headers[":path"] = request.path
        endpoints, load = self._adapter_load(request, grant.endpoints)
        # Retries and hedges go only to the endpoints the picker listed: past the list,
        # Envoy's fallback load balancer would pick any host its own health check passes,
        # including one the service left out (garbage metrics, cooling off, saturated).
        alternates = len(endpoints) - 1
        set_headers[MAX_RETRIES_HEADER] = str(alternates)
        if request.tier.hedge_after_ms is not None and alternates:
            # Envoy's router reads these from a trusted filter (mutation_rules allow_envoy)
            # and strips any a client sends: hedge on the per-try timeout, to the next
            # endpoint listed in x-gateway-destination-endpoint.
            hedge_ms = str(request.tier.hedge_after_ms)
            set_headers[PER_TRY_TIMEOUT_HEADER] = hedge_ms
            set_headers[HEDGE_ON_TIMEOUT_HEADER] = "true"
        if request_id != info.request_id:
            set_headers["x-request-id"] = request_id
        strip = client_headers_to_strip(info.headers, overwritten=set_headers)
        self.stats.admit(
            request.tier.name, request.model, grant.flow, grant.queued_s, request.prompt_tokens
        )
        metadata = {TIER_KEY: request.tier.name, QUEUE_MS_KEY: str(round(grant.queued_s * 1000))}
        tenant = request.tenant
        if tenant.budget is not None or tenant.user_budget is not None:
            # OpenAI's x-ratelimit-* on the response: Envoy copies them from the metadata.
            admission = self.admission
            now, share = admission.pool.clock(), admission.peers.share
            for header, value in admission.budgets.headers(request_id, now, share).items():
                metadata[RATELIMIT_METADATA[header]] = value
        raw = info.body
        if request.model is not None and body.get("model") != request.model:
            # an alias, a canary's draw or the tenant's default: the engine's own name
            body["model"] = request.model
            raw = json.dumps(body, separators=(",", ":")).encode()
        return Forward(
            body=with_member(raw, body, "priority", grant.priority),
            endpoints=endpoints,
            set_headers=set_headers,
            remove_headers=strip,
            metadata=metadata,
            # Its client gets nothing before the whole answer: it can still be cancelled.
            cancel_id=request_id if request.tier.preemptible and not request.stream else None,
            load=load,
        )

    def _adapter_load(
        self, request: RequestClass, endpoints: tuple[str, ...]
    ) -> tuple[tuple[str, ...], AdapterLoad | None]:
        """The endpoints for a request, and the runtime adapter the first must load before
        it goes there (None: nothing to load). Alternates that would need a load of their
        own are left out: a retry there would be answered 404 by the engine."""
        adapter = self.policies.current.runtime_adapters.get(request.model or "")
        if adapter is None or request.model is None:
            return endpoints, None
        pool = self.admission.pool

        def must_load(address: str) -> bool:
            backend = pool.by_address.get(address)
            return backend is not None and needs_load(backend.models, request.model, pool.loadable)

        if not must_load(endpoints[0]):
            return endpoints, None
        kept = (endpoints[0], *(a for a in endpoints[1:] if not must_load(a)))
        return kept, AdapterLoad(endpoints[0], request.model, adapter.base, adapter.path)

    def adapter_unavailable(self, load: AdapterLoad, tier: str, reason: str) -> Respond:
        """The answer for a request whose engine could not load its adapter: nothing
        reached the engine, so the client may send it again (that engine is left out of
        loads for a while, ``Backend.no_loads_until``)."""
        return self.respond_to(
            Rejection(
                503,
                f"the adapter `{load.name}` could not be loaded on an engine ({reason}); "
                "retry later",
                code="adapter_unavailable",
                headers={"retry-after": str(MODEL_RETRY_AFTER_S)},
                tier=tier,
            )
        )

    def preempted(self, tier: str) -> Respond:
        """The answer for a request cancelled while it ran, to seat a more urgent one
        (``extproc.core.preemption``): nothing of it reached its client, so the client
        may simply send it again."""
        rejection = Rejection(
            503,
            "preempted by a more urgent request before its answer started; send it again",
            code="preempted",
            headers={"retry-after": str(PREEMPTED_RETRY_AFTER_S)},
            tier=tier,
        )
        return self.respond_to(rejection)

    def completed(self, completion: Completion) -> list[Grant]:
        """Envoy finished a request: free its backend slot and settle its fairness charge
        (``feedback.settle``). Returns the grants the freed slot allowed."""
        entry = self.admission.entry_of(completion.request_id)
        settled = settle(self.admission, self.admission.pool, completion)
        if entry is None or settled is None:
            return []
        tier = tier_of(entry.band)
        self.overload.handled(self._least_urgent(tier))
        duration_s, ttfb_s = completion.duration_s, completion.ttfb_s
        self.stats.complete(tier, entry.flow, duration_s, ttfb_s, settled.output_tokens)
        return settled.grants
