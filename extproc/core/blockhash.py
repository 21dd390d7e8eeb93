"""vLLM's own prefix-cache block hashes, computed the way the engine computes them.

Precise prefix routing (``extproc.fleet.kv_events``) matches a request's blocks against the
blocks an engine says it holds, so the gateway must hash exactly as the engine does
(``shared/reference/vllm.md`` A4, ``vllm/v1/core/kv_cache_utils.py``): only full blocks of
``block_size`` token ids, ``h_i = H((h_{i-1} or NONE_HASH, tuple(block_token_ids),
extra_keys))`` with the request's ``cache_salt`` in the first block's extra keys, ``H`` the
engine's ``--prefix-caching-hash-algo`` (``sha256`` over pickle, vLLM 0.32's default, or
``sha256_cbor``) and ``NONE_HASH = H(seed)``, the seed being the engine's ``PYTHONHASHSEED``
or ``"vllm-none-hash"``. The KV events carry each hash as the last 8 bytes of its digest,
a big-endian int (``event_key``): that is what indexes compare. The xxhash algorithms are
not offered: their seed is random per engine process unless ``PYTHONHASHSEED`` is set, and
they need a package the gateway does not otherwise use.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any, Literal, Protocol, get_args

from extproc.fleet.kv_events import event_key

HashAlgo = Literal["sha256", "sha256_cbor"]
HASH_ALGOS: tuple[str, ...] = get_args(HashAlgo)
DEFAULT_SEED = "vllm-none-hash"
"""vLLM's ``NONE_HASH`` seed for the sha256 algorithms when ``PYTHONHASHSEED`` is unset."""
MAX_HASHED_BLOCKS = 2048
"""At most this many leading blocks are hashed: bounds a huge prompt's cost (32k tokens at
16 a block); whether a prompt's head is cached is decided long before."""


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor(obj)).digest()


MEMO_BLOCKS = 100_000
"""Block digests a hasher remembers (about 150 bytes each: 15 MB)."""

_HASHERS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256_pickle,
    "sha256_cbor": _sha256_cbor,
}


class BlockHasher:
    """One engine configuration's hash chain: its algorithm and its ``NONE_HASH`` seed.

    Prefix routing hashes the same leading blocks again and again (a shared system prompt,
    a conversation re-sent with one more turn), so each block's digest is remembered by
    Python's own hash of what it is computed from: a block seen before costs a tuple hash
    and a lookup (about a quarter of serialising and hashing it). At most ``MEMO_BLOCKS``
    are remembered, the oldest dropped first. Two different blocks with the same 64-bit
    Python hash would share a digest: the gateway would then believe a prompt is cached
    where it is not (a routing mistake for that prompt, nothing else; the engine computes
    its own hashes).
    """

    __slots__ = ("_hash", "_memo", "algo", "none_hash", "seed")

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        hasher = _HASHERS.get(algo)
        if hasher is None:
            raise ValueError(
                f"prefix-caching hash algorithm {algo!r} is not supported; expected one of "
                f"{', '.join(HASH_ALGOS)}"
            )
        self.algo = algo
        self.seed = DEFAULT_SEED if seed is None else seed
        self._hash = hasher
        self.none_hash = hasher(self.seed)
        self._memo: dict[int, bytes] = {}

    def chain(
        self,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None = None,
        limit: int = MAX_HASHED_BLOCKS,
    ) -> list[bytes]:
        """The digests of the first ``limit`` full blocks of ``token_ids``, chained."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        digests: list[bytes] = []
        parent = self.none_hash
        extra = self.first_extra(cache_salt)
        end = min(len(token_ids) - block_size + 1, limit * block_size)
        for start in range(0, max(end, 0), block_size):
            parent = self.digest(parent, tuple(token_ids[start : start + block_size]), extra)
            digests.append(parent)
            extra = None
        self.trim()
        return digests

    @staticmethod
    def first_extra(cache_salt: str | None) -> tuple[tuple[str, str], ...] | None:
        """The extra keys of a request's first block (the salt, if any); later blocks have none."""
        return (("cache_salt", cache_salt),) if cache_salt else None

    def digest(
        self, parent: bytes, block: tuple[int, ...], extra: tuple[tuple[str, str], ...] | None
    ) -> bytes:
        """One block's digest chained on ``parent``'s (remembered: see the class)."""
        item = (parent, block, extra)
        seen = hash(item)
        memo = self._memo
        found = memo.get(seen)
        if found is None:
            found = memo[seen] = self._hash(item)
        return found

    def trim(self) -> None:
        """Forget the oldest remembered digests once more than ``MEMO_BLOCKS`` are kept."""
        memo = self._memo
        if len(memo) > MEMO_BLOCKS:
            for old in list(islice(memo, len(memo) - MEMO_BLOCKS * 9 // 10)):
                del memo[old]

    def lazy_keys(
        self, tokens: TokenSource, block_size: int, cache_salt: str | None = None
    ) -> BlockKeys:
        """The keys of a prompt read piece by piece, hashed as far as they are read."""
        return BlockKeys(self, tokens, block_size, cache_salt)

    def keys(
        self,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None = None,
        limit: int = MAX_HASHED_BLOCKS,
    ) -> list[int]:
        """``chain`` as the ints the engine's KV events carry (``event_key``)."""
        return [event_key(d) for d in self.chain(token_ids, block_size, cache_salt, limit)]


class TokenSource(Protocol):
    """A prompt's token ids, read piece by piece (``extproc.core.prefix.PromptTokens``)."""

    ids: list[int]
    """The ids read so far."""

    def more(self) -> bool:
        """Read the next piece into ``ids``; False once the whole prompt is read."""
        ...

    def estimated_total(self) -> int:
        """The prompt's length in tokens: exact once read, else extrapolated from the
        characters read so far."""
        ...

    @property
    def cut_short(self) -> bool:
        """Whether reading ended before the prompt did (one request's budget was spent)."""
        ...


class BlockKeys:
    """One prompt's block keys (``event_key`` ints) in an engine's chain, computed only as
    far as they are read.

    Matching a prompt against an engine's index stops at the first block the engine lacks
    (a block is reusable only with every block before it), so the picker never needs the
    keys past the longest prefix any engine holds, plus one. Iterating yields key after key
    and tokenizes and hashes more of the prompt only when the reader asks past what is
    known: a prompt no engine holds costs its first piece, not its whole length
    (``loadtests/bench/tokenize_cost.py``). The tokenizer may end a prompt early, once one
    request has tokenized its budget of new text (``extproc.fleet.pieces.COLD_CHARS``).
    """

    __slots__ = ("_extra", "_hasher", "_limit", "_parent", "_tokens", "block_size", "known")

    def __init__(
        self,
        hasher: BlockHasher,
        tokens: TokenSource,
        block_size: int,
        cache_salt: str | None = None,
        limit: int = MAX_HASHED_BLOCKS,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._hasher = hasher
        self._tokens = tokens
        self.block_size = block_size
        self._limit = limit
        self._parent = hasher.none_hash
        self._extra = hasher.first_extra(cache_salt)
        self.known: list[int] = []
        """The keys computed so far, in order."""

    def __iter__(self) -> Iterator[int]:
        known = self.known
        index = 0
        while index < len(known) or self._extend():
            yield known[index]
            index += 1

    @property
    def cut_short(self) -> bool:
        """Whether the keys end where one request's reading had to stop, not where the
        prompt does (a match as long as them may go further)."""
        return self._tokens.cut_short or len(self.known) >= self._limit

    def total(self) -> int:
        """How many full blocks the whole prompt spans (estimated until it is all read)."""
        blocks = min(self._tokens.estimated_total() // self.block_size, self._limit)
        return max(blocks, len(self.known))

    def all(self) -> list[int]:
        """Every key of the prompt the tokenizer gives (up to the limit)."""
        for _ in self:
            pass
        return self.known

    def _extend(self) -> bool:
        """Hash one more block, reading more of the prompt if it is not yet there."""
        known, size = self.known, self.block_size
        if len(known) >= self._limit:
            return False
        start = len(known) * size
        ids = self._tokens.ids
        while len(ids) < start + size:
            if not self._tokens.more():
                return False
            ids = self._tokens.ids
        self._parent = self._hasher.digest(
            self._parent, tuple(ids[start : start + size]), self._extra
        )
        self._extra = None
        known.append(event_key(self._parent))
        if len(known) % 64 == 0:
            self._hasher.trim()
        return True


# Canonical CBOR (RFC 8949 4.2.1) for the few types a block hash holds: what
# ``cbor2.dumps(obj, canonical=True)`` writes for None, bool, non-negative and negative
# ints, bytes, str, and tuples or lists (arrays). Written out here because it is short and
# about twice as fast as a general encoder on a block's ints.
_UINT_CACHE: dict[int, bytes] = {}


def _head(major: int, value: int) -> bytes:
    """A data item's initial byte(s): major type and the shortest length or value field."""
    mt = major << 5
    if value < 24:
        return bytes((mt | value,))
    if value < 0x100:
        return bytes((mt | 24, value))
    if value < 0x10000:
        return struct.pack(">BH", mt | 25, value)
    if value < 0x100000000:
        return struct.pack(">BI", mt | 26, value)
    if value < 0x10000000000000000:
        return struct.pack(">BQ", mt | 27, value)
    raise ValueError(f"integer {value} does not fit canonical CBOR's 64-bit heads")


def _uint(value: int) -> bytes:
    found = _UINT_CACHE.get(value)
    if found is None:
        found = _head(0, value)
        if len(_UINT_CACHE) < 1 << 18:
            _UINT_CACHE[value] = found
    return found


def cbor(obj: Any) -> bytes:
    """``obj`` as canonical CBOR (only the types a block hash is made of)."""
    if obj is None:
        return b"\xf6"
    if obj is True:
        return b"\xf5"
    if obj is False:
        return b"\xf4"
    if isinstance(obj, int):
        return _uint(obj) if obj >= 0 else _head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _head(2, len(obj)) + obj
    if isinstance(obj, str):
        data = obj.encode("utf-8")
        return _head(3, len(data)) + data
    if isinstance(obj, (tuple, list)):
        if obj and all(type(item) is int and item >= 0 for item in obj):
            return _head(4, len(obj)) + b"".join(map(_uint, obj))
        return _head(4, len(obj)) + b"".join(map(cbor, obj))
    raise TypeError(f"cannot encode {type(obj).__name__} in a block hash")
