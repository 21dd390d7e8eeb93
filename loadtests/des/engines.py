"""The simulator's per-step vLLM engines on the virtual clock.

Each engine is ``loadtests.sim.engine.Engine``, the same model the HTTP simulator serves and
the conformance tests hold against the real vLLM; here the event loop steps it instead of an
asyncio task. A step starts when the engine has work and is not stepping; its tokens appear at
the step's end. What a scrape would read is ``metrics``, and a request's ``sink`` (a
``Watcher``) hears of its first token and its end. Most steps of a busy engine are alike, so
when a step would start such a stretch, the node schedules a single event at its end
(``loadtests.sim.fastforward``) instead of one per step; an arrival, a scrape or an abort in
the middle sees what the per-step loop would have shown then, so a run with
``fast_forward=False`` gives the same per-request times up to float rounding
(``tests/loadtests/des/test_des.py``). ``EngineNode`` has the rules.
"""

from __future__ import annotations

from typing import Protocol

from extproc.fleet.vllm_metrics import EngineMetrics
from loadtests.des.clock import EventLoop
from loadtests.sim.engine import Engine, EngineConfig, EngineRequest, StepOutput
from loadtests.sim.fastforward import DecodeRun, RunViewer, advance, decode_run

MIN_RUN_STEPS = 2
"""Shorter decode runs are stepped: one skipped step saves nothing over one step event."""


class Watcher(Protocol):
    def first_token(self, req: EngineRequest, at: float) -> None: ...

    def finished(self, req: EngineRequest, at: float) -> None: ...


class EngineNode:
    """One engine at one address: stepping, scraping, dying and coming back.

    **Fast-forward.** Most steps of a busy engine are alike: every running request decodes one
    token, nothing can be admitted (nothing waits, or every seat is taken), nothing finishes.
    Such a stretch is arithmetic (``loadtests.sim.fastforward``), so when a step would start
    one, the node schedules a single event at the stretch's end (the step before a request
    finishes or runs short of KV blocks) instead of one event per step. Two things can happen
    inside the stretch, and both see what the per-step loop would have shown at that instant:

    - a new request arrives (``submit``) while a seat is free: the stretch is applied up to the
      step in progress (it has already taken its blocks), the tokens of the steps that ended are
      counted, the step in progress ends at its own time and the next step admits the newcomer,
      exactly as ``Engine.step`` would have. With every seat taken the newcomer only waits, and
      the stretch goes on;
    - a scrape reads ``/metrics``: it is answered from ``fastforward.RunViewer`` (running, KV
      use after the step in progress, inter-token latency of the ended steps) and the stretch
      goes on uncut, so scrape rounds do not bound the jump.

    An abort (the gateway preempted a batch request) cuts the stretch as an arrival does; the
    engine dying ends it with the engine. Nothing else reaches an engine between its events.
    """

    def __init__(
        self,
        loop: EventLoop,
        address: str,
        region: str,
        config: EngineConfig,
        fast_forward: bool = True,
    ) -> None:
        self.loop = loop
        self.fast_forward = fast_forward
        self.address = address
        self.region = region
        self.config = config
        self.engine = Engine(config)
        self.alive = True
        self.stepping = False
        self.steps = 0
        self.itl_sum_s = 0.0
        self.itl_count = 0
        self.skipped = 0
        """Of ``steps``, those the fast-forward took without ``Engine.step``."""
        self.incarnation = 0
        """Bumped when the engine dies: a step event of a dead incarnation is ignored."""
        self._run: DecodeRun | None = None
        """The decode stretch in progress (fast-forward), started at ``_run_start``."""
        self._run_start = 0.0
        self._run_token = 0
        """Bumped when a stretch ends early, so that its end event is ignored."""
        self._step_out: StepOutput | None = None
        """The ``Engine.step`` in progress: its tokens, last ones included, are not out yet."""
        self._viewer: RunViewer | None = None
        """The stretch's viewer, built at its first scrape (most stretches see several)."""

    def submit(self, req: EngineRequest) -> None:
        if self._run is not None and self.engine.num_running < self.config.max_num_seqs:
            # It will be admitted at the next step. With every seat taken it only waits and
            # the stretch goes on (``decode_run`` allows a waiting request then).
            self._cut_run()
        self.engine.add(req, self.loop.now)
        if not self.stepping:
            self._step(self.incarnation)

    def abort(self, req: EngineRequest) -> None:
        """Envoy reset the request upstream (the gateway cancelled it): the engine drops it
        and frees its seat and blocks (``Engine.abort``); a step in progress still ends at
        its time. Inside a stretch the stretch is cut first, as for an arrival."""
        if req.finish_reason is not None:
            return
        if self._run is not None and req in self.engine.running:
            self._cut_run()
        self.engine.abort(req, self.loop.now)

    def _step(self, incarnation: int) -> None:
        if incarnation != self.incarnation:
            return
        now = self.loop.now
        if self.fast_forward:
            run = decode_run(self.engine)
            if run is not None and run.max_steps >= MIN_RUN_STEPS:
                self._run, self._run_start, self._viewer = run, now, None
                self._run_token += 1
                self.stepping = True
                end = run.end_of(run.max_steps, now)
                self.loop.at(end, self._run_done, (incarnation, self._run_token))
                return
        out = self.engine.step(now)
        self.steps += 1
        if not out.num_scheduled_tokens:  # nothing could run (cannot happen with room)
            self.stepping = False
            return
        self.stepping = True
        self._step_out = out
        self.loop.at(out.end, self._step_done, (incarnation, out))

    def _step_done(self, event: tuple[int, StepOutput]) -> None:
        incarnation, out = event
        if incarnation != self.incarnation:
            return
        self._step_out = None
        at = out.end
        for req in out.outputs:
            sink: Watcher = req.sink
            if req.num_output == 1:
                sink.first_token(req, at)
            elif req.prev_token_at is not None:
                self.itl_sum_s += at - req.prev_token_at
                self.itl_count += 1
            if req.finish_reason is not None:
                sink.finished(req, at)
        if self.engine.has_work:
            self._step(incarnation)
        else:
            self.stepping = False

    def _run_done(self, event: tuple[int, int]) -> None:
        """The stretch ran to its end uncut: apply it whole, then step as usual (the next
        step finishes a request or needs a block the pool may not have)."""
        incarnation, token = event
        run = self._run
        if incarnation != self.incarnation or token != self._run_token or run is None:
            return
        self._run = None
        done = advance(self.engine, run, self._run_start, run.max_steps)
        self._count(done.steps, done.itl_sum_s, done.itl_count)
        self._step(incarnation)  # the running requests are still there: there is work

    def _cut_run(self) -> None:
        """End the stretch now, where the per-step loop would be: the steps that ended are
        applied and counted, the one in progress is applied and ends at its own time."""
        run = self._run
        assert run is not None
        self._run = None
        self._run_token += 1
        seen = self._view(run).at(self.loop.now)
        done = advance(self.engine, run, self._run_start, seen.applied)
        self._count(seen.ended, seen.itl_sum_s, seen.itl_count)
        tail = (
            self.incarnation,
            done.steps - seen.ended,
            done.itl_sum_s - seen.itl_sum_s,
            done.itl_count - seen.itl_count,
        )
        self.loop.at(done.end, self._tail_done, tail)

    def _tail_done(self, event: tuple[int, int, float, int]) -> None:
        """The step in progress when a stretch was cut has ended: its tokens are out."""
        incarnation, steps, itl_sum, itl_count = event
        if incarnation != self.incarnation:
            return
        self._count(steps, itl_sum, itl_count)
        if self.engine.has_work:
            self._step(incarnation)
        else:
            self.stepping = False

    def _view(self, run: DecodeRun) -> RunViewer:
        """The viewer of the stretch in progress (``run``), built once per stretch."""
        viewer = self._viewer
        if viewer is None or viewer.run is not run:
            viewer = self._viewer = RunViewer(self.engine, run, self._run_start)
        return viewer

    def _count(self, steps: int, itl_sum_s: float, itl_count: int) -> None:
        """Fast-forwarded steps' tokens became visible: what ``_step_done`` counts per step."""
        self.steps += steps
        self.skipped += steps
        self.itl_sum_s += itl_sum_s
        self.itl_count += itl_count

    def metrics(self, now: float) -> EngineMetrics:
        """What a scrape of ``/metrics`` at ``now`` reads (inside a fast-forwarded stretch,
        what the per-step engine would show then, without cutting the stretch)."""
        engine = self.engine
        pool = engine.pool
        kv_cache_usage = pool.usage
        itl_sum_s, itl_count = self.itl_sum_s, self.itl_count
        if self._run is not None:
            seen = self._view(self._run).at(now)
            kv_cache_usage = 1.0 - seen.num_free / pool.num_blocks
            itl_sum_s += seen.itl_sum_s
            itl_count += seen.itl_count
        return EngineMetrics(
            waiting=float(engine.num_waiting),
            running=float(engine.num_running),
            kv_cache_usage=kv_cache_usage,
            itl_sum_s=itl_sum_s,
            itl_count=float(itl_count),
            scraped_at=now,
            block_size=self.config.block_size,
            num_gpu_blocks=self.config.num_gpu_blocks,
        )

    def kill(self) -> list[EngineRequest]:
        """The engine dies: everything on it is lost (returned, for Envoy to fail), the
        requests the step in progress finished too: the engine let go of them when the step
        began, but their last tokens never left it."""
        engine = self.engine
        lost = list(engine.running) + list(engine.waiting)
        if self._step_out is not None:
            lost += [r for r in self._step_out.outputs if r.finish_reason in ("stop", "length")]
            self._step_out = None
        self.alive = False
        self.stepping = False
        self._run = None
        self.incarnation += 1
        self.engine = Engine(self.config)
        self.itl_sum_s, self.itl_count = 0.0, 0
        return lost

    def revive(self) -> None:
        """A fresh engine at the same address (empty cache, counters from zero)."""
        self.alive = True
