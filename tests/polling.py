"""Waiting in a test for what a server does in its own time: poll, bounded, say what."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def until(
    condition: Callable[[], object],
    what: str = "the condition",
    timeout_s: float = 10.0,
    every_s: float = 0.01,
) -> float:
    """Poll ``condition()`` on the running loop every ``every_s`` until it holds; the seconds
    it took. Fails naming ``what`` after ``timeout_s``: a test waits for the state it needs,
    never for a lucky sleep."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(every_s)
    return time.monotonic() - started


async def until_awaited(
    condition: Callable[[], Awaitable[object]],
    what: str = "the condition",
    timeout_s: float = 10.0,
    every_s: float = 0.05,
) -> float:
    """``until`` for a condition that must be awaited (a metric read over HTTP)."""
    started = time.monotonic()
    while not await condition():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(every_s)
    return time.monotonic() - started
