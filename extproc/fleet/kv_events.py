"""What one engine really holds in its prefix cache, from its own KV events.

vLLM started with ``--kv-events-config`` publishes every block it caches or evicts
(``shared/reference/vllm.md`` A3): ZMQ multipart messages ``[topic, seq, payload]``, the
payload a msgpack ``EventBatch`` of ``BlockStored``, ``BlockRemoved`` and
``AllBlocksCleared`` events. This module is the pure part: decoding a payload
(``decode_batch``) and the per-engine index the events maintain (``KVBlockIndex``);
``extproc.fleet.kv_subscriber`` does the sockets, the sequence checks and the replays. Block
hashes are kept as the 64-bit ints the events carry (``event_key``). Between a grant and the
engine's ``BlockStored`` for it lies the request's prefill, and a burst sharing a new prefix
would scatter over the fleet if only confirmed blocks counted: ``expect`` records what was
just sent to an engine for a short time (llm-d's speculative entries), so the burst follows
the first one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

_LOW_64 = (1 << 64) - 1
EXPECT_S = 2.0
"""How long blocks sent to an engine count as held before its events confirm them: longer
than a prefill under load, shorter than an eviction cycle."""


def event_key(value: bytes | int) -> int:
    """The int an engine's KV events name a block by: the digest's last 8 bytes, big-endian.

    Engines run with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` publish whole digests; both
    forms map to the same key.
    """
    if isinstance(value, int):
        return value & _LOW_64
    return int.from_bytes(value[-8:], "big")


class EventFormatError(ValueError):
    """A payload that is not a vLLM ``KVEventBatch``."""


@dataclass(frozen=True, slots=True)
class BlocksStored:
    keys: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


KVEvent = BlocksStored | BlocksRemoved | AllCleared


def decode_batch(payload: bytes) -> list[KVEvent]:
    """The events of one ``KVEventBatch`` payload, in order; events of kinds this gateway
    does not use are skipped, and blocks on another medium than the GPU's (CPU offload,
    storage) are not counted as held by the engine's own cache.

    The wire format: the sequence number is 8 bytes big-endian; the payload is ``[ts, events,
    data_parallel_rank?]`` whose events are tagged maps: ``BlockStored`` (``block_hashes``,
    ``parent_block_hash``, ``token_ids``, ``block_size``, ...), ``BlockRemoved``
    (``block_hashes``) and ``AllBlocksCleared``.
    """
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise EventFormatError(f"not msgpack: {exc}") from None
    if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], list):
        raise EventFormatError("expected an EventBatch array [ts, events, ...]")
    events: list[KVEvent] = []
    for raw in batch[1]:
        event = _event(raw)
        if event is not None:
            events.append(event)
    return events


def _event(raw: Any) -> KVEvent | None:
    # Tagged maps ({"type": "BlockStored", ...}) in vLLM 0.32; arrays (["BlockStored", ...])
    # in releases that encoded events array-like.
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind = raw[0]
        fields = dict(zip(_ARRAY_FIELDS.get(raw[0], ()), raw[1:], strict=False))
    else:
        raise EventFormatError(f"unexpected event {raw!r:.80}")
    if kind == "AllBlocksCleared":
        return AllCleared()
    if kind not in ("BlockStored", "BlockRemoved"):
        return None
    if fields.get("medium") not in (None, "GPU"):
        return None
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, list):
        raise EventFormatError(f"{kind} without block_hashes")
    keys = tuple(event_key(h) for h in hashes)
    if kind == "BlockRemoved":
        return BlocksRemoved(keys)
    block_size = fields.get("block_size")
    if not isinstance(block_size, int) or block_size < 1:
        raise EventFormatError(f"BlockStored with block_size {block_size!r}")
    return BlocksStored(keys, block_size)


_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
}


class KVBlockIndex:
    """The blocks one engine holds (by its events), and the blocks just sent to it.

    ``held`` counts copies: two requests that bring the same new prefix into one engine step
    each fill a block of their own, and vLLM announces both (``BlockStored`` twice) and
    removes each when it is evicted (``BlockRemoved`` per copy), so a plain set would forget
    a prefix the engine still holds once the first copy goes.

    ``live`` says the index can be trusted to be complete; the picker falls back to the
    approximate index (``extproc.fleet.prefix_cache``) while it is false. Its owner, the
    subscriber (``extproc.fleet.kv_subscriber``), sets it once it follows the engine's stream
    from a point where it knew the whole cache (the stream's start, or an
    ``AllBlocksCleared``) and clears it when it cannot (it joined late, or lost events that no
    replay could give back); that module says when exactly.
    """

    __slots__ = ("_expected", "block_size", "held", "live", "removed", "stored")

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self._expected: dict[int, float] = {}
        self.block_size: int | None = None
        self.live = False
        self.stored = 0
        self.removed = 0

    def __len__(self) -> int:
        return len(self.held)

    def apply(self, events: Sequence[KVEvent]) -> None:
        held = self.held
        for event in events:
            if isinstance(event, BlocksStored):
                for key in event.keys:
                    held[key] = held.get(key, 0) + 1
                self.block_size = event.block_size
                self.stored += len(event.keys)
            elif isinstance(event, BlocksRemoved):
                for key in event.keys:
                    copies = held.pop(key, 0)
                    if copies > 1:
                        held[key] = copies - 1
                self.removed += len(event.keys)
            else:
                held.clear()

    def clear(self) -> None:
        """Forget everything: the engine restarted, or its stream cannot be trusted."""
        self.held.clear()
        self._expected.clear()

    def expect(self, keys: Sequence[int], now: float) -> None:
        """``keys`` were just sent here: count them as held for ``EXPECT_S``."""
        until = now + EXPECT_S
        expected = self._expected
        for key in keys:
            expected[key] = until
        if len(expected) > 4 * len(keys) + 4096:
            self._expected = {k: t for k, t in expected.items() if t > now}

    def match(self, keys: Iterable[int], now: float) -> int:
        """How many leading blocks of ``keys`` the engine holds or was just sent (``keys``
        is read no further than the first block it lacks)."""
        held = self.held
        expected = self._expected
        count = 0
        for key in keys:
            if key not in held:
                until = expected.get(key)
                if until is None or until <= now:
                    break
            count += 1
        return count
