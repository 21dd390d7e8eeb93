"""KV block pool: allocation, prefix-cache lookup, LRU eviction order."""

from __future__ import annotations

from loadtests.sim.blocks import NONE_HASH, BlockPool, block_hashes


def test_only_full_blocks_are_hashed_and_the_chain_depends_on_the_prefix() -> None:
    a = block_hashes(list(range(40)), 16)
    b = block_hashes([*range(16), *range(100, 124)], 16)
    assert len(a) == 2  # 40 tokens = 2 full blocks + a partial tail
    assert a[0] == b[0] and a[1] != b[1]
    assert NONE_HASH not in a


def test_freed_blocks_stay_findable_until_reused() -> None:
    pool = BlockPool(4, 16)
    hashes = block_hashes(list(range(32)), 16)
    blocks = pool.allocate(2)
    assert blocks is not None
    for block, h in zip(blocks, hashes, strict=True):
        pool.cache(block, h)
    pool.free(blocks)
    assert pool.num_free == 4 and pool.usage == 0.0
    assert pool.cached_prefix(hashes) == blocks
    # Two never-used blocks are evicted first, then the tail block of the freed request.
    pool.allocate(3)
    assert pool.cached_prefix(hashes) == blocks[:1]


def test_allocate_refuses_when_short_and_touch_takes_blocks_off_the_free_queue() -> None:
    pool = BlockPool(3, 16)
    first = pool.allocate(2)
    assert first is not None and pool.allocate(2) is None
    pool.cache(first[0], b"h")
    pool.free(first)
    pool.touch([first[0]])
    assert pool.num_free == 2 and abs(pool.usage - 1 / 3) < 1e-9


def test_a_freed_block_without_a_hash_is_reused_before_any_cached_block_is_evicted() -> None:
    """vLLM 0.32's ``free_blocks``: a partial (unhashed) block goes to the front of the free
    queue, a cached one to its end, so a cached block is evicted only when nothing else is
    left (as the conformance test's eviction events on the real engine show)."""
    pool = BlockPool(4, 16)
    blocks = pool.allocate(2)
    assert blocks == [0, 1]
    pool.cache(0, b"h")  # block 1 is the request's partial tail: no hash
    pool.free(blocks)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.cached_prefix([b"h"]) == [0]
    assert pool.allocate(1) == [0] and pool.cached_prefix([b"h"]) == []
