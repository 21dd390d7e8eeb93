"""Token budgets: how much a tenant (and each of its end users) may use per minute.

A tenant's ``budget`` and ``user_budget`` (``extproc.policy.Budget``) each bound tokens per
minute, requests per minute and requests in progress. A request is checked against every
budget that applies when it is submitted, before it takes a queue slot, and refused with a
429 (``rate_limit_exceeded``, OpenAI's ``x-ratelimit-*`` headers, ``retry-after``) when one
would be exceeded. Tokens are charged as input plus an output estimate and corrected at
completion, like the fairness counters. Each key's meter is a leaky bucket draining at the
limit's rate (OpenAI's own shape): three numbers per key, O(1) per request, and a flooding
tenant is served smoothly at its rate instead of in bursts when a window expires.

Budgets are fleet-wide: replicas exchange their charges and their requests in progress, and a
replica cut off from the others enforces its share of each limit. ``Budgets`` has the
details. No I/O and no clock of its own: every call takes ``now`` (the admission clock).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from extproc.core.errors import Rejection

if TYPE_CHECKING:
    from extproc.core.classify import RequestClass
    from extproc.policy import Budget, Policy, Tenant

WINDOW_S = 60.0
"""A budget's limits are per minute: what is used drains at ``limit / WINDOW_S`` a second."""

RATE_LIMIT_CODE = "rate_limit_exceeded"
CONCURRENT_RETRY_S = 1
"""``retry-after`` for a request refused on ``concurrent``: a slot frees when some request
finishes, which nothing here can predict."""

Key = tuple[str, str | None]
"""``(tenant, None)`` for the tenant's budget, ``(tenant, user)`` for one user's."""
LedgerRow = tuple[str, str | None, int, int]
"""``(tenant, user or None, tokens, requests)``: one key's charges since the last exchange,
as the other replicas apply them (negative tokens: a refund)."""

LIMIT_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-requests",
    "x-ratelimit-reset-tokens",
)


def _go_seconds(seconds: int) -> str:
    hours, rest = divmod(seconds, 3600)
    minutes, whole = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{whole}s"
    return f"{minutes}m{whole}s" if minutes else f"{whole}s"


_SECONDS = tuple(_go_seconds(s) for s in range(int(WINDOW_S) + 1))


def go_duration(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` write it (Go's ``time.Duration``):
    ``20ms`` under a second, whole seconds (rounded up) past it: ``1s``, ``59s``, ``6m0s``,
    ``1h0m0s``."""
    ms = math.ceil(seconds * 1000 - 1e-6)
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    whole = -(-ms // 1000)
    return _SECONDS[whole] if whole <= WINDOW_S else _go_seconds(whole)


class Usage:
    """One key's meter: tokens and requests used (draining at the limits' rates) as of
    ``at``, and the requests it has in progress here."""

    __slots__ = ("active", "at", "requests", "tokens")

    def __init__(self, now: float) -> None:
        self.at = now
        self.tokens = 0.0
        self.requests = 0.0
        self.active = 0

    def drain(self, budget: Budget, now: float) -> None:
        """What has drained since ``at`` at the budget's rates (a limit it lacks: nothing
        is kept of that kind)."""
        elapsed = now - self.at
        if elapsed <= 0:
            return
        self.at = now
        limit = budget.tokens_per_minute
        if self.tokens:
            drained = self.tokens - elapsed * limit / WINDOW_S if limit is not None else 0.0
            self.tokens = drained if drained > 0 else 0.0
        limit = budget.requests_per_minute
        if self.requests:
            drained = self.requests - elapsed * limit / WINDOW_S if limit is not None else 0.0
            self.requests = drained if drained > 0 else 0.0

    def add(self, tokens: float, requests: int) -> float:
        """Charge (or, negative, refund: at most what is still used); returns the tokens
        actually added."""
        if tokens < 0:
            tokens = max(tokens, -self.tokens)
        self.tokens += tokens
        self.requests += requests
        return tokens

    def idle(self) -> bool:
        return not (self.tokens or self.requests or self.active)


def _wait_s(used: float, amount: int, limit: int, rate_limit: int) -> float:
    """Seconds until ``amount`` more fits under ``limit`` while ``used`` drains at
    ``rate_limit`` a minute."""
    return max(0.0, (used + amount - limit) * WINDOW_S / rate_limit)


Scope = tuple[Key, "Budget", Usage]
Claim = tuple[Scope, ...]
"""A request's budgets (each key, its budget and meter), checked and not yet charged."""
Ticket = tuple[Claim, int, int]
"""What a submitted request was charged, until it finishes: its budgets, the tokens (input
plus output estimate) and the output estimate. A plain tuple: one is made per request."""


class Budgets:
    """Every budgeted key's meter, and the tickets of the requests charged to them.

    What is charged, and when (the same estimate and correction as the fairness counters):

    - at submission: one request, and ``input + output estimate`` tokens, where the estimate is
      ``max_tokens`` or the policy's ``fairness.default_output_tokens``; a request whose cost alone
      is over the tokens limit can never fit, and is refused at once ("too large");
    - at completion: the output estimate is corrected to the count the completion reported
      (``extproc.core.feedback``);
    - a request that leaves its queue without reaching a backend (deadline, client gone) gets its
      tokens back; its request still counts.

    **The meter.** Each budgeted key (a tenant, or a tenant's user) keeps, per limit, what it has
    used, draining continuously at the limit's rate (a leaky bucket: ``tokens_per_minute / 60`` a
    second); a request fits when what is used plus its cost is within the limit. That is a token
    bucket of capacity ``limit`` refilled at ``limit`` a minute, OpenAI's own shape (its
    ``x-ratelimit-reset-*`` is the time to drain to nothing). Under a flood the tenant is served at
    its rate, smoothly: ``limit`` per minute give or take one request's cost, a request admitted as
    soon as its cost has drained. A tenant back from idle may spend its whole limit at once, so its
    first minute can reach twice the limit (the burst, then the rate). A sliding window of slots,
    tried first, let a flooding tenant take its whole minute in one burst whenever a slot expired,
    slowing the other tenants (docs/benchmarks/internals.md, ``budget-flood``).

    **Replicas.** Every charge and refund is also written to a ledger (``take_ledger``) that the
    shared-state exchange sends to the other replicas, and each replica adds the others' to its own
    meters (``charge_elsewhere``). Requests in progress are a whole state: each replica reports its
    own (``active``), and the others' sum counts against ``concurrent`` (``set_active_elsewhere``).
    A replica cut off from the others enforces its share of each limit (``share``).
    """

    def __init__(self) -> None:
        self._usage: dict[Key, Usage] = {}
        self._tickets: dict[str, Ticket] = {}
        self._elsewhere: Mapping[Key, int] = {}
        self._ledger: dict[Key, list[int]] | None = None
        self._tenants: dict[str, Tenant] = {}
        self.rejections: Counter[tuple[str, str]] = Counter()
        """Requests refused per (tenant, limit): ``fairlane_budget_rejections_total``;
        ``limit`` is the field's name, ``user_`` in front for a user budget's."""

    # ------------------------------------------------------------------ policy

    def configure(self, policy: Policy) -> None:
        """A (re)loaded policy: meters of tenants that still have that budget are kept,
        with their counts; the others are dropped (requests in progress finish on the
        meter they were charged to)."""
        self._tenants = {t.name: t for t in policy.tenants if _budgeted(t)}
        for key in [k for k in self._usage if self._budget_of(k) is None]:
            del self._usage[key]

    def _budget_of(self, key: Key) -> Budget | None:
        tenant = self._tenants.get(key[0])
        if tenant is None:
            return None
        return tenant.budget if key[1] is None else tenant.user_budget

    # ------------------------------------------------------------------ the request path

    def check(
        self, request: RequestClass, tokens: int, now: float, share: float = 1.0
    ) -> Claim | None:
        """The request's budgets if ``tokens`` more (and one more request) fit in each, None
        when it has none; raises the 429 ``Rejection`` of the first limit it would exceed.

        ``share``: the part of each limit this replica may use alone (1 while replicas
        share their counts, or without replicas)."""
        tenant = request.tenant
        if tenant.budget is None and tenant.user_budget is None:
            return None
        scopes: list[Scope] = []
        if tenant.budget is not None:
            scopes.append(self._scope((tenant.name, None), tenant.budget, now))
        if tenant.user_budget is not None:
            scopes.append(self._scope((tenant.name, request.user), tenant.user_budget, now))
        claim = tuple(scopes)
        for key, budget, usage in claim:
            self._check_one(claim, key, budget, usage, tokens, now, share)
        return claim

    def _scope(self, key: Key, budget: Budget, now: float) -> Scope:
        usage = self._usage.get(key)
        if usage is None:
            usage = self._usage[key] = Usage(now)
        else:
            usage.drain(budget, now)
        return (key, budget, usage)

    def _check_one(
        self,
        claim: Claim,
        key: Key,
        budget: Budget,
        usage: Usage,
        tokens: int,
        now: float,
        share: float,
    ) -> None:
        limit = budget.requests_per_minute
        if limit is not None:
            allowed, used = _share(limit, share), usage.requests
            if used + 1 > allowed + 1e-9:
                wait = _wait_s(used, 1, allowed, allowed)
                detail = f"on requests per minute: limit {allowed}, used {math.ceil(used)}"
                self._refuse(claim, key, "requests_per_minute", detail, wait, now, share)
        limit = budget.tokens_per_minute
        if limit is not None:
            allowed, used = _share(limit, share), usage.tokens
            if tokens > allowed:
                detail = (
                    f"on tokens per minute: limit {allowed}, requested {tokens}; the request "
                    "can never fit (lower max_tokens or the prompt)"
                )
                self._refuse(claim, key, "tokens_per_minute", detail, WINDOW_S, now, share)
            if used + tokens > allowed + 1e-9:
                wait = _wait_s(used, tokens, allowed, allowed)
                detail = (
                    f"on tokens per minute: limit {allowed}, used {math.ceil(used)}, "
                    f"requested {tokens}"
                )
                self._refuse(claim, key, "tokens_per_minute", detail, wait, now, share)
        limit = budget.concurrent
        if limit is not None:
            allowed, active = _share(limit, share), usage.active + self._elsewhere.get(key, 0)
            if active + 1 > allowed:
                detail = f"on concurrent requests: limit {allowed}, in progress {active}"
                self._refuse(claim, key, "concurrent", detail, CONCURRENT_RETRY_S, now, share)

    def _refuse(
        self,
        claim: Claim,
        key: Key,
        limit: str,
        detail: str,
        wait_s: float,
        now: float,
        share: float,
    ) -> None:
        tenant, user = key
        who = f"tenant {tenant!r}" if user is None else f"user {user!r} of tenant {tenant!r}"
        self.rejections[(tenant, limit if user is None else f"user_{limit}")] += 1
        retry = max(1, math.ceil(wait_s - 1e-9))
        headers = self._headers(claim, now, share)
        headers["retry-after"] = str(retry)
        raise Rejection(
            429,
            f"Rate limit reached for {who} {detail}. Please try again in {retry}s.",
            code=RATE_LIMIT_CODE,
            headers=headers,
        )

    def charge(
        self, request_id: str, claim: Claim, input_tokens: int, output_estimate: int, now: float
    ) -> None:
        """Charge a checked request (``check`` brought its meters to ``now``): one request,
        its input and output estimate."""
        tokens = input_tokens + output_estimate
        record = self._ledger is not None
        for key, _, usage in claim:
            usage.tokens += tokens
            usage.requests += 1
            usage.active += 1
            if record:
                self._record(key, tokens, 1)
        self._tickets[request_id] = (claim, tokens, output_estimate)

    def finish(
        self, request_id: str, now: float, output_tokens: int | None = None, served: bool = True
    ) -> None:
        """The request finished: it no longer counts as in progress, and ``output_tokens``
        (when known) replaces its output estimate. ``served=False``: it never reached a
        backend, and its tokens are given back."""
        ticket = self._tickets.pop(request_id, None)
        if ticket is None:
            return
        claim, tokens, estimate = ticket
        refund = 0
        if not served:
            refund = tokens
        elif output_tokens is not None:
            refund = estimate - output_tokens
        for key, budget, usage in claim:
            usage.active -= 1
            if refund:
                usage.drain(budget, now)
                added = usage.add(-refund, 0)
                if added:
                    self._record(key, round(added), 0)

    def headers(self, request_id: str, now: float, share: float = 1.0) -> dict[str, str]:
        """The ``x-ratelimit-*`` headers for the admitted request ``request_id`` (none when
        its tenant has no tokens or requests limit, or it is not in progress)."""
        ticket = self._tickets.get(request_id)
        return {} if ticket is None else self._headers(ticket[0], now, share)

    def _headers(self, claim: Claim, now: float, share: float) -> dict[str, str]:
        """OpenAI's six headers, each kind from the budget with the least left of it;
        reset: the time for what is used to drain away."""
        requests: _Left | None = None
        tokens: _Left | None = None
        for _, budget, usage in claim:
            usage.drain(budget, now)
            requests = _tighter(requests, budget.requests_per_minute, usage.requests, share)
            tokens = _tighter(tokens, budget.tokens_per_minute, usage.tokens, share)
        headers: dict[str, str] = {}
        _put_headers(headers, "requests", requests)
        _put_headers(headers, "tokens", tokens)
        return headers

    # ------------------------------------------------------------------ replicas

    def take_ledger(self) -> list[LedgerRow]:
        """This replica's charges and refunds since the last call, for the other replicas'
        ``charge_elsewhere``; starts recording on the first call."""
        ledger, self._ledger = self._ledger, {}
        if not ledger:
            return []
        return [
            (key[0], key[1], tokens, requests)
            for key, (tokens, requests) in ledger.items()
            if tokens or requests
        ]

    def _record(self, key: Key, tokens: int, requests: int) -> None:
        ledger = self._ledger
        if ledger is not None:
            row = ledger.get(key)
            if row is None:
                ledger[key] = [tokens, requests]
            else:
                row[0] += tokens
                row[1] += requests

    def charge_elsewhere(self, rows: Iterable[LedgerRow], now: float) -> None:
        """Charges (and refunds) other replicas made; keys this policy does not budget are
        ignored."""
        for tenant, user, tokens, requests in rows:
            key = (tenant, user)
            budget = self._budget_of(key)
            if budget is None:
                continue
            usage = self._usage.get(key)
            if usage is None:
                if tokens <= 0 and requests <= 0:
                    continue
                usage = self._usage[key] = Usage(now)
            usage.drain(budget, now)
            usage.add(tokens, requests)

    def active(self) -> dict[Key, int]:
        """Requests in progress here per key, for the other replicas' ``concurrent``."""
        return {key: usage.active for key, usage in self._usage.items() if usage.active > 0}

    def set_active_elsewhere(self, counts: Mapping[Key, int]) -> None:
        """Requests in progress on the other replicas per key, as of their last reports."""
        self._elsewhere = counts

    # ------------------------------------------------------------------ upkeep and metrics

    def prune(self, now: float) -> int:
        """Forget keys with nothing used and nothing in progress (users come and go);
        returns how many. O(keys): run it periodically, not per request."""
        idle = []
        for key, usage in self._usage.items():
            budget = self._budget_of(key)
            if budget is not None:
                usage.drain(budget, now)
            if usage.idle() or (budget is None and not usage.active):
                idle.append(key)
        for key in idle:
            del self._usage[key]
        return len(idle)

    def used_ratios(self, now: float) -> dict[tuple[str, str], float]:
        """Per (tenant, limit): the share of the limit in use, fleet-wide; for user budgets
        (``user_*`` limits) the most any one user of the tenant uses."""
        ratios: dict[tuple[str, str], float] = {}
        for name, tenant in self._tenants.items():
            for budget, prefix in ((tenant.budget, ""), (tenant.user_budget, "user_")):
                if budget is None:
                    continue
                for field in ("tokens_per_minute", "requests_per_minute", "concurrent"):
                    if getattr(budget, field) is not None:
                        ratios[(name, prefix + field)] = 0.0
        for key, usage in self._usage.items():
            budget = self._budget_of(key)
            if budget is None:
                continue
            usage.drain(budget, now)
            prefix = "" if key[1] is None else "user_"
            for field, used in (
                ("tokens_per_minute", usage.tokens),
                ("requests_per_minute", usage.requests),
                ("concurrent", usage.active + self._elsewhere.get(key, 0)),
            ):
                limit = getattr(budget, field)
                if limit is not None:
                    label = (key[0], prefix + field)
                    ratios[label] = max(ratios[label], used / limit)
        return ratios


def _budgeted(tenant: Tenant) -> bool:
    return tenant.budget is not None or tenant.user_budget is not None


_Left = tuple[float, int, float]
"""(what is left, the limit as allowed here, seconds until what is used drains away)."""


def _tighter(best: _Left | None, limit: int | None, used: float, share: float) -> _Left | None:
    """``best``, or this budget's figures for one kind when it has less left."""
    if limit is None:
        return best
    allowed = _share(limit, share)
    left = allowed - used
    if best is not None and left >= best[0]:
        return best
    return (left, allowed, used * WINDOW_S / allowed)


def _put_headers(headers: dict[str, str], kind: str, figures: _Left | None) -> None:
    """``x-ratelimit-{limit,remaining,reset}-KIND`` from ``_tighter``'s figures."""
    if figures is None:
        return
    left, allowed, reset = figures
    headers[f"x-ratelimit-limit-{kind}"] = str(allowed)
    headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(left + 1e-9)))
    headers[f"x-ratelimit-reset-{kind}"] = go_duration(reset)


def _share(limit: int, share: float) -> int:
    """The part of ``limit`` a replica enforces alone (all of it while shared)."""
    return limit if share >= 1.0 else max(1, math.floor(limit * share))
