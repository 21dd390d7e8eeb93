"""What ``fairlane up`` does when one of its processes exits: restart it, report it, or stop.

The ext_proc service (the one process, or each replica) is restarted on the same ports with
the same command, after a back-off that doubles from half a second to ten while it keeps
dying, and starts again from half a second once a process has stayed up for 30 s. Meanwhile
Envoy answers every new request itself, at once: 503 ``gateway_unavailable`` with
``retry-after: 1`` (the ext_proc filter is fail-closed); requests already streaming from an
engine do not go through the service and finish. The replicas' Redis is reported and the
stack goes on (the replicas schedule alone until it is back); Envoy or a simulated engine
dying stops the stack.

Plain Python with an injected clock: ``up``'s watch loop asks what to do and when, and
starts the processes itself (:meth:`extproc.ops.processes.ProcessGroup.restart`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path


class Role(Enum):
    """What a child of ``up`` is to the stack."""

    SERVICE = "service"
    """The ext_proc service, or one of its replicas: it keeps nothing Envoy needs to go
    on, so it is restarted."""
    SHARED_STATE = "shared state"
    """The replicas' Redis: they schedule alone while it is away."""
    ESSENTIAL = "essential"
    """Envoy or a simulated engine: the stack stops with it."""


class Action(Enum):
    RESTART = "restart"
    REPORT = "report"
    STOP = "stop"


ACTIONS = {
    Role.SERVICE: Action.RESTART,
    Role.SHARED_STATE: Action.REPORT,
    Role.ESSENTIAL: Action.STOP,
}


def action_for(role: Role) -> Action:
    """What ``up`` does when a child of ``role`` exits."""
    return ACTIONS[role]


@dataclass(frozen=True)
class Backoff:
    """How long to wait before each restart of a process that keeps exiting."""

    first_s: float = 0.5
    factor: float = 2.0
    max_s: float = 10.0
    stable_s: float = 30.0
    """A process that stayed up this long before it exited is restarted after ``first_s``
    again: it was not crashing in a loop."""

    def delay(self, streak: int) -> float:
        """The wait before the ``streak``-th restart in a row (1, 2, ...)."""
        if streak < 1:
            raise ValueError(f"a streak counts from 1, got {streak}")
        # the exponent is capped: the delay reached max_s long before, and a float power
        # of a huge exponent overflows
        return min(self.max_s, self.first_s * self.factor ** min(streak - 1, 64))


@dataclass(frozen=True)
class Restart:
    """A restart decided: which process, the how-manieth restart of it, and when."""

    name: str
    number: int
    """Restarts of this process since ``up`` started, this one included."""
    delay_s: float
    due_at: float


@dataclass
class _Record:
    started_at: float
    streak: int = 0
    restarts: int = 0
    pending: Restart | None = None


@dataclass
class Supervisor:
    """The restart schedule of the processes ``up`` restarts, by name (``service``,
    ``service-r2``): :meth:`exited` when one is found dead, :meth:`due` for the restarts
    to make now, :meth:`started` once the new process runs."""

    backoff: Backoff = field(default_factory=Backoff)
    clock: Callable[[], float] = time.monotonic
    _records: dict[str, _Record] = field(default_factory=dict, repr=False)

    def started(self, name: str) -> None:
        """``name`` runs (first started, or restarted) as of now."""
        record = self._records.get(name)
        now = self.clock()
        if record is None:
            self._records[name] = _Record(started_at=now)
            return
        record.started_at = now
        record.pending = None

    def exited(self, name: str) -> Restart:
        """``name`` was found dead: when to restart it. Asked again before it is
        restarted, the same answer."""
        now = self.clock()
        record = self._records.setdefault(name, _Record(started_at=now))
        if record.pending is not None:
            return record.pending
        if now - record.started_at >= self.backoff.stable_s:
            record.streak = 0
        record.streak += 1
        record.restarts += 1
        delay = self.backoff.delay(record.streak)
        record.pending = Restart(name, record.restarts, delay, now + delay)
        return record.pending

    def waiting(self, name: str) -> bool:
        """Whether ``name`` is dead and waiting for its restart."""
        record = self._records.get(name)
        return record is not None and record.pending is not None

    def due(self) -> list[Restart]:
        """The restarts to make now, earliest first (each stays due until :meth:`started`)."""
        now = self.clock()
        pending = [r.pending for r in self._records.values() if r.pending is not None]
        return sorted((r for r in pending if r.due_at <= now), key=lambda r: r.due_at)

    def next_due_in(self) -> float | None:
        """Seconds until the next pending restart is due (0 if one is), None if none is."""
        pending = [r.pending.due_at for r in self._records.values() if r.pending is not None]
        return None if not pending else max(0.0, min(pending) - self.clock())


def restart_line(label: str, how: str, restart: Restart, log_path: Path, others: bool) -> str:
    """What ``up`` prints when it is about to restart a process: ``fairlane: the service
    exited (signal SIGKILL); restarting it in 0.5 s (restart 1; log: PATH)``, the log being
    the dead process's. ``others``: replicas that still run carry on meanwhile."""
    meanwhile = "; the other replicas carry on" if others else ""
    return (
        f"fairlane: {label} exited ({how}){meanwhile}; restarting it in {restart.delay_s:g} s "
        f"(restart {restart.number}; log: {log_path})"
    )
