"""Requests Envoy holds while they wait in a queue: the futures the core never sees.

The core decides synchronously and returns what it decided: an answer for the request in
hand, and the grants a call made for requests already waiting (``Decision``). This module
is where those grants meet the waiting ext_proc streams. Every call into the core that may
free a seat goes through ``HeldRequests``, which resolves the futures of the requests it
let go, so no path (a completion, a scrape, a policy reload, a lost completion expiring)
can grant a request and forget to wake it.

Timers live here too: a held request waits at most its tier's queue deadline, then the
gateway answers it with a 503 (``Gateway.give_up``); a client that goes away cancels the
wait, which takes the request out of its queue at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from extproc.core.admission import Grant
from extproc.core.bands import tier_of
from extproc.core.decisions import Forward, Hold, Respond
from extproc.core.errors import Rejection
from extproc.core.events import Completion, RequestInfo
from extproc.core.gateway import Gateway
from extproc.core.peers import PeerView
from extproc.policy import Policy


class HeldRequests:
    """The gateway, driven from the event loop: one future per held request."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._waiting: dict[str, asyncio.Future[Grant]] = {}
        self._running: dict[str, asyncio.Future[None]] = {}
        """In-flight requests that can be cancelled: resolved when one is preempted."""

    def __len__(self) -> int:
        return len(self._waiting)

    # ----------------------------------------------------------------- events in

    def handle(self, info: RequestInfo) -> Forward | Respond | Hold:
        """A new request. A ``Hold`` is registered before this returns, so a grant made by
        any later event finds its future even before the stream awaits it."""
        decision = self.gateway.handle(info)
        answer = decision.answer
        if isinstance(answer, Hold):
            self._waiting[answer.request_id] = asyncio.get_running_loop().create_future()
        self._wake(decision.grants)
        assert answer is not None  # handle always answers the request in hand
        return answer

    @property
    def may_preempt(self) -> bool:
        """Whether a request may turn out cancellable (a tier of the policy is
        ``preemptible``): its stream then asks for its response headers."""
        return any(tier.preemptible for tier in self.gateway.policies.current.tiers)

    @property
    def overloaded(self) -> bool:
        """The service is behind: some requests may be refused on their headers alone."""
        return self.gateway.overload.overloaded

    def refuse_early(self, info: RequestInfo) -> Respond | None:
        """While overloaded, the answer for a request refused on its headers alone."""
        return self.gateway.refuse_early(info)

    def in_flight(self, request_id: str) -> bool:
        """Whether this service let ``request_id`` go and has not seen it finish: the only
        completions it needs (with replicas, the others' come too)."""
        return self.gateway.admission.grant_of(request_id) is not None

    def done_elsewhere(self, upstream: str) -> None:
        """Another replica's request finished on ``upstream``: its seat is free before the
        next scrape shows it, as one of ours would be."""
        backend = self.gateway.admission.pool.by_address.get(upstream)
        if backend is not None:
            backend.note_completion_elsewhere()

    def completed(self, completion: Completion) -> None:
        """Envoy's access log reported a finished request."""
        self._wake(self.gateway.completed(completion))

    def dispatch(self) -> None:
        """A backend may have gained room (a scrape round, a backend back up)."""
        self._wake(self.gateway.admission.dispatch())

    def forget_backend(self, address: str) -> None:
        """A backend left the fleet: admission forgets it (and grants what that allows)."""
        self._wake(self.gateway.admission.forget_backend(address))

    def apply_peers(self, view: PeerView, charges: Iterable[tuple[str, str, float]]) -> None:
        """An exchange with the other replicas (``extproc.state``): their service counts in
        fairness, and their leases and waiting bands may let held requests go, or hold."""
        admission = self.gateway.admission
        admission.charge_elsewhere(charges)
        self._wake(admission.apply_peers(view))

    def configure(self, policy: Policy) -> None:
        """A policy reload: new limits may let held requests go."""
        self._wake(self.gateway.admission.configure(policy))

    def expire(self, max_age_s: float) -> None:
        """Reclaim the slots of requests whose completion never arrived."""
        self._wake(self.gateway.admission.expire(max_age_s))

    def turn_away(self, message: str, code: str, retry_after_s: int) -> int:
        """Answer every queued request with a 503 now (shutting down); returns how many."""
        entries = self.gateway.admission.turn_away_waiting()
        for entry in entries:
            future = self._waiting.get(entry.request_id)
            if future is not None and not future.done():
                headers = {"retry-after": str(retry_after_s)}
                tier = tier_of(entry.band)
                rejection = Rejection(503, message, code=code, headers=headers, tier=tier)
                future.set_exception(rejection)
        return len(entries)

    # ----------------------------------------------------------------- waiting

    async def outcome(self, hold: Hold) -> Forward | Respond:
        """Wait for ``hold``'s grant, at most its queue deadline; the answer to send.

        Cancellation (the client went away) takes the request out of its queue and
        propagates.
        """
        future = self._waiting[hold.request_id]
        try:
            grant = await asyncio.wait_for(asyncio.shield(future), hold.deadline_s)
        except TimeoutError:
            decision = self.gateway.give_up(hold)
            self._wake(decision.grants)
            assert decision.answer is not None and not isinstance(decision.answer, Hold)
            return decision.answer
        except Rejection as rejection:  # turned away on shutdown
            return self.gateway.respond_to(rejection)
        except asyncio.CancelledError:
            self._wake(self.gateway.give_up(hold, cancelled=True).grants)
            raise
        finally:
            self._waiting.pop(hold.request_id, None)
        return self.gateway.resume(hold, grant)

    def abandon(self, hold: Hold) -> None:
        """The stream of a held request ended before it waited for its outcome (grpc could
        not send the hold message: the client or Envoy went away): take it out of its
        queue, or give back a grant made meanwhile, as a cancelled wait would."""
        future = self._waiting.pop(hold.request_id, None)
        if future is None:
            return  # its wait already ended, and cleaned up after itself
        future.cancel()
        self._wake(self.gateway.give_up(hold, cancelled=True).grants)

    # ----------------------------------------------------------------- running

    def cancellable(self, request_id: str) -> asyncio.Future[None]:
        """``request_id`` was forwarded and its stream stays open until its answer starts:
        admission may cancel it for a more urgent request (``extproc.core.preemption``),
        and the future resolves then."""
        future = asyncio.get_running_loop().create_future()
        self._running[request_id] = future
        self.gateway.admission.cancellable(request_id)
        return future

    def settled(self, request_id: str) -> None:
        """Its answer started, or its stream ended: it can no longer be cancelled."""
        self._running.pop(request_id, None)
        self.gateway.admission.not_cancellable(request_id)

    # ----------------------------------------------------------------- grants out

    def _wake(self, grants: Iterable[Grant]) -> None:
        for grant in grants:
            future = self._waiting.get(grant.request_id)
            if future is not None and not future.done():
                future.set_result(grant)
        # A grant may have taken the seat of a cancellable request: its stream answers it.
        for request_id in self.gateway.admission.take_preempted():
            running = self._running.pop(request_id, None)
            if running is not None and not running.done():
                running.set_result(None)
