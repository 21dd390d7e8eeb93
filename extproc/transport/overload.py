"""The overload control's measurements: how far behind the service is.

Two delays say it, and the control (``extproc.core.overload``) takes the larger of the two
once a period: **how old a request is when the service decides it** (Envoy stamps each
request's arrival, the servicer compares it with its own clock; past capacity, new streams
wait unread in the socket while the event loop stays on time: Python cannot count that
backlog, but it can see its age; across hosts this includes the clocks' skew, a millisecond or
two with NTP), and **the event loop's lag** (how late a timer fires: a stall of the loop
itself, which delays every stream at once). The fraction the control returns is published in
the runtime layer Envoy reads (``transport.runtime``), so Envoy starts or stops turning
requests away within milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
from time import process_time

from extproc.core.overload import OverloadControl
from extproc.transport.runtime import RuntimeLayer
from extproc.wire import SHED_RUNTIME_KEY

log = logging.getLogger("fairlane.overload")

PROBE_S = 0.005


class Ages:
    """How old requests were at decision, over one control period: their mean."""

    __slots__ = ("_count", "_total_s")

    def __init__(self) -> None:
        self._count = 0
        self._total_s = 0.0

    def observe(self, seconds: float) -> None:
        self._count += 1
        self._total_s += seconds

    def take_mean(self) -> float:
        """The mean since the last call (0 when there was none), and reset."""
        mean = self._total_s / self._count if self._count else 0.0
        self._count, self._total_s = 0, 0.0
        return mean


async def watch_overload(
    control: OverloadControl,
    layer: RuntimeLayer,
    ages: Ages,
    probe_s: float = PROBE_S,
) -> None:
    """Forever (cancel to stop): sample the loop's lag, run the control once a period on
    the larger of its worst lag and the requests' mean age at decision (and the share of a
    core the process used), publish the fraction."""
    loop = asyncio.get_running_loop()
    layer.publish(SHED_RUNTIME_KEY, 0)
    ages.take_mean()
    period_start = loop.time()
    cpu_start = process_time()
    worst = 0.0
    while True:
        due = loop.time() + probe_s
        await asyncio.sleep(probe_s)
        now = loop.time()
        worst = max(worst, now - due)
        if now - period_start >= control.settings.period_s:
            was_overloaded, before = control.overloaded, control.shed_fraction
            behind = max(worst, ages.take_mean())
            cpu = process_time()
            busy = (cpu - cpu_start) / (now - period_start)
            shed = control.period(behind, busy)
            if control.overloaded and not was_overloaded:
                log.warning(
                    "overloaded (%.0f ms behind, %.0f %% of a core busy): refusing the least "
                    "urgent tier; Envoy turns away %.0f %% of new requests",
                    behind * 1000,
                    busy * 100,
                    shed * 100,
                )
            elif was_overloaded and not control.overloaded:
                log.info("caught up: nothing is turned away for overload any more")
            elif shed != before:
                log.debug("%.0f ms behind: Envoy turns away %.0f %%", behind * 1000, shed * 100)
            layer.publish(SHED_RUNTIME_KEY, round(shed * 100))
            period_start, cpu_start, worst = now, cpu, 0.0
