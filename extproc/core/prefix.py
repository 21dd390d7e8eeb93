"""Prefix-cache affinity: which backend most likely still holds a prompt's leading KV blocks.

vLLM caches only full blocks of ``block_size`` tokens, each keyed by a hash chained over
every block before it (``shared/reference/vllm.md`` A4), so a block is reusable exactly when
the whole prefix up to it is the same. The gateway mirrors that shape without the engine's
values: ``prefix_blocks`` chains Python's own ``hash`` over fixed-size chunks, and a
per-backend ``PrefixLRU`` (``extproc.fleet.prefix_cache``) remembers the chains recently sent
there. On the request path the chunks are characters, ``CHARS_PER_TOKEN`` to a token (as
llm-d/GIE's approximate scorer does): affinity needs only "same prefix, same leading
hashes", and hashing characters costs a fraction of tokenizing (docs/benchmarks/internals.md),
so every granted request is hashed. When engines publish their KV events, the prompt is also
hashed the engine's way (``PromptBlocks.keys``, ``extproc.core.blockhash``) and matched
against the blocks each engine says it holds (``extproc.fleet.kv_events``): exact, at the
cost of tokenizing (``loadtests/bench/tokenize_cost.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from extproc.fleet.pieces import PieceCache, ReadLater, TokenPieces

if TYPE_CHECKING:  # the service loads it only when precise routing is configured
    from extproc.core.blockhash import BlockHasher, BlockKeys

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

    cache: PieceCache
    """Token ids of the pieces read lately (its hits and misses are the service's metrics)."""
    later: ReadLater
    """Prompts a budget stopped, read on between requests by the transport
    (``extproc.transport.read_later``)."""

    def body_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's ids; None when the body has no single text prompt."""
        ...

    def body_pieces(self, body: Mapping[str, Any]) -> TokenPieces | None:
        """The same ids piece by piece, each tokenized when it is read; they may end early,
        before ``TokenPieces.chars`` are read, where reading on would cost too much
        (``extproc.fleet.pieces.COLD_CHARS``)."""
        ...


class PromptTokens:
    """A prompt's token ids, read from its ``TokenPieces`` only as far as someone asks
    (``extproc.core.blockhash.BlockKeys``): shared by every block size of one request."""

    __slots__ = ("_chars", "_pieces", "_read", "done", "ids")

    def __init__(self, pieces: TokenPieces) -> None:
        self.ids: list[int] = []
        self._pieces = pieces.pieces
        self._chars = pieces.chars
        self._read = 0
        self.done = False

    def more(self) -> bool:
        if self.done:
            return False
        try:
            piece = next(self._pieces, None)
        except Exception:  # the tokenizer failed on odd text: match what was read
            piece = None
        if piece is None:
            self.done = True
            return False
        ids, chars = piece
        self.ids.extend(ids)
        self._read += chars
        return True

    @property
    def cut_short(self) -> bool:
        return self.done and self._read < self._chars

    def estimated_total(self) -> int:
        if self._read >= self._chars:
            return len(self.ids)
        if not self._read:
            return len(self.ids) + self._chars // CHARS_PER_TOKEN
        return round(len(self.ids) * self._chars / self._read)


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
    ``engine`` is configured and the body has one text prompt). Tokenizing is the dear part:
    done only when a backend with an event index is scored, and only as far as matching
    reads (``BlockKeys``), the ids shared by every block size. Backends may run different
    block sizes (vLLM's CPU platform forces 128). ``salt`` (the model name) keeps equal
    prompts for different models apart, as vLLM's cache is per model.
    """

    __slots__ = ("_body", "_by_size", "_engine", "_keys_by_size", "_tokens", "salt", "text")

    def __init__(
        self,
        text: str,
        salt: str = "",
        body: Mapping[str, Any] | None = None,
        engine: EngineHashing | None = None,
    ) -> None:
        self.text = salt + "\x00" + text if salt and text else text
        self._by_size: dict[int, list[int]] = {}
        self._body = body
        self._engine = engine
        self._tokens: PromptTokens | Literal[False] | None = None
        """Read lazily; False once the body turned out to have no tokens to read."""
        self._keys_by_size: dict[int, BlockKeys | None] = {}

    def keys(self, block_size: int) -> BlockKeys | None:
        """The engine's block keys of the prompt's full blocks, computed as they are read;
        None when they cannot be known (no tokenizer configured, no single text prompt)."""
        if block_size in self._keys_by_size:
            return self._keys_by_size[block_size]
        engine, body = self._engine, self._body
        keys: BlockKeys | None = None
        if engine is not None and body is not None:
            if self._tokens is None:
                pieces = _engine_pieces(engine.tokenizer, body)
                self._tokens = PromptTokens(pieces) if pieces is not None else False
            if self._tokens:
                salt = body.get("cache_salt")
                keys = engine.hasher.lazy_keys(
                    self._tokens, block_size, salt if isinstance(salt, str) else None
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


def _engine_pieces(tokenizer: PromptTokenizer, body: Mapping[str, Any]) -> TokenPieces | None:
    """The prompt's pieces, or none when the body has no single text prompt, or the
    template fails on it (the engine will answer that request with its own error)."""
    try:
        return tokenizer.body_pieces(body)
    except Exception:  # a template's raise_exception, or odd content: no precise keys
        return None
