"""Prefix-cache affinity: which backend most likely still holds a prompt's leading KV blocks.

vLLM caches only full blocks of ``block_size`` tokens, each keyed by a hash chained over
every block before it (``shared/reference/vllm.md`` A4), so a block is reusable exactly when
the whole prefix up to it is the same. The gateway mirrors that shape without the engine's
values: :func:`prefix_blocks` chains Python's own ``hash`` over fixed-size chunks, and a
per-backend ``PrefixLRU`` (``extproc.fleet.prefix_cache``) remembers the chains recently
sent there. The hashes only
need to agree with each other inside one gateway process, never with vLLM's sha256 ones.

On the request path the chunks are characters, not tokens (what llm-d/GIE's approximate
prefix scorer does): about ``CHARS_PER_TOKEN`` characters make a token, so a block of
``block_size`` tokens is a chunk of ``block_size * CHARS_PER_TOKEN`` characters. Measured
on this machine for a 2,092-token (8.8 KB) prompt: tokenising with ``extproc.core.prompt`` costs
about 430 µs and chaining its token blocks about 35 µs more, while chaining character
chunks costs about 25 µs (recording the 138 hashes in an LRU about 7 µs, matching them
about 1 µs). Affinity needs only "same prefix, same leading hashes", which character chunks
give, so every granted request is hashed, whatever the number of candidates.

When engines publish their KV events, the same prompt is also hashed the engine's way
(``PromptBlocks.keys``: its tokenizer and chat template, vLLM's chain and seed;
``extproc.core.blockhash``), and matched against the blocks each engine says it holds
(``extproc.fleet.kv_events``): exact, and blind to nothing the engine did, at the cost of
tokenizing (``loadtests/bench/tokenize_cost.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the service loads it only when precise routing is configured
    from extproc.core.blockhash import BlockHasher

CHARS_PER_TOKEN = 4
"""About four characters of English per token (the shared tokenizer's rate, and llm-d's)."""
MAX_PREFIX_BLOCKS = 2048
"""At most this many leading blocks are hashed: bounds the cost of a huge prompt; affinity
is decided long before (32k tokens at 16 tokens a block)."""


def prefix_blocks(
    items: Sequence[int] | str, block_size: int, limit: int = MAX_PREFIX_BLOCKS
) -> list[int]:
    """Chained hashes of the first ``limit`` full blocks of ``items`` (token ids or text).

    ``h_i = hash((h_{i-1}, block_i))`` like vLLM's chain: equal hashes at position ``i``
    mean equal prefixes up to the end of block ``i``. A partial tail block has no hash, as
    vLLM never caches one.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    text = isinstance(items, str)
    hashes: list[int] = []
    parent = 0
    end = min(len(items) - block_size + 1, limit * block_size)
    for start in range(0, max(end, 0), block_size):
        chunk = items[start : start + block_size]
        parent = hash((parent, chunk if text else tuple(chunk)))
        hashes.append(parent)
    return hashes


class PromptTokenizer(Protocol):
    """The engines' tokenizer: ``extproc.fleet.tokenizer.EngineTokenizer`` (a model's own
    files) or ``extproc.core.prompt.BuiltinTokenizer`` (fairlane's simulated engines)."""

    def body_ids(self, body: Mapping[str, Any]) -> list[int] | None: ...


@dataclass(frozen=True, slots=True)
class EngineHashing:
    """How the engines turn a request into the block keys their KV events name: the served
    model's tokenizer and chat template, and their hash chain (algorithm and seed)."""

    tokenizer: PromptTokenizer
    hasher: BlockHasher


class PromptBlocks:
    """One prompt's chained block hashes, per block size, computed on first use.

    Two kinds: ``blocks`` chains character chunks (the approximate index, no tokenizer);
    ``keys`` chains the engine's own token ids with its hash (the precise index, when
    ``engine`` is configured and the body has one text prompt). Tokenizing is the dear part,
    done at most once per request, and only when a backend with a live event index is
    scored. Backends may run different block sizes (vLLM's CPU platform forces 128); each
    size is hashed once per request however many backends are scored. ``salt`` (the model
    name) keeps equal prompts for different models apart, as vLLM's cache is per model.
    """

    __slots__ = ("_body", "_by_size", "_engine", "_ids", "_keys_by_size", "salt", "text")

    def __init__(
        self,
        text: str,
        salt: str = "",
        body: Mapping[str, Any] | None = None,
        engine: EngineHashing | None = None,
        ids: Sequence[int] | None = None,
    ) -> None:
        self.text = salt + "\x00" + text if salt and text else text
        self._by_size: dict[int, list[int]] = {}
        self._body = body
        self._engine = engine
        self._ids: Sequence[int] | None = ids
        self._keys_by_size: dict[int, list[int] | None] = {}

    def keys(self, block_size: int) -> list[int] | None:
        """The engine's block keys of the prompt's full blocks (``event_key`` ints), or None
        when they cannot be known (no tokenizer configured, no single text prompt)."""
        if block_size in self._keys_by_size:
            return self._keys_by_size[block_size]
        engine, body = self._engine, self._body
        keys: list[int] | None = None
        if engine is not None and body is not None:
            if self._ids is None:
                self._ids = _engine_ids(engine.tokenizer, body)
            if self._ids:
                salt = body.get("cache_salt")
                keys = engine.hasher.keys(
                    self._ids, block_size, salt if isinstance(salt, str) else None
                )
        self._keys_by_size[block_size] = keys
        return keys

    def blocks(self, block_size: int) -> list[int]:
        """Hashes of the prompt's full blocks of ``block_size`` tokens (character chunks)."""
        found = self._by_size.get(block_size)
        if found is None:
            found = prefix_blocks(self.text, block_size * CHARS_PER_TOKEN)
            self._by_size[block_size] = found
        return found


def _engine_ids(tokenizer: PromptTokenizer, body: Mapping[str, Any]) -> list[int]:
    """The prompt's token ids, or none when the body has no single text prompt, or the
    template fails on it (the engine will answer that request with its own error)."""
    try:
        return tokenizer.body_ids(body) or []
    except Exception:  # a template's raise_exception, or odd content: no precise keys
        return []
