"""Reading on, between requests, the prompts one request's budget stopped.

Matching a prompt against the engines' KV events tokenizes at most ``COLD_CHARS`` of new
text for one request (``extproc.fleet.pieces``); where that stopped short of what an engine
holds, the prompt waits in its tokenizer's ``ReadLater``. This loop reads one piece of it
at a time, every ``READ_LATER_PERIOD_S``, so the event loop is never held for more than a
piece (~0.1-0.3 ms) and a long prompt is whole in the cache within a few tens of
milliseconds, long before the conversation's next turn. It reads nothing while the service
is overloaded (``OverloadControl``): then every CPU millisecond goes to requests, and the
prompts wait, or are read by the requests that meet them again.
"""

from __future__ import annotations

import asyncio

from extproc.core.overload import OverloadControl
from extproc.core.prefix import PromptTokenizer
from extproc.fleet.pieces import PIECE_CHARS

READ_LATER_PERIOD_S = 0.005
"""One piece every 5 ms at most: ~100 KB of prompt text a second, a few per cent of a core
with the tiny model's tokenizer, only while prompts wait."""

IDLE_PERIOD_S = 0.05
"""How often to look while nothing waits (a prompt starts being read within this)."""


async def read_later(
    tokenizer: PromptTokenizer,
    overload: OverloadControl,
    period_s: float = READ_LATER_PERIOD_S,
    chars: int = PIECE_CHARS,
    idle_s: float = IDLE_PERIOD_S,
) -> None:
    """Forever: every ``period_s`` while prompts wait (``idle_s`` while none do), tokenize
    up to ``chars`` of them."""
    while True:
        await asyncio.sleep(period_s if len(tokenizer.later) else idle_s)
        if not overload.overloaded:
            tokenizer.later.read(chars)
