"""The loop that reads on, between requests, what budgets left unread
(extproc.transport.read_later), with the simulator's tokenizer."""

from __future__ import annotations

import asyncio

import pytest

from extproc.core.overload import OverloadControl
from extproc.core.prompt import BuiltinTokenizer
from extproc.transport.read_later import read_later
from tests.polling import until

TEXT = " ".join(f"kaloto{n} the generation" for n in range(800))


class Watched(OverloadControl):
    """Counts the loop's questions: it asks whether the service is overloaded once a period."""

    asked = 0

    @property
    def overloaded(self) -> bool:
        self.asked += 1
        return super().overloaded


async def test_waiting_prompts_are_read_a_piece_a_period_and_not_while_overloaded() -> None:
    tokenizer = BuiltinTokenizer()
    pieces = tokenizer.body_pieces({"prompt": TEXT})
    assert pieces is not None
    list(pieces.pieces)
    assert len(tokenizer.later) == 1
    overload = Watched()
    overload.behind = True  # overloaded: requests first
    task = asyncio.create_task(read_later(tokenizer, overload, period_s=0.001, idle_s=0.001))
    try:
        misses = tokenizer.cache.misses
        await until(lambda: overload.asked >= 20, "twenty periods while overloaded", 5.0, 0.002)
        assert tokenizer.cache.misses == misses and len(tokenizer.later) == 1
        overload.behind = False
        await until(lambda: len(tokenizer.later) == 0, "the waiting prompt read", 5.0, 0.002)
        assert tokenizer.cache.misses > misses + 2  # several pieces, one per period
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
