"""Chained block hashes and the per-backend LRU that models a backend's prefix cache."""

import random

import pytest

from extproc.core.prefix import CHARS_PER_TOKEN, PromptBlocks, prefix_blocks
from extproc.fleet.prefix_cache import PrefixLRU


def test_same_prefix_same_leading_hashes_and_divergence_after_the_differing_block() -> None:
    a = list(range(100))
    b = [*range(40), 999, *range(41, 100)]  # differs inside block 2 (tokens 32..47)
    ha, hb = prefix_blocks(a, 16), prefix_blocks(b, 16)
    assert len(ha) == len(hb) == 6  # 100 tokens: six full blocks, the partial tail has none
    assert ha[:2] == hb[:2]
    assert all(x != y for x, y in zip(ha[2:], hb[2:], strict=True))  # the chain carries it on


def test_a_block_hash_depends_on_everything_before_it() -> None:
    # The same block content after a different first block hashes differently.
    one = prefix_blocks([1] * 16 + [7] * 16, 16)
    two = prefix_blocks([2] * 16 + [7] * 16, 16)
    assert one[1] != two[1]


def test_text_is_cut_into_character_chunks_of_a_block_of_tokens() -> None:
    system = "You are a careful assistant. " * 20  # 580 characters
    first = PromptBlocks(system + "What is 2+2? " * 10)
    second = PromptBlocks(system + "Name a prime. " * 10)
    chunk = 16 * CHARS_PER_TOKEN
    assert len(first.blocks(16)) == len(first.text) // chunk
    shared = len(system) // chunk
    assert first.blocks(16)[:shared] == second.blocks(16)[:shared]
    assert first.blocks(16)[shared] != second.blocks(16)[shared]
    assert first.blocks(16) is first.blocks(16)  # hashed once per block size
    assert len(first.blocks(128)) == len(first.text) // (128 * CHARS_PER_TOKEN)


def test_the_model_salts_the_chain_and_short_prompts_have_no_blocks() -> None:
    text = "x" * 200
    assert PromptBlocks(text, "m1").blocks(16)[0] != PromptBlocks(text, "m2").blocks(16)[0]
    assert PromptBlocks("hi").blocks(16) == []


def test_hashing_is_capped_for_huge_prompts() -> None:
    assert len(prefix_blocks(list(range(10_000)), 1, limit=50)) == 50


def test_lru_matches_the_longest_recorded_prefix() -> None:
    lru = PrefixLRU(100)
    chain = prefix_blocks(list(range(64)), 16)
    assert lru.match(chain) == 0
    lru.record(chain[:2])
    assert lru.match(chain) == 2
    other = prefix_blocks([5, *range(1, 64)], 16)
    assert lru.match(other) == 0


def test_lru_evicts_oldest_first_and_a_chains_tail_before_its_head() -> None:
    lru = PrefixLRU(4)
    old = prefix_blocks([1] * 48, 16)  # 3 blocks
    new = prefix_blocks([2] * 48, 16)
    lru.record(old)
    lru.record(new)
    assert len(lru) == 4
    # ``old`` lost its tail blocks and kept its head: what is held stays a prefix.
    assert lru.match(old) == 1 and lru.match(new) == 3
    lru.record(old[:1])  # touching refreshes: now new's tail goes first
    lru.record(prefix_blocks([3] * 16, 16))
    assert lru.match(old) == 1 and lru.match(new) == 2


def test_lru_is_bounded_and_resizes_down() -> None:
    lru = PrefixLRU(10)
    for i in range(100):
        lru.record(prefix_blocks([i] * 64, 16))
        assert len(lru) <= 10
    lru.resize(3)
    assert len(lru) == 3
    with pytest.raises(ValueError):
        PrefixLRU(0)


def test_what_is_held_of_a_chain_stays_a_prefix_so_match_may_bisect() -> None:
    rng = random.Random(7)
    lru = PrefixLRU(40)
    trunk = [rng.randrange(1000) for _ in range(16 * 8)]  # shared heads, as system prompts
    chains = [
        prefix_blocks(trunk[: 16 * rng.randrange(8)] + [rng.randrange(1000) for _ in range(96)], 16)
        for _ in range(30)
    ]
    for _ in range(500):
        chain = rng.choice(chains)
        lru.record(chain[: rng.randrange(1, len(chain) + 1)])
        for probe in chains:
            held = [block in lru._blocks for block in probe]
            linear = held.index(False) if False in held else len(held)
            assert held == [True] * linear + [False] * (len(held) - linear)
            assert lru.match(probe) == linear
