"""KV event payloads decoded, and the per-engine index they maintain."""

from __future__ import annotations

import msgpack
import pytest

from extproc.fleet.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    EventFormatError,
    KVBlockIndex,
    decode_batch,
    event_key,
)
from loadtests.sim.kv_events import ALL_BLOCKS_CLEARED, block_removed, block_stored, encode_batch

DIGEST = bytes(range(32))


def test_a_batch_decodes_to_stored_removed_and_cleared_in_order() -> None:
    payload = encode_batch(
        1.5,
        [
            block_stored([1, 2], None, list(range(32)), 16),
            block_removed(1),
            ALL_BLOCKS_CLEARED,
            {"type": "SomethingNewer", "x": 1},  # a later vLLM's kind: skipped
        ],
    )
    assert decode_batch(payload) == [
        BlocksStored((1, 2), 16),
        BlocksRemoved((1,)),
        AllCleared(),
    ]


def test_int_and_bytes_hashes_name_the_same_block() -> None:
    as_bytes = msgpack.packb([0.0, [{"type": "BlockRemoved", "block_hashes": [DIGEST]}]])
    as_int = encode_batch(0.0, [block_removed(event_key(DIGEST))])
    assert decode_batch(as_bytes) == decode_batch(as_int) == [BlocksRemoved((event_key(DIGEST),))]
    assert event_key(DIGEST) == int.from_bytes(DIGEST[-8:], "big")
    assert event_key(-1) == (1 << 64) - 1


def test_blocks_on_another_medium_are_not_the_engines_cache() -> None:
    offloaded = {**block_stored([5], None, [0] * 16, 16), "medium": "CPU"}
    assert decode_batch(encode_batch(0.0, [offloaded])) == []


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, 2]), msgpack.packb([1.0, [7]])],
    ids=["not-msgpack", "a-map", "events-not-a-list", "event-not-a-map"],
)
def test_a_broken_payload_is_an_event_format_error(payload: bytes) -> None:
    with pytest.raises(EventFormatError):
        decode_batch(payload)


def test_the_index_counts_copies_and_clears() -> None:
    index = KVBlockIndex()
    # two requests filled a block each with the same new prefix in one step
    index.apply([BlocksStored((1, 2), 16), BlocksStored((1,), 16)])
    index.apply([BlocksRemoved((1,))])
    assert index.match([1, 2], now=0.0) == 2  # one copy of 1 is still there
    index.apply([BlocksRemoved((1, 9))])  # 9 was never seen (a stream joined late)
    assert index.match([1, 2], now=0.0) == 0
    assert len(index) == 1 and (index.stored, index.removed) == (3, 3)
    index.apply([AllCleared()])
    assert len(index) == 0


def test_expected_blocks_count_until_they_expire() -> None:
    index = KVBlockIndex()
    index.apply([BlocksStored((1,), 16)])
    index.expect([1, 2, 3], now=10.0)
    assert index.match([1, 2, 3, 4], now=11.0) == 3
    assert index.match([1, 2, 3], now=13.0) == 1
