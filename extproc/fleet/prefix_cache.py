"""A model of one backend's prefix cache: the chained block hashes recently sent there.

``extproc.core.prefix`` hashes a prompt into chained blocks; each backend keeps one
``PrefixLRU`` of what it was sent, sized from the ``vllm:cache_config_info`` its scrapes
report, so the picker can score how much of a prompt's prefix an engine likely holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = 16
"""vLLM's default KV block size (tokens), used until a backend's ``cache_config_info`` says."""
DEFAULT_CAPACITY_BLOCKS = 10_000
"""Blocks a backend is assumed to hold until its ``num_gpu_blocks`` is known."""


class PrefixLRU:
    """The chained block hashes recently sent to one backend, at most ``capacity_blocks``.

    A model of the engine's prefix cache, not a copy: the engine holds at most its
    ``num_gpu_blocks`` blocks and evicts least recently used ones, tail blocks first (it
    frees a finished request's blocks in reverse). ``record`` therefore touches a chain
    from its tail to its head, so a prompt's head is the last of it to be evicted and what
    is held of a chain stays a prefix of it. ``record`` costs O(len(hashes)), ``match``
    O(log len(hashes)), memory O(capacity).
    """

    __slots__ = ("_blocks", "capacity")

    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` were sent here and are likely still held.

        A binary search, O(log len): what is held of any chain is a prefix of it, because
        every ``record`` of a block also touched all blocks before it, after it (so an
        earlier block is never older than a later one and is never evicted first).
        """
        held = self._blocks
        low, high = 0, len(hashes)  # hashes[:low] are held; hashes[high:] are not
        while low < high:
            middle = (low + high) // 2
            if hashes[middle] in held:
                low = middle + 1
            else:
                high = middle
        return low

    def record(self, hashes: Sequence[int]) -> None:
        """``hashes`` were sent here: they are now the most recently used, head last."""
        held = self._blocks
        for block in reversed(hashes):
            if block in held:
                held.move_to_end(block)
            else:
                held[block] = None
        self._evict()

    def resize(self, capacity_blocks: int) -> None:
        """The backend's cache size became known (or changed): evict down to it."""
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._evict()

    def clear(self) -> None:
        self._blocks.clear()

    def _evict(self) -> None:
        held = self._blocks
        while len(held) > self.capacity:
            held.popitem(last=False)
