"""Drives the engine on the wall clock, optionally sped up.

Simulated time is ``(loop.time() - t0) * speedup``. One task loops: take a step at the
current simulated time, sleep (in wall time) until the step's simulated end, then hand the
step's tokens out. Requests that arrive while a step "runs on the GPU" join the next step,
as in vLLM. If Python falls behind (an overloaded machine), the next step starts late
rather than early: latencies grow, they never shrink.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from loadtests.sim.engine import Engine, EngineRequest, StepOutput

Sink = Callable[[EngineRequest], None]


class Runner:
    """Owns the engine loop task; ``submit``/``abort`` are the only ways in."""

    def __init__(
        self,
        engine: Engine,
        speedup: float = 1.0,
        on_step: Callable[[StepOutput], None] | None = None,
    ) -> None:
        if speedup <= 0:
            raise ValueError("speedup must be positive")
        self.engine = engine
        self.speedup = speedup
        self._on_step = on_step
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._step_end = 0.0

    def now(self) -> float:
        """Current simulated time in seconds."""
        return (asyncio.get_running_loop().time() - self._t0) * self.speedup

    def start(self) -> None:
        self._t0 = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._loop(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def submit(self, req: EngineRequest) -> None:
        """Queue ``req``; ``req.sink(req)`` is called for every token it produces."""
        self.engine.add(req, self.now())
        self._wakeup.set()

    def abort(self, req: EngineRequest) -> bool:
        """Abort ``req`` (client went away); returns False if it had already finished."""
        return self.engine.abort(req, self.now())

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        while True:
            if not engine.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            start = max(self.now(), self._step_end)
            out = engine.step(start)
            self._step_end = out.end
            delay = self._t0 + out.end / self.speedup - loop.time()
            # Always yield once so arrivals and writes interleave with an empty step.
            await asyncio.sleep(max(delay, 0.0))
            self._deliver(out)

    def _deliver(self, out: StepOutput) -> None:
        # Requests aborted while their step was "on the GPU" get nothing from it.
        out.outputs = [r for r in out.outputs if r.finish_reason != "abort"]
        if self._on_step is not None:
            self._on_step(out)
        for req in out.outputs:
            if req.sink is not None:
                try:
                    req.sink(req)
                except Exception:  # one broken client must not stop the engine
                    if req.finish_reason is None:
                        self.abort(req)
