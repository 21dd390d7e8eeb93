"""The KV block pool with prefix caching, as vLLM v1's ``BlockPool`` keeps it.

The pool is what makes KV pressure real in the simulator: a request holds
``ceil(tokens / block_size)`` blocks, the engine preempts when it cannot get one, and
``vllm:kv_cache_usage_perc`` is the fraction of blocks in use. Prefix caching follows
``shared/reference/vllm.md`` A4:

- only full blocks are cached, keyed by a chained hash
  ``h_i = sha256(pickle((h_{i-1} or NONE_HASH, tuple(tokens), None)))``;
- a freed block keeps its hash and stays findable until it is reused (LRU free queue);
- a request's blocks are freed in reverse order, so its tail blocks are evicted first.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes


def _sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


# vLLM seeds the chain with H("vllm-none-hash") when PYTHONHASHSEED is unset (sha256 algos).
NONE_HASH: BlockHash = _sha256("vllm-none-hash")


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``token_ids`` (a partial tail has none)."""
    hashes: list[BlockHash] = []
    parent = NONE_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _sha256((parent, tuple(token_ids[start : start + block_size]), None))
        hashes.append(parent)
    return hashes


class BlockPool:
    """A fixed number of KV blocks: reference counts, an LRU free queue, a hash index."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        # Free blocks, least recently freed first. Insertion order is the eviction order.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_evictable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` (cache hits) sit in the free queue and would leave it."""
        return sum(1 for block in blocks if self._ref[block] == 0)

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Blocks holding the longest cached prefix of ``hashes`` (not yet referenced)."""
        found: list[int] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, evicting the least recently freed; ``None`` if too few."""
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            old = self._hash[block]
            if old is not None:
                if self._cached.get(old) == block:
                    del self._cached[old]
                self._hash[block] = None
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; tail blocks go to the free queue first."""
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """Record that ``block`` now holds the full block ``block_hash``."""
        if self._hash[block] is not None:
            return
        self._hash[block] = block_hash
        self._cached.setdefault(block_hash, block)

    def reset(self) -> None:
        """Forget every cached hash (vLLM's ``reset_prefix_cache``); only if nothing is held."""
        for block, h in enumerate(self._hash):
            if h is not None and self._ref[block] == 0:
                self._hash[block] = None
        self._cached = {h: b for h, b in self._cached.items() if self._ref[b] > 0}
