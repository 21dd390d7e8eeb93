"""How much traffic to turn away when the service itself is the bottleneck.

The engines' capacity is admission's business; this is about the service's own CPU. Past its
capacity, requests queue inside grpc and the event loop, every decision gets slower, and
Envoy's message timeouts end them with errors after seconds. Refusing inside the service does
not fix that (a refusal still costs a stream, about half a decision), so the service asks
Envoy to turn away a fraction of new requests before they reach it (a runtime value,
``extproc.transport.runtime``), and itself refuses the least urgent tier while overloaded.
Envoy is blind to tiers and the commonest overload is a batch flood, so the least urgent tier
goes first, and Envoy turns requests away only when that tier is too small a share of the
service's work for refusing it to help: a batch flood never makes Envoy turn chat away.

``OverloadControl`` has the control rule. Plain arithmetic with no clock or I/O: the
transport measures how far behind the service is and calls ``period``.
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
    max_least_urgent_share: float = 0.5
    """Envoy turns requests away only while the least urgent tier was less than this share
    of the service's work in the period (``OverloadControl.handled``)."""


class OverloadControl:
    """The fraction of new requests Envoy turns away, recomputed once a period.

    The work counted is every message the service handles for a request: its decision, and for a
    held one its grant, and its completion. Decisions alone are not the work: when many held batch
    requests complete together, each completion is a release, a grant and a forward, while the only
    new decisions are chat's (docs/benchmarks/internals.md, ``flood-256seat``).

    The signal is how far behind the service is (``extproc.transport.overload`` measures it: how
    old requests are when it decides them, and how late its event loop's timers fire), and how busy
    it was. Once per control period, on how far behind it was in it:

    * above ``high_lag_s`` for two periods in a row, or above twice it in one: overloaded; let
      through less, in proportion to how far behind (twice the bound: half as much, at most
      ``max_cut`` less and at least ``min_step`` more turned away), so a sudden flood is cut in a
      period or two and its backlog drains. One period a little over the bound is a hiccup (a
      collection, the machine's other processes), not overload;
    * below ``low_lag_s``: recovering; turn away ``recover_step`` less;
    * in between: unchanged, so the fraction settles where the service just keeps up instead of
      oscillating around it.

    Only a service that is busy can be overloaded by requests. One that falls behind while it uses
    little CPU (``min_busy``) is starved by something else on its machine (an engine on the same
    cores, a CPU limit): turning requests away would not give it time back, only lose them, so then
    the fraction falls as if it had caught up.
    """

    def __init__(self, settings: OverloadSettings = OverloadSettings()) -> None:
        self.settings = settings
        self.shed_fraction = 0.0
        self.last_lag_s = 0.0
        self.behind = False
        """Behind and busy since the last time it caught up: the least urgent tier is
        refused."""
        self._handled = 0
        self._least_urgent = 0
        self._lagged = False
        """The last period was over ``high_lag_s`` (while busy)."""

    @property
    def overloaded(self) -> bool:
        """The service refuses its least urgent tier (and Envoy may turn requests away)."""
        return self.behind or self.shed_fraction > 0.0

    def handled(self, least_urgent: bool) -> None:
        """The service handled a message of a request of its policy's least urgent tier (of
        several), or of another: its decision, the grant of a held one, its completion."""
        self._handled += 1
        self._least_urgent += least_urgent

    def period(self, lag_s: float, busy: float = 1.0) -> float:
        """One control period, given how far behind the service was in it and the share of
        a core it used: the new fraction Envoy turns away."""
        s = self.settings
        self.last_lag_s = lag_s
        share = self._least_urgent / self._handled if self._handled else 0.0
        self._handled = self._least_urgent = 0
        shed = self.shed_fraction
        over = lag_s > s.high_lag_s and busy >= s.min_busy
        lagged_before, self._lagged = self._lagged, over
        if over and (lagged_before or self.behind or lag_s > 2 * s.high_lag_s):
            self.behind = True
            if share < s.max_least_urgent_share:
                let_through = (1.0 - shed) * max(1.0 - s.max_cut, s.high_lag_s / lag_s)
                shed = min(s.max_shed, max(shed + s.min_step, 1.0 - let_through))
            else:  # refusing the least urgent tier is the relief
                shed = max(0.0, shed - s.recover_step)
        elif over:
            pass  # the first period over the bound: wait for the next to confirm it
        elif lag_s < s.low_lag_s or busy < s.min_busy:
            shed = max(0.0, shed - s.recover_step)
            self.behind = shed > 0.0
        self.shed_fraction = shed
        return shed
