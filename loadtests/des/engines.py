"""The simulator's per-step vLLM engines on the virtual clock.

Each engine is ``loadtests.sim.engine.Engine``, the same model the HTTP simulator serves
and the conformance tests hold against the real vLLM; here it is stepped by the event loop
instead of an asyncio task. A step starts when the engine has work and is not stepping;
its tokens appear at the step's end, when the next step starts. What a scrape would read
(``/metrics``: waiting, running, KV use, inter-token latency) is ``metrics``.

A request's ``sink`` is whoever submitted it (``Watcher``): it hears of the first token and
of the end.
"""

from __future__ import annotations

from typing import Protocol

from extproc.fleet.vllm_metrics import EngineMetrics
from loadtests.des.clock import EventLoop
from loadtests.sim.engine import Engine, EngineConfig, EngineRequest, StepOutput


class Watcher(Protocol):
    def first_token(self, req: EngineRequest, at: float) -> None: ...

    def finished(self, req: EngineRequest, at: float) -> None: ...


class EngineNode:
    """One engine at one address: stepping, scraping, dying and coming back."""

    def __init__(self, loop: EventLoop, address: str, region: str, config: EngineConfig) -> None:
        self.loop = loop
        self.address = address
        self.region = region
        self.config = config
        self.engine = Engine(config)
        self.alive = True
        self.stepping = False
        self.steps = 0
        self.itl_sum_s = 0.0
        self.itl_count = 0
        self.incarnation = 0
        """Bumped when the engine dies: a step event of a dead incarnation is ignored."""

    def submit(self, req: EngineRequest) -> None:
        self.engine.add(req, self.loop.now)
        if not self.stepping:
            self._step(self.incarnation)

    def _step(self, incarnation: int) -> None:
        if incarnation != self.incarnation:
            return
        out = self.engine.step(self.loop.now)
        self.steps += 1
        if not out.num_scheduled_tokens:  # nothing could run (cannot happen with room)
            self.stepping = False
            return
        self.stepping = True
        self.loop.at(out.end, self._step_done, (incarnation, out))

    def _step_done(self, event: tuple[int, StepOutput]) -> None:
        incarnation, out = event
        if incarnation != self.incarnation:
            return
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

    def metrics(self, now: float) -> EngineMetrics:
        """What a scrape of ``/metrics`` at ``now`` reads."""
        engine = self.engine
        return EngineMetrics(
            waiting=float(engine.num_waiting),
            running=float(engine.num_running),
            kv_cache_usage=engine.pool.usage,
            itl_sum_s=self.itl_sum_s,
            itl_count=float(self.itl_count),
            scraped_at=now,
            block_size=self.config.block_size,
            num_gpu_blocks=self.config.num_gpu_blocks,
        )

    def kill(self) -> list[EngineRequest]:
        """The engine dies: everything on it is lost (returned, for Envoy to fail)."""
        engine = self.engine
        lost = list(engine.running) + list(engine.waiting)
        self.alive = False
        self.stepping = False
        self.incarnation += 1
        self.engine = Engine(self.config)
        self.itl_sum_s, self.itl_count = 0.0, 0
        return lost

    def revive(self) -> None:
        """A fresh engine at the same address (empty cache, counters from zero)."""
        self.alive = True
