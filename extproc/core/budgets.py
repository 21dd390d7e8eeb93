"""Token budgets: how much a tenant (and each of its end users) may use per minute.

A tenant's ``budget`` and its ``user_budget`` (``extproc.policy.Budget``) each bound up to
three things: tokens per minute, requests per minute, and requests in progress at once. A
request is checked against every budget that applies to it when it is submitted, before it
takes a queue slot, and refused with a 429 (``rate_limit_exceeded``, OpenAI's
``x-ratelimit-*`` headers and ``retry-after``) when one would be exceeded.

What is charged, and when (the same estimate and correction as the fairness counters):

- at submission: one request, and ``input + output estimate`` tokens, where the estimate is
  ``max_tokens`` or the policy's ``fairness.default_output_tokens``; a request whose cost
  alone is over the tokens limit can never fit, and is refused at once ("too large");
- at completion: the output estimate is corrected to the count the completion reported
  (``extproc.core.feedback``), in the part of the window it was charged to;
- a request that leaves its queue without reaching a backend (deadline, client gone) gets
  its tokens back; its request still counts.

**The window.** Each budgeted key (a tenant, or a tenant's user) keeps the last minute in
``SLOTS`` fixed slots of ``SLOT_S`` seconds, a ring of counters with their running sums: a
charge adds to the current slot, the oldest slot is dropped as time passes it, so a charge
counts for between ``WINDOW_S - SLOT_S`` and ``WINDOW_S`` seconds. Every operation is O(1)
(advancing clears at most ``SLOTS`` slots, each cleared once per minute), and the state is
two small fixed arrays per key whatever the traffic: nothing grows with requests. Under a
flood, each slot that drops frees what it held and the flood takes it again, so a tenant is
served its limit per minute, give or take one request's cost. Compared with a token bucket
(OpenAI's shape), the window never lets a tenant that was idle take twice its limit in its
first minute (a full bucket plus the refill); compared with a two-window weighted counter,
``x-ratelimit-reset-*`` is a real time (when the last charge leaves the window, at most a
minute) and a refund lands exactly where its charge did.

**Replicas.** Budgets are fleet-wide: every charge and refund is also written to a ledger
(``take_ledger``) that the shared-state exchange sends to the other replicas, keyed by the
slot's age, and each replica adds the others' charges to the same slot of its own windows
(``charge_elsewhere``). Requests in progress are a whole state: each replica reports its own
(``active``), and the others' sum counts against ``concurrent`` (``set_active_elsewhere``).
A replica cut off from the others enforces its share of each limit (``share``).

No I/O and no clock of its own: every call takes ``now`` (the admission clock).
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
SLOTS = 12
SLOT_S = WINDOW_S / SLOTS
"""Five-second slots: ``x-ratelimit-reset-*`` and ``retry-after`` are exact to the slot, a
charge counts for 55 to 60 s, and a key costs two arrays of 12 numbers."""

RATE_LIMIT_CODE = "rate_limit_exceeded"
CONCURRENT_RETRY_S = 1
"""``retry-after`` for a request refused on ``concurrent``: a slot frees when some request
finishes, which nothing here can predict."""

Key = tuple[str, str | None]
"""``(tenant, None)`` for the tenant's budget, ``(tenant, user)`` for one user's."""
LedgerRow = tuple[str, str | None, int, int, int]
"""``(tenant, user or None, age in slots, tokens, requests)``: one key's charges in one slot,
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
    ``1h0m0s``. The window moves in 5 s slots: finer would be noise."""
    ms = math.ceil(seconds * 1000 - 1e-6)
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    whole = -(-ms // 1000)
    return _SECONDS[whole] if whole <= WINDOW_S else _go_seconds(whole)


class Usage:
    """One key's last minute: tokens and requests per slot (a ring), their sums, and the
    requests it has in progress here."""

    __slots__ = ("active", "head", "request_sum", "requests", "token_sum", "tokens")

    def __init__(self, slot: int) -> None:
        self.head = slot
        """The absolute index (``now // SLOT_S``) of the newest slot."""
        self.tokens = [0] * SLOTS
        self.requests = [0] * SLOTS
        self.token_sum = 0
        self.request_sum = 0
        self.active = 0

    def advance(self, slot: int) -> None:
        """Move the window to ``slot``: slots it passes are dropped."""
        head = self.head
        if slot <= head:
            return
        if slot - head >= SLOTS:
            self.tokens = [0] * SLOTS
            self.requests = [0] * SLOTS
            self.token_sum = self.request_sum = 0
        else:
            tokens, requests = self.tokens, self.requests
            for s in range(head + 1, slot + 1):
                i = s % SLOTS
                self.token_sum -= tokens[i]
                self.request_sum -= requests[i]
                tokens[i] = requests[i] = 0
        self.head = slot

    def add(self, slot: int, tokens: int, requests: int) -> int:
        """Charge ``slot`` (the window must be at it or past it); a refund (negative tokens)
        takes back at most what the slot holds. A slot already dropped takes nothing.
        Returns the tokens actually added."""
        if slot <= self.head - SLOTS or slot > self.head:
            return 0
        i = slot % SLOTS
        if tokens < 0:
            tokens = max(tokens, -self.tokens[i])
        self.tokens[i] += tokens
        self.token_sum += tokens
        self.requests[i] += requests
        self.request_sum += requests
        return tokens

    def idle(self) -> bool:
        return not (self.token_sum or self.request_sum or self.active)

    def _expiry(self, slot: int) -> float:
        """When a charge in ``slot`` leaves the window."""
        return (slot + SLOTS) * SLOT_S

    def reset_s(self, counts: list[int], now: float) -> float:
        """Seconds until the newest charge in ``counts`` leaves the window (0: none)."""
        for s in range(self.head, self.head - SLOTS, -1):
            if counts[s % SLOTS]:
                return max(0.0, self._expiry(s) - now)
        return 0.0

    def wait_s(self, counts: list[int], used: int, amount: int, limit: int, now: float) -> float:
        """Seconds until ``amount`` more fits under ``limit``, as the oldest slots drop."""
        for s in range(self.head - SLOTS + 1, self.head + 1):
            used -= counts[s % SLOTS]
            if used + amount <= limit:
                return max(0.0, self._expiry(s) - now)
        return WINDOW_S


Scope = tuple[Key, "Budget", Usage]
Claim = tuple[Scope, ...]
"""A request's budgets (each key, its budget and window), checked and not yet charged."""
Ticket = tuple[Claim, int, int, int]
"""What a submitted request was charged, until it finishes: its budgets, the slot, the
tokens (input plus output estimate) and the output estimate. A plain tuple: one is made per
request."""


class Budgets:
    """Every budgeted key's window, and the tickets of the requests charged to them."""

    def __init__(self) -> None:
        self._usage: dict[Key, Usage] = {}
        self._tickets: dict[str, Ticket] = {}
        self._elsewhere: Mapping[Key, int] = {}
        self._ledger: dict[tuple[Key, int], list[int]] | None = None
        self._tenants: dict[str, Tenant] = {}
        self.rejections: Counter[tuple[str, str]] = Counter()
        """Requests refused per (tenant, limit): ``fairlane_budget_rejections_total``;
        ``limit`` is the field's name, ``user_`` in front for a user budget's."""

    # ------------------------------------------------------------------ policy

    def configure(self, policy: Policy) -> None:
        """A (re)loaded policy: windows of tenants that still have that budget are kept,
        with their counts; the others are dropped (requests in progress finish on the
        window they were charged to)."""
        self._tenants = {t.name: t for t in policy.tenants if _budgeted(t)}
        for key in [k for k in self._usage if not self._applies(k)]:
            del self._usage[key]

    def _applies(self, key: Key) -> bool:
        tenant = self._tenants.get(key[0])
        if tenant is None:
            return False
        return (tenant.budget if key[1] is None else tenant.user_budget) is not None

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
        slot = int(now // SLOT_S)
        scopes: list[Scope] = []
        if tenant.budget is not None:
            scopes.append(self._scope((tenant.name, None), tenant.budget, slot))
        if tenant.user_budget is not None:
            scopes.append(self._scope((tenant.name, request.user), tenant.user_budget, slot))
        claim = tuple(scopes)
        for key, budget, usage in claim:
            self._check_one(claim, key, budget, usage, tokens, now, share)
        return claim

    def _scope(self, key: Key, budget: Budget, slot: int) -> Scope:
        usage = self._usage.get(key)
        if usage is None:
            usage = self._usage[key] = Usage(slot)
        elif usage.head != slot:
            usage.advance(slot)
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
            allowed = _share(limit, share)
            if usage.request_sum + 1 > allowed:
                wait = usage.wait_s(usage.requests, usage.request_sum, 1, allowed, now)
                detail = f"on requests per minute: limit {allowed}, used {usage.request_sum}"
                self._refuse(claim, key, "requests_per_minute", detail, wait, now, share)
        limit = budget.tokens_per_minute
        if limit is not None:
            allowed, used = _share(limit, share), usage.token_sum
            if tokens > allowed:
                detail = (
                    f"on tokens per minute: limit {allowed}, requested {tokens}; the request "
                    "can never fit (lower max_tokens or the prompt)"
                )
                self._refuse(claim, key, "tokens_per_minute", detail, WINDOW_S, now, share)
            if used + tokens > allowed:
                wait = usage.wait_s(usage.tokens, used, tokens, allowed, now)
                detail = f"on tokens per minute: limit {allowed}, used {used}, requested {tokens}"
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
        """Charge a checked request: one request, its input and output estimate."""
        slot = int(now // SLOT_S)
        tokens = input_tokens + output_estimate
        i = slot % SLOTS
        record = self._ledger is not None
        for key, _, usage in claim:
            if usage.head != slot:
                usage.advance(slot)
            usage.tokens[i] += tokens
            usage.token_sum += tokens
            usage.requests[i] += 1
            usage.request_sum += 1
            usage.active += 1
            if record:
                self._record(key, slot, tokens, 1)
        self._tickets[request_id] = (claim, slot, tokens, output_estimate)

    def finish(
        self, request_id: str, now: float, output_tokens: int | None = None, served: bool = True
    ) -> None:
        """The request finished: it no longer counts as in progress, and ``output_tokens``
        (when known) replaces its output estimate. ``served=False``: it never reached a
        backend, and its tokens are given back."""
        ticket = self._tickets.pop(request_id, None)
        if ticket is None:
            return
        claim, charged, tokens, estimate = ticket
        refund = 0
        if not served:
            refund = tokens
        elif output_tokens is not None:
            refund = estimate - output_tokens
        slot = int(now // SLOT_S)
        for key, _, usage in claim:
            usage.active -= 1
            if refund:
                if usage.head != slot:
                    usage.advance(slot)
                added = usage.add(charged, -refund, 0)
                if added:
                    self._record(key, charged, added, 0)

    def headers(self, request_id: str, now: float, share: float = 1.0) -> dict[str, str]:
        """The ``x-ratelimit-*`` headers for the admitted request ``request_id`` (none when
        its tenant has no tokens or requests limit, or it is not in progress)."""
        ticket = self._tickets.get(request_id)
        return {} if ticket is None else self._headers(ticket[0], now, share)

    def _headers(self, claim: Claim, now: float, share: float) -> dict[str, str]:
        """OpenAI's six headers, each kind from the budget with the least left of it."""
        headers: dict[str, str] = {}
        slot = int(now // SLOT_S)
        requests: tuple[int, int, Usage] | None = None
        tokens: tuple[int, int, Usage] | None = None
        for _, budget, usage in claim:
            if usage.head != slot:
                usage.advance(slot)
            limit = budget.requests_per_minute
            if limit is not None:
                limit = _share(limit, share)
                left = limit - usage.request_sum
                if requests is None or left < requests[0]:
                    requests = (left, limit, usage)
            limit = budget.tokens_per_minute
            if limit is not None:
                limit = _share(limit, share)
                left = limit - usage.token_sum
                if tokens is None or left < tokens[0]:
                    tokens = (left, limit, usage)
        if requests is not None:
            left, limit, usage = requests
            headers["x-ratelimit-limit-requests"] = str(limit)
            headers["x-ratelimit-remaining-requests"] = str(left if left > 0 else 0)
            headers["x-ratelimit-reset-requests"] = go_duration(usage.reset_s(usage.requests, now))
        if tokens is not None:
            left, limit, usage = tokens
            headers["x-ratelimit-limit-tokens"] = str(limit)
            headers["x-ratelimit-remaining-tokens"] = str(left if left > 0 else 0)
            headers["x-ratelimit-reset-tokens"] = go_duration(usage.reset_s(usage.tokens, now))
        return headers

    # ------------------------------------------------------------------ replicas

    def take_ledger(self, now: float) -> list[LedgerRow]:
        """This replica's charges and refunds since the last call, for the other replicas'
        ``charge_elsewhere``; starts recording on the first call."""
        ledger, self._ledger = self._ledger, {}
        if not ledger:
            return []
        slot = int(now // SLOT_S)
        return [
            (key[0], key[1], slot - charged, tokens, requests)
            for (key, charged), (tokens, requests) in ledger.items()
            if tokens or requests
        ]

    def _record(self, key: Key, slot: int, tokens: int, requests: int) -> None:
        ledger = self._ledger
        if ledger is not None:
            row = ledger.get((key, slot))
            if row is None:
                ledger[(key, slot)] = [tokens, requests]
            else:
                row[0] += tokens
                row[1] += requests

    def charge_elsewhere(self, rows: Iterable[LedgerRow], now: float) -> None:
        """Charges other replicas made, each in the slot of its age here; keys this policy
        does not budget are ignored."""
        slot = int(now // SLOT_S)
        for tenant, user, age, tokens, requests in rows:
            key = (tenant, user)
            usage = self._usage.get(key)
            if usage is None:
                if not self._applies(key) or tokens <= 0:
                    continue
                usage = self._usage[key] = Usage(slot)
            usage.advance(slot)
            usage.add(slot - max(0, age), tokens, requests)

    def active(self) -> dict[Key, int]:
        """Requests in progress here per key, for the other replicas' ``concurrent``."""
        return {key: usage.active for key, usage in self._usage.items() if usage.active > 0}

    def set_active_elsewhere(self, counts: Mapping[Key, int]) -> None:
        """Requests in progress on the other replicas per key, as of their last reports."""
        self._elsewhere = counts

    # ------------------------------------------------------------------ upkeep and metrics

    def prune(self, now: float) -> int:
        """Forget keys with nothing in their window and nothing in progress (users come and
        go); returns how many. O(keys): run it periodically, not per request."""
        slot = int(now // SLOT_S)
        idle = []
        for key, usage in self._usage.items():
            usage.advance(slot)
            if usage.idle():
                idle.append(key)
        for key in idle:
            del self._usage[key]
        return len(idle)

    def used_ratios(self, now: float) -> dict[tuple[str, str], float]:
        """Per (tenant, limit): the share of the limit in use, fleet-wide; for user budgets
        (``user_*`` limits) the most any one user of the tenant uses."""
        slot = int(now // SLOT_S)
        ratios: dict[tuple[str, str], float] = {}
        for name, tenant in self._tenants.items():
            for budget, prefix in ((tenant.budget, ""), (tenant.user_budget, "user_")):
                if budget is None:
                    continue
                for field in ("tokens_per_minute", "requests_per_minute", "concurrent"):
                    if getattr(budget, field) is not None:
                        ratios[(name, prefix + field)] = 0.0
        for key, usage in self._usage.items():
            owner = self._tenants.get(key[0])
            if owner is None:
                continue
            budget = owner.budget if key[1] is None else owner.user_budget
            if budget is None:
                continue
            usage.advance(slot)
            prefix = "" if key[1] is None else "user_"
            for field, used in (
                ("tokens_per_minute", usage.token_sum),
                ("requests_per_minute", usage.request_sum),
                ("concurrent", usage.active + self._elsewhere.get(key, 0)),
            ):
                limit = getattr(budget, field)
                if limit is not None:
                    label = (key[0], prefix + field)
                    ratios[label] = max(ratios[label], used / limit)
        return ratios


def _budgeted(tenant: Tenant) -> bool:
    return tenant.budget is not None or tenant.user_budget is not None


def _share(limit: int, share: float) -> int:
    """The part of ``limit`` a replica enforces alone (all of it while shared)."""
    return limit if share >= 1.0 else max(1, math.floor(limit * share))
