"""The KV block pool with prefix caching, as vLLM v1's ``BlockPool`` keeps it.

The pool is what makes KV pressure real in the simulator: a request holds
``ceil(tokens / block_size)`` blocks, the engine preempts when it cannot get one, and
``vllm:kv_cache_usage_perc`` is the fraction of blocks in use. Prefix caching follows
``shared/reference/vllm.md`` A4: only full blocks are cached, keyed by vLLM's chained hash
(``extproc.core.blockhash.BlockHasher``, the one the gateway predicts engines' blocks with); a
freed block stays findable until it is reused (an LRU free queue); a request's blocks are
freed in reverse, so its tail blocks are evicted first, and blocks without a hash go to the
front of the free queue. With ``record_events`` the pool also queues vLLM's KV events as
vLLM's pool does, which the server publishes once per step (``loadtests.sim.kv_publisher``).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from extproc.core.blockhash import BlockHasher
from extproc.fleet.kv_events import event_key
from loadtests.sim.kv_events import ALL_BLOCKS_CLEARED, Event, block_removed, block_stored

BlockHash = bytes


def engine_hasher(algo: str = "sha256") -> BlockHasher:
    """The hash chain of an engine started with ``--prefix-caching-hash-algo algo`` in this
    environment: vLLM seeds ``NONE_HASH`` with ``PYTHONHASHSEED`` when it is set."""
    return BlockHasher(algo, os.environ.get("PYTHONHASHSEED"))


DEFAULT_HASHER = engine_hasher()
NONE_HASH: BlockHash = DEFAULT_HASHER.none_hash


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    hasher: BlockHasher = DEFAULT_HASHER,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``token_ids`` (a partial tail has none), the
    first salted with ``cache_salt`` when there is one (vLLM's extra keys).

    A LoRA request's blocks (``lora``: the adapter's name and path) carry vLLM 0.32's
    ``("lora", name, path)`` extra key on every block, ahead of the salt
    (``generate_block_hash_extra_keys``), so adapters never share cached blocks with each
    other or with the base model."""
    limit = len(token_ids) // block_size
    if lora is None:
        return hasher.chain(token_ids, block_size, cache_salt, limit=limit)
    lora_key = ("lora", *lora)
    every: Any = (lora_key,)
    first: Any = (lora_key, ("cache_salt", cache_salt)) if cache_salt else every
    digests: list[BlockHash] = []
    parent = hasher.none_hash
    for k in range(limit):
        start = k * block_size
        block = tuple(token_ids[start : start + block_size])
        parent = hasher.digest(parent, block, first if k == 0 else every)
        digests.append(parent)
    hasher.trim()
    return digests


class BlockPool:
    """A fixed number of KV blocks: reference counts, an LRU free queue, a hash index.

    Details after vLLM 0.32: the hash takes ``--prefix-caching-hash-algo`` and the ``NONE_HASH``
    seed (``PYTHONHASHSEED`` when the environment has one, as in vLLM), and a request's
    ``cache_salt`` salts its first block; blocks without a hash (a partial tail) go to the front
    of the free queue, to be reused before any cached block is evicted (vLLM 0.32's
    ``free_blocks``). With ``record_events`` (``kv_event_queue``): a ``BlockStored`` per request
    and step for the blocks it filled, a ``BlockRemoved`` per cached block evicted to be reused,
    ``AllBlocksCleared`` on a reset.
    """

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
        self.events: list[Event] | None = None
        """vLLM's ``kv_event_queue``: None unless ``record_events`` (nobody takes them)."""

    def record_events(self) -> None:
        """Queue KV events from now on, for ``take_events``."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[Event]:
        """The events queued since the last call (vLLM's ``take_events``, once per step)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

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
        events = self.events
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            old = self._hash[block]
            if old is not None:
                if self._cached.get(old) == block:
                    del self._cached[old]
                self._hash[block] = None
                if events is not None:
                    # vLLM announces every copy it drops, also a second block holding the
                    # same hash (it indexes both; this pool finds hits in the first only).
                    events.append(block_removed(event_key(old)))
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, tail blocks first (vLLM's ``free_blocks``): a
        block holding a hash joins the end of the free queue (evicted last, LRU), one
        without (a partial tail, never findable) its front, to be reused first."""
        free = self._free
        unhashed: list[int] = []
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash[block] is None:
                    unhashed.append(block)
                else:
                    free[block] = None
        for block in reversed(unhashed):  # vLLM's prepend_n: the first ends up in front
            free[block] = None
            free.move_to_end(block, last=False)

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """Record that ``block`` now holds the full block ``block_hash``."""
        if self._hash[block] is not None:
            return
        self._hash[block] = block_hash
        self._cached.setdefault(block_hash, block)

    def cache_full(
        self,
        blocks: Sequence[int],
        hashes: Sequence[BlockHash],
        start: int,
        end: int,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        """One request's blocks ``start..end-1`` just became full (vLLM's
        ``cache_full_blocks``): cache them, and announce them in one ``BlockStored`` with
        the extra keys untagged, as vLLM publishes them (``to_event_extra_keys``): a LoRA
        request's adapter name on every block, then the salt on the first."""
        for k in range(start, end):
            self.cache(blocks[k], hashes[k])
        if self.events is not None:
            size = self.block_size
            every = [lora_name] if lora_name else None
            extra: list[list[str] | None] = [every] * (end - start)
            if cache_salt and start == 0 and end > 0:
                extra[0] = [*(every or ()), cache_salt]
            self.events.append(
                block_stored(
                    [event_key(h) for h in hashes[start:end]],
                    event_key(hashes[start - 1]) if start else None,
                    token_ids[start * size : end * size],
                    size,
                    extra,
                    lora_id=lora_id,
                    lora_name=lora_name,
                )
            )

    def reset(self) -> bool:
        """Forget every cached hash (vLLM's ``reset_prefix_cache``); refused (False) while a
        request holds a block, as vLLM refuses it."""
        if any(self._ref):
            return False
        self._hash = [None] * self.num_blocks
        self._cached = {}
        if self.events is not None:
            self.events.append(ALL_BLOCKS_CLEARED)
        return True
