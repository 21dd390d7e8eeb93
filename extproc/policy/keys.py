"""API keys as the gateway holds them: SHA-256 digests, looked up in constant time.

A policy's ``api_keys`` entry is a plain key (``sk-...``: handy for a demo, but the YAML then
holds a secret, and ``fairlane check`` warns), ``sha256:HEX`` (as ``fairlane hash-key``
prints it), ``env:NAME`` or ``file:PATH`` (read when the policy is loaded, a relative path
from the policy's directory). Every form becomes the key's digest when the policy is loaded,
so the request path costs the same whatever the form: one SHA-256 of the presented key, one
dict lookup on the first bytes of its digest, one constant-time comparison of the whole
digest (``KeyIndex``), so the only data-dependent timing is on 8 bytes of a digest, which tell
nothing about any key. One unsalted SHA-256 is enough: API keys are long random strings, not
passwords, so there is no dictionary to try, and a slow or salted hash would only make every
request pay. A key in a message is only ever its ``key_label``: never enough of it to use.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")

SHA256_PREFIX = "sha256:"
ENV_PREFIX = "env:"
FILE_PREFIX = "file:"
FORM_PREFIXES = (SHA256_PREFIX, ENV_PREFIX, FILE_PREFIX)
"""An entry starting with one of these is that form; any other entry is a plain key (so a
key that itself starts with ``env:`` must be written in its ``sha256:`` form)."""

_TAG_BYTES = 8
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def key_digest(key: str) -> bytes:
    """The SHA-256 of ``key`` as a client presents it (its UTF-8 bytes)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def hashed_form(key: str) -> str:
    """``key``'s ``sha256:HEX`` entry for a policy (what ``fairlane hash-key`` prints)."""
    return SHA256_PREFIX + key_digest(key).hex()


def is_plain(entry: str) -> bool:
    """Whether a policy entry holds the key itself (no ``sha256:``/``env:``/``file:``)."""
    return not entry.startswith(FORM_PREFIXES)


def parse_hex_digest(entry: str) -> bytes | None:
    """The digest of a ``sha256:HEX`` entry, or None when HEX is not 64 hex digits."""
    text = entry[len(SHA256_PREFIX) :]
    if len(text) != 64 or not _HEX_DIGITS.issuperset(text):
        return None
    return bytes.fromhex(text)


def key_hint(key: str) -> str:
    """Enough of a plain API key to tell keys apart in messages, never enough to use one."""
    return f"{key[: min(4, len(key) // 3)]}…"


def key_label(entry: str) -> str:
    """How messages and ``fairlane check`` name a policy entry: a plain key by its first
    characters, a digest by its first 8 hex digits, ``env:``/``file:`` as written (they
    name where the secret is, not the secret)."""
    if entry.startswith(SHA256_PREFIX):
        return entry[: len(SHA256_PREFIX) + 8] + "…"
    if entry.startswith((ENV_PREFIX, FILE_PREFIX)):
        return entry
    return key_hint(entry)


def self_contained_digest(entry: str) -> bytes:
    """The digest of an entry that needs nothing outside the policy: a plain key or
    ``sha256:HEX``; ``ValueError`` for a malformed digest or an ``env:``/``file:`` entry
    (those are resolved by the policy parser, which reads the environment and files)."""
    if entry.startswith(SHA256_PREFIX):
        digest = parse_hex_digest(entry)
        if digest is None:
            raise ValueError(f"{key_label(entry)}: expected sha256: and 64 hex digits")
        return digest
    if entry.startswith((ENV_PREFIX, FILE_PREFIX)):
        raise ValueError(f"{entry}: env: and file: keys are resolved when a policy is parsed")
    return key_digest(entry)


class KeyIndex(Generic[T]):
    """Who owns a presented key: one SHA-256, one dict lookup, one constant-time compare.

    Built once per policy from ``(digest, owner)`` pairs; the digests must be distinct (the
    parser reports duplicates). Buckets are keyed by the digest's first bytes; a bucket holds
    more than one entry only if two keys' digests share those bytes, which the lookup
    handles but practically never sees.
    """

    __slots__ = ("_buckets",)

    def __init__(self, entries: Iterable[tuple[bytes, T]]) -> None:
        buckets: dict[bytes, tuple[tuple[bytes, T], ...]] = {}
        for digest, owner in entries:
            tag = digest[:_TAG_BYTES]
            buckets[tag] = (*buckets.get(tag, ()), (digest, owner))
        self._buckets = buckets

    def find(self, key: str) -> T | None:
        """The owner of ``key``, or None when no entry matches."""
        digest = key_digest(key)
        for stored, owner in self._buckets.get(digest[:_TAG_BYTES], ()):
            if hmac.compare_digest(stored, digest):
                return owner
        return None

    def __len__(self) -> int:
        return sum(len(bucket) for bucket in self._buckets.values())
