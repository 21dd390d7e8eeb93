"""Long prompts tokenized off the event loop, for precise prefix routing.

The picker matches a prompt against the blocks engines report only after tokenizing it the
engine's way (``extproc.core.prefix.PromptBlocks.keys``); a cold 8k-token prompt costs the
model's Rust tokenizer about 7 ms here (``loadtests/bench/tokenize_cost.py``), during which
the event loop, and every other stream, would wait. ``tokenizers``' batch call releases the
GIL, so a prompt past ``OFF_LOOP_BYTES`` is tokenized in a worker thread while the loop goes
on: its request waits as long as before, the others do not. The ids travel with the request
(``RequestInfo.prompt_ids``) and the core stays synchronous; shorter prompts are cheaper
inline than the hand-off. The simulator's Python tokenizer (``--tokenizer builtin``) holds
the GIL, so it is never offloaded.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from extproc.fleet.tokenizer import EngineTokenizer

OFF_LOOP_BYTES = 8 * 1024
"""Bodies from this size (about 2k tokens, 1 ms of tokenizing) are tokenized in a thread."""
WORKERS = 2
"""Tokenizing threads: the Rust tokenizer runs them in parallel with each other and the loop."""


class OffLoopTokenizer:
    """Token ids of long prompts, computed in worker threads."""

    def __init__(
        self, tokenizer: EngineTokenizer, min_bytes: int = OFF_LOOP_BYTES, workers: int = WORKERS
    ) -> None:
        self.tokenizer = tokenizer
        self.min_bytes = min_bytes
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")
        self.offloaded = 0

    def wants(self, body: bytes) -> bool:
        return len(body) >= self.min_bytes

    async def ids(self, body: bytes) -> list[int] | None:
        """The prompt's token ids as the engine computes them; None when the body has no
        single text prompt or is not JSON (the core answers that request as it would)."""
        self.offloaded += 1
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._ids, body)

    def _ids(self, body: bytes) -> list[int] | None:
        try:
            parsed: Any = json.loads(body)
            return self.tokenizer.body_ids(parsed) if isinstance(parsed, dict) else None
        except Exception:  # bad JSON, a template error: the core decides what to answer
            return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
