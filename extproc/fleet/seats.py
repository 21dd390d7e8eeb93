"""How many requests a backend runs at once: its seats, learned from the engine itself.

vLLM runs at most ``--max-num-seqs`` requests per step and never preempts a running one to
seat a waiting one of higher priority (only when KV blocks run out). A chat request gets its
first token quickly only if it finds a seat free, and the gateway can keep one free only if
it knows how many there are. vLLM does not export ``max_num_seqs``, so the gateway learns it
from what the engine does: requests waiting while the KV cache still has room mean every seat
is taken, so the running count is the seat count (confirmed over several steps); more running
than thought raises the count at once; a restarted engine is learned again. Until then the
estimate grows a step past the most it was seen running, so learning costs one step of
over-commitment per engine start. A count declared in the deployment wins over any
observation. ``Seats`` has the rules. Pure state fed by scrapes: no I/O, no clock,
unit-tested without sockets.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from extproc.fleet.vllm_metrics import EngineMetrics

log = logging.getLogger("fairlane.seats")

KV_BOUND = 0.9
"""KV-cache use at or above which waiting requests are blamed on KV, not on seats."""
STEPS_TO_CONFIRM = 2
"""Engine steps (decode tokens of every running request) that must pass with requests
waiting, KV room and the same running count before that count is learned. Scrapes alone
would not do: two scrapes inside one long step (a prefill) see the same moment, and a queue
that only waits for the step's token budget (chunked prefill) is admitted in the next."""
FALLBACK_SEATS = 1
"""Seats assumed for a backend that declares none and has not shown its limit yet: the
fewest an engine can have, so an unknown engine is never over-committed by more than one
probing step (``probe``)."""

SeatSource = Literal["declared", "learned", "fallback"]
"""Where a backend's seat count comes from: a bounded metric label."""


@dataclass(slots=True)
class Seats:
    """One backend's seat count: declared, learned from its scrapes, or the fallback.

    How the count is learned:

    - **Seat-bound scrape**: requests wait (``vllm:num_requests_waiting > 0``) while the KV
      cache still has room (usage below ``KV_BOUND``). The engine would have scheduled them if
      it had a seat, so the running count is the seat count. One such scrape can be a request
      caught between its arrival and the next step, or a queue waiting for the step's token
      budget (chunked prefill), so the same running count must hold, with the queue, over
      ``STEPS_TO_CONFIRM`` engine steps (counted from the decode tokens it produced, the ITL
      histogram's count: an engine whose ``/metrics`` lacks it stays on the estimate below
      unless its seats are declared). A prompt longer than several steps' budget can still fool
      it; the count is then raised as soon as the engine runs more (below). A KV-bound scrape
      (usage at or above ``KV_BOUND``) says nothing about seats: the KV gate handles that limit.
    - **More running than thought**: a scrape with more running than the learned count raises it
      at once (the engine proved it has those seats).
    - **A restarted engine** (its counters went backwards, or its ``cache_config_info`` changed)
      may have other flags: what was learned is forgotten and learned again.

    Until a count is learned (and when none is declared), the backend gets ``fallback`` seats
    (one), raised to a little more than the most it was ever seen running (``probe``: one more,
    or a quarter more on big engines): as the gateway fills an engine whose size it does not
    know, the estimate grows a step per scrape until the engine shows a queue, which teaches the
    real number. Learning costs that one step of over-commitment, once per engine start: a few
    requests wait inside vLLM, and chat that arrives before they drain may wait for a seat
    (declare ``seats`` to avoid even that). An engine that never shows a queue stays on the
    estimate, which follows what it demonstrably runs: neither nothing nor everything.
    """

    declared: int | None = None
    fallback: int = FALLBACK_SEATS
    learned: int | None = None
    peak_running: int = 0
    """The most requests the engine was seen running since it (re)started."""
    _candidate: int | None = field(default=None, repr=False)
    _tokens_at: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if self.declared is not None and self.declared < 1:
            raise ValueError(f"declared seats must be >= 1, got {self.declared}")
        if self.fallback < 1:
            raise ValueError(f"fallback seats must be >= 1, got {self.fallback}")

    @property
    def count(self) -> int:
        """The seats admission plans with."""
        if self.declared is not None:
            return self.declared
        if self.learned is not None:
            return self.learned
        return max(self.fallback, probe(self.peak_running))

    @property
    def source(self) -> SeatSource:
        if self.declared is not None:
            return "declared"
        return "learned" if self.learned is not None else "fallback"

    def observe(self, previous: EngineMetrics | None, current: EngineMetrics) -> bool:
        """Learn from one scrape (``previous``: the scrape before it). True when ``count``
        changed, so admission can re-plan."""
        before = self.count
        if previous is not None and restarted(previous, current):
            self.forget()
        running = round(current.running)
        self.peak_running = max(self.peak_running, running)
        if self.learned is not None and running > self.learned:
            self.learned = running
        tokens = current.itl_count  # None without the ITL histogram: no steps to count
        seat_bound = current.waiting > 0 and current.kv_cache_usage < KV_BOUND
        if seat_bound and running > 0 and tokens is not None:
            if running != self._candidate:
                self._candidate, self._tokens_at = running, tokens
            # Full decode steps since the queue was first seen with this running count:
            # the engine scheduled again and again and still admitted nobody.
            steps = (tokens - self._tokens_at) / running
            confirmed = steps >= STEPS_TO_CONFIRM
            if confirmed and (self.learned is None or running > self.learned):
                self.learned = running
        else:
            self._candidate = None
        return self.count != before

    def forget(self) -> None:
        """The engine restarted: what it showed before says nothing about it now."""
        self.learned = None
        self.peak_running = 0
        self._candidate = None


def probe(peak_running: int) -> int:
    """The seats to plan with for an engine seen running ``peak_running`` at most and never
    queueing: one more (a quarter more past 8), so a 256-seat engine is found in about 20
    steps while a small one is over-committed by one request at most."""
    return peak_running + max(1, peak_running // 4)


def restarted(previous: EngineMetrics, current: EngineMetrics) -> bool:
    """Whether two scrapes of one address come from different engine processes: cumulative
    counters went backwards, or the KV cache was configured differently. A page without the
    ITL histogram has no counters to compare."""
    for before, now in (
        (previous.itl_count, current.itl_count),
        (previous.itl_sum_s, current.itl_sum_s),
    ):
        if before is not None and now is not None and now < before:
            return True
    return (previous.block_size, previous.num_gpu_blocks) != (
        current.block_size,
        current.num_gpu_blocks,
    ) and None not in (previous.num_gpu_blocks, current.num_gpu_blocks)
