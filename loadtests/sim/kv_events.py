"""vLLM 0.32's KV cache events, byte for byte: what ``--kv-events-config`` makes an engine say.

A gateway that routes on what engines really cache (``extproc.fleet.kv_subscriber``) reads
these, so the simulator writes them exactly as ``vllm/distributed/kv_events.py`` encodes them
(msgspec, ``omit_defaults``; ``shared/reference/vllm.md`` A3): the payload
``[ts, events, data_parallel_rank]``, each event a map with its ``type`` tag first, a
``BlockStored`` per request and step for the blocks it filled, a ``BlockRemoved`` per evicted
block, and hashes as the ints of ``extproc.fleet.kv_events.event_key``. ``block_stored`` has
the field rules. ``tests/loadtests/sim/test_sim_kv_events.py`` holds a batch against the bytes
vLLM 0.32's own structs encode to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

Event = dict[str, Any]

MEDIUM_GPU = "GPU"
FULL_ATTENTION = "full_attention"
ALL_BLOCKS_CLEARED: Event = {"type": "AllBlocksCleared"}


def block_stored(
    keys: list[int],
    parent: int | None,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: list[list[str] | None] | None = None,
    lora_id: int | None = None,
    lora_name: str | None = None,
) -> Event:
    """The full blocks ``keys`` one request just filled, chained after ``parent``;
    ``extra_keys`` one entry per block (default: all None, plain text); ``lora_id`` and
    ``lora_name`` the adapter of a LoRA request (vLLM's ``lora_int_id`` and name).

    The rules, as vLLM 0.32 encodes them: an event is a map, its ``type`` tag first, then the
    struct's fields in their order. Fields without a default are always written, even when None
    (``parent_block_hash``, ``lora_id``, ``medium``, ``lora_name``); fields whose value equals
    their default (None) are left out (``kv_cache_spec_sliding_window``, ``locality``,
    ``ownership``, ``session_id``). ``BlockStored`` is one per request and step, for the blocks
    that request filled (vLLM's ``cache_full_blocks``): ``extra_keys`` holds one entry per
    block, None for plain text (vLLM writes the list of Nones, not None) and ``[salt]`` for the
    first block of a request with a ``cache_salt`` (vLLM's ``to_event_extra_keys``: the salt
    untagged, though the hash takes ``("cache_salt", salt)``); a LoRA request's blocks name the
    adapter in ``lora_id``/``lora_name`` and start each entry with its name (``[name]``,
    ``[name, salt]``: the hash takes ``("lora", name, path)``), ``group_idx`` 0 (a model with
    one KV cache group) and ``kv_cache_spec_kind`` ``"full_attention"`` (the scheduler's
    annotation). ``BlockRemoved`` is one per evicted block (``_emit_block_removed_events``),
    with ``group_idx`` 0. The publisher always sets the rank, so it is never left out of the
    payload.
    """
    return {
        "type": "BlockStored",
        "block_hashes": keys,
        "parent_block_hash": parent,
        "token_ids": token_ids if isinstance(token_ids, list) else list(token_ids),
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": MEDIUM_GPU,
        "lora_name": lora_name,
        "extra_keys": [None] * len(keys) if extra_keys is None else extra_keys,
        "group_idx": 0,
        "kv_cache_spec_kind": FULL_ATTENTION,
    }


def block_removed(key: int) -> Event:
    """One cached block evicted to be reused."""
    return {"type": "BlockRemoved", "block_hashes": [key], "medium": MEDIUM_GPU, "group_idx": 0}


def encode_batch(ts: float, events: list[Event], data_parallel_rank: int = 0) -> bytes:
    """One step's events as the payload vLLM's publisher sends (``KVEventBatch``)."""
    payload: bytes = msgpack.packb([ts, events, data_parallel_rank])
    return payload
