"""Which queued request takes the room an engine freed: the one whose prompt it holds.

On a saturated fleet requests wait here, and room appears one engine at a time. The oldest
request of the flow whose turn it is seldom has its prefix on that engine: it pays its whole
prefill there, over someone else's cache, while a later request of the same flow whose
conversation lives there waits for other room. So among the flow's few oldest
(``extproc.core.scheduler.Lookahead``) the one that reuses the most of the engines' caches
goes first. The flow is charged the same, and no request is passed over more than the
window's size times. Measured on ``shared-prefix``: docs/benchmarks/prefix-routing.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from extproc.core.picker import prefix_share
from extproc.core.prefix import PromptBlocks
from extproc.core.scheduler import Entry
from extproc.fleet.backend import Backend

FEW_ENGINES = 4
"""Look past the oldest only when at most this many engines may take it. With more room the
oldest's own pick finds its prefix among them (``extproc.core.picker``), and scoring every
request of the window on every engine would cost more than it saves."""


class Prompts:
    """The block hashes of queued requests, kept from the dispatch that scored them to their
    grant; the least recently used go first beyond ``limit`` (a request that left the queue
    another way is never asked for again)."""

    def __init__(self, limit: int = 1024) -> None:
        self._prompts: OrderedDict[str, PromptBlocks] = OrderedDict()
        self._limit = limit

    def of(self, entry: Entry, make: Callable[[Entry], PromptBlocks]) -> PromptBlocks:
        prompts = self._prompts
        prompt = prompts.get(entry.request_id)
        if prompt is None:
            prompt = prompts[entry.request_id] = make(entry)
            if len(prompts) > self._limit:
                prompts.popitem(last=False)
        else:
            prompts.move_to_end(entry.request_id)
        return prompt

    def pop(self, request_id: str) -> PromptBlocks | None:
        return self._prompts.pop(request_id, None)


def reused_tokens(entry: Entry, prompt: PromptBlocks, engines: Sequence[Backend]) -> float:
    """Prompt tokens of ``entry`` that the best of ``engines`` already holds (estimated from
    the share of its prompt's blocks held there)."""
    return max(prefix_share(b, prompt) for b in engines) * entry.input_tokens


def most_reused(
    window: Sequence[Entry],
    engines: Sequence[Backend],
    prompt_of: Callable[[Entry], PromptBlocks],
) -> Entry:
    """The entry of ``window`` (oldest first) that reuses the most cached prompt on
    ``engines``, the engines that may take it now. A later entry must reuse at least one
    block more than every earlier one: on a tie the older goes. The oldest when more than
    ``FEW_ENGINES`` may take it, or none is healthy."""
    usable = [b for b in engines if b.healthy]
    oldest = window[0]
    if len(window) < 2 or not usable or len(usable) > FEW_ENGINES:
        return oldest
    block = min(b.block_size for b in usable)
    best, most = oldest, reused_tokens(oldest, prompt_of(oldest), usable)
    for entry in window[1:]:
        reused = reused_tokens(entry, prompt_of(entry), usable)
        if reused >= most + block:
            best, most = entry, reused
    return best
