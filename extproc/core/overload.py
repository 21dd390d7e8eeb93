"""How much traffic to turn away when the service itself is the bottleneck.

The engines' capacity is admission's business; this is about the service's own CPU. Every
request costs the service a gRPC stream and a decision, so past its capacity requests queue
inside grpc and the event loop, every decision gets slower, and Envoy's message timeouts
end them with errors after seconds. Turning requests away inside the service does not fix
that: a refusal still costs a stream, about half of a full decision. So the service asks
Envoy to turn away a fraction of new requests before they reach it (a runtime value Envoy
reads on every request, see ``extproc.transport.runtime``), and itself refuses the least
urgent tier while it is overloaded.

The signal is how far behind the service is (``extproc.transport.overload`` measures it:
how old requests are when it decides them, and how late its event loop's timers fire), and
how busy it was. Once per control period, on how far behind it was in it:

* above ``high_lag_s``: overloaded; let through less, in proportion to how far behind
  (twice the bound: half as much, at most ``max_cut`` less and at least ``min_step``
  more turned away), so a sudden flood is cut in a period or two and its backlog drains;
* below ``low_lag_s``: recovering; turn away ``recover_step`` less;
* in between: unchanged, so the fraction settles where the service just keeps up instead
  of oscillating around it.

Only a service that is busy can be overloaded by requests. One that falls behind while it
uses little CPU (``min_busy``) is starved by something else on its machine (an engine on
the same cores, a CPU limit): turning requests away would not give it time back, only lose
them, so then the fraction falls as if it had caught up.

Plain arithmetic with no clock or I/O: the transport measures and calls ``period``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OverloadSettings:
    period_s: float = 0.05
    """How often the fraction is recomputed, from what was measured since the last time."""
    high_lag_s: float = 0.040
    """Behind by more than this (and busy): overloaded. Under the 50 ms a refused request
    may wait for its answer, and above the queueing of a service busy at its capacity with
    a few dozen concurrent requests (32 at ~1,200 a second wait ~25 ms), which is load, not
    overload."""
    low_lag_s: float = 0.010
    """Behind by less than this: recovered enough to let more requests in."""
    max_cut: float = 0.25
    """While overloaded, let through at most this share less per period."""
    min_step: float = 0.05
    max_shed: float = 0.95
    """Never turn away everything: some requests must reach the service so that it can
    see the load fall."""
    min_busy: float = 0.5
    """The least share of a core the service must have used in the period to count as
    overloaded (its decisions run on one thread: at capacity it uses about one core)."""
    recover_step: float = 0.05
    """Per period: from the largest fraction to none in a second."""


class OverloadControl:
    """The fraction of new requests Envoy turns away, recomputed once a period."""

    def __init__(self, settings: OverloadSettings = OverloadSettings()) -> None:
        self.settings = settings
        self.shed_fraction = 0.0
        self.last_lag_s = 0.0

    @property
    def overloaded(self) -> bool:
        """While anything is turned away, the service refuses its least urgent tier too."""
        return self.shed_fraction > 0.0

    def period(self, lag_s: float, busy: float = 1.0) -> float:
        """One control period, given how far behind the service was in it and the share of
        a core it used: the new fraction."""
        s = self.settings
        self.last_lag_s = lag_s
        shed = self.shed_fraction
        if lag_s > s.high_lag_s and busy >= s.min_busy:
            let_through = (1.0 - shed) * max(1.0 - s.max_cut, s.high_lag_s / lag_s)
            shed = min(s.max_shed, max(shed + s.min_step, 1.0 - let_through))
        elif lag_s < s.low_lag_s or busy < s.min_busy:
            shed = max(0.0, shed - s.recover_step)
        self.shed_fraction = shed
        return shed
