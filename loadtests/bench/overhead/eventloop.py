"""The overhead measurement's event loop: uvloop, whose timers and sockets cost less."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on uvloop (the generator's timers and sockets are cheaper there)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(coro)
    return uvloop.run(coro)
