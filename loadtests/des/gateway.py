"""fairlane's real core, as the simulation drives it, and what each of its calls costs.

Nothing here is a model of the gateway: the policy is parsed from a real file, and every
request goes through ``Gateway.handle``, ``Gateway.resume`` and ``Gateway.completed``
exactly as the servicer calls them; scrapes reach ``Backend.record_scrape`` and
``Admission.dispatch`` as the poller's do; a cancellable request is marked so until its
answer starts, and the requests admission cancels for a more urgent one are answered
``Gateway.preempted`` and aborted on their engine, as the transport and Envoy do. Only the
transport (gRPC, protobuf) is left out. **Decision cost** is the CPU time of those calls
(``time.thread_time_ns``: the simulation is one thread, so other processes do not count),
summed per kind of call; per request, the request-path total over the requests handled.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from extproc.core.admission import Admission, Grant
from extproc.core.decisions import Decision, Forward, Hold, Respond
from extproc.core.events import Completion, RequestInfo
from extproc.core.gateway import Gateway
from extproc.fleet.backend import Backend, BackendPool, BackendSpec
from extproc.fleet.vllm_metrics import EngineMetrics
from extproc.policy import PolicyStore

_clock_ns = time.thread_time_ns
T = TypeVar("T")


def tenant_yaml(names: Sequence[tuple[str, str]]) -> str:
    """The ``tenants:`` section for ``(name, tier)`` pairs; each key is ``sk-NAME``."""
    lines = ["tenants:"]
    for name, tier in names:
        lines.append(f"  - name: {name}\n    api_keys: [sk-{name}]\n    tiers: [{tier}]")
    return "\n".join(lines) + "\n"


def write_policy(base: Path, tenants: Sequence[tuple[str, str]], out: Path) -> Path:
    """``base`` (the default policy) with its ``tenants:`` section replaced by ``tenants``."""
    text = base.read_text()
    start = text.index("\ntenants:")
    rest = text[start + 1 :]
    end = rest.find("\nrules:")
    tail = rest[end + 1 :] if end >= 0 else ""
    out.write_text(text[: start + 1] + tenant_yaml(tenants) + "\n" + tail)
    return out


class Core:
    """The gateway core over a pool of simulated backends, with its CPU cost counted."""

    def __init__(
        self,
        policy_path: Path,
        backends: Sequence[BackendSpec],
        clock: Callable[[], float],
    ) -> None:
        self.store = PolicyStore(policy_path)
        self.pool = BackendPool(backends, clock=clock)
        self.admission = Admission(self.pool, self.store.current)
        ids = itertools.count()
        self.gateway = Gateway(self.store, self.admission, new_request_id=lambda: f"g{next(ids)}")
        self.cpu_ns: Counter[str] = Counter()
        """Kind of call -> CPU nanoseconds spent in it."""
        self.calls: Counter[str] = Counter()

    def _timed(self, kind: str, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)``, its CPU time and one call added to ``kind``'s totals."""
        started = _clock_ns()
        result = call(*args)
        self.cpu_ns[kind] += _clock_ns() - started
        self.calls[kind] += 1
        return result

    # The request path ---------------------------------------------------------------

    def handle(self, info: RequestInfo) -> Decision:
        return self._timed("handle", self.gateway.handle, info)

    def resume(self, hold: Hold, grant: Grant) -> Forward:
        return self._timed("resume", self.gateway.resume, hold, grant)

    def give_up(self, hold: Hold) -> Decision:
        return self._timed("give_up", self.gateway.give_up, hold)

    def completed(self, completion: Completion) -> list[Grant]:
        return self._timed("completed", self.gateway.completed, completion)

    # Preemption, as the transport drives it (``extproc.transport.held``) ----------------

    def cancellable(self, request_id: str) -> None:
        """A forwarded request with a ``cancel_id`` runs: a more urgent one may take its seat."""
        self._timed("cancel", self.admission.cancellable, request_id)

    def settled(self, request_id: str) -> None:
        """Its answer started or it ended: it can no longer be cancelled."""
        self._timed("cancel", self.admission.not_cancellable, request_id)

    def take_preempted(self) -> list[str]:
        """Requests admission cancelled since the last call (their seats are free)."""
        return self.admission.take_preempted()

    def preempted(self, tier: str) -> Respond:
        """The client's answer for a cancelled request (503, retry-after)."""
        return self._timed("cancel", self.gateway.preempted, tier)

    # The poller's side ----------------------------------------------------------------

    def scraped(self, backend: Backend, metrics: EngineMetrics | None) -> None:
        """A scrape's outcome, as the poller records it (None: it failed)."""
        self._timed("scrape", _record_scrape, backend, metrics)

    def dispatch(self) -> list[Grant]:
        """After a scrape round, as the poller's ``on_change``: held requests may go."""
        return self._timed("dispatch", self.admission.dispatch)

    def restart_counting(self) -> None:
        """Count CPU and calls from now on (the end of a warm-up)."""
        self.cpu_ns.clear()
        self.calls.clear()

    def request_path_us(self) -> float:
        """CPU microseconds of the request path per request handled: handling, resuming,
        giving up, completing, the dispatches scrapes trigger (they grant requests), and
        the preemption bookkeeping of cancellable requests."""
        handled = self.calls["handle"]
        if not handled:
            return 0.0
        kinds = ("handle", "resume", "give_up", "completed", "dispatch", "cancel")
        return sum(self.cpu_ns[k] for k in kinds) / handled / 1000


def _record_scrape(backend: Backend, metrics: EngineMetrics | None) -> None:
    """What ``Poller._scrape`` records for one scrape (None: it failed)."""
    if metrics is None:
        backend.scrape_ok = False
    else:
        backend.record_scrape(
            metrics,
            backend.granted_since_scrape,
            backend.completed_since_scrape,
            backend.kv_tokens_since_scrape,
        )


def chat_body(model: str, prompt: str, max_tokens: int, stream: bool) -> bytes:
    """An OpenAI chat body as a client sends it."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    return json.dumps(body, separators=(",", ":")).encode()
