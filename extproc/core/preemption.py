"""Requests the gateway may still cancel while they run, to seat a more urgent one.

vLLM 0.32 never preempts a running request for a waiting one when its seats are full
(vLLM #40004): a chat request sent to an engine full of batch waits seconds for a batch
request to finish, and keeping seats idle for chat (``extproc.core.reservations``) costs
batch those seats. A non-streamed request of a ``preemptible`` tier has sent its client
nothing yet, so the gateway can cancel it instead: Envoy resets it upstream (vLLM aborts it)
and the client gets a 503 with ``retry-after`` before any byte of the answer. Lending a
reserve to cancellable batch trades an idle seat (1/S of an engine of S seats) for a re-sent
prefill that stalls all S, so it pays only on small engines: up to ``LEND_MAX_SEATS`` seats
(docs/benchmarks/internals.md, the flood scenarios' A/B).

This module only keeps the bookkeeping, free of I/O: which in-flight requests the transport
can cancel, per backend, in the order they were sent. The victim is on the backend the urgent
request goes to, of the least urgent tier there, the newest: the least work lost.
"""

from __future__ import annotations

from collections import Counter

LEND_MAX_SEATS = 16
"""The biggest engine (seats) whose cancellable requests may use a reserve's seats."""


class Cancellable:
    """Per backend, the in-flight requests that can be cancelled, oldest first, with their
    tier's rank (lower = more urgent)."""

    __slots__ = ("_by_backend", "_lends", "_lent_by_rank", "_where")

    def __init__(self) -> None:
        self._by_backend: dict[str, dict[str, int]] = {}
        self._where: dict[str, str] = {}
        self._lent_by_rank: Counter[int] = Counter()
        self._lends: set[str] = set()

    def __len__(self) -> int:
        return len(self._where)

    def add(self, backend: str, request_id: str, rank: int, lends: bool = True) -> None:
        """``request_id``, of a tier of ``rank``, runs on ``backend`` and can be cancelled;
        ``lends``: its seat may count towards a more urgent tier's reserve (``spare``)."""
        self.discard(request_id)
        self._by_backend.setdefault(backend, {})[request_id] = rank
        self._where[request_id] = backend
        if lends:
            self._lends.add(request_id)
            self._lent_by_rank[rank] += 1

    def discard(self, request_id: str) -> None:
        """It finished, or can no longer be cancelled (its answer has started)."""
        backend = self._where.pop(request_id, None)
        if backend is None:
            return
        running = self._by_backend[backend]
        rank = running.pop(request_id)
        if request_id in self._lends:
            self._lends.discard(request_id)
            self._lent_by_rank[rank] -= 1
        if not running:
            del self._by_backend[backend]

    def on(self, backend: str) -> int:
        """How many can be cancelled on ``backend``."""
        return len(self._by_backend.get(backend, ()))

    def victim(self, backend: str, rank: int) -> str | None:
        """The request on ``backend`` to cancel for one of ``rank``, or None: of the least
        urgent tier there below ``rank`` (batch before api), the newest."""
        running = self._by_backend.get(backend)
        if not running:
            return None
        chosen, chosen_rank = None, rank
        for request_id in reversed(running):
            if running[request_id] > chosen_rank:
                chosen, chosen_rank = request_id, running[request_id]
        return chosen

    def counts(self) -> dict[str, dict[int, int]]:
        """Backend -> rank -> how many can be cancelled there: what the other replicas need
        to ask this one for a seat (``extproc.core.peers.PreemptAsk``)."""
        counts: dict[str, dict[int, int]] = {}
        for backend, running in self._by_backend.items():
            ranks = counts[backend] = {}
            for rank in running.values():
                ranks[rank] = ranks.get(rank, 0) + 1
        return counts

    def spare(self, rank: int) -> int:
        """Seats that requests of tiers at ``rank`` or less urgent hold and would give up to
        any more urgent tier: the seats a reserve for that tier may count as its own (those
        added with ``lends``)."""
        return sum(n for r, n in self._lent_by_rank.items() if r >= rank)
