"""The policy in force while the service runs, re-read when its file changes.

The store only reads files and calls its listeners, so this package does no asynchronous
I/O. The transport's server polls on a timer: ``load_if_changed`` (stat, read, parse and
validate: seconds for a policy of 100,000 tenants) in a worker thread, then ``commit`` (the
listeners and the swap) on the event loop, so a reload never stalls the requests.

The files ``file:`` API keys come from are watched with the policy file: a rotated key file
(a secret mount updated in place) reloads the policy as an edit would. ``env:`` keys are
read at each reload; a process's environment does not change under it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from extproc.policy.model import (
    Policy,
    PolicyError,
)
from extproc.policy.parse import (
    _parse_bytes,
)

log = logging.getLogger("fairlane.policy")

# --------------------------------------------------------------------------- hot reload

PolicyListener = Callable[[Policy], None]
"""Applies a new policy, or raises to refuse it (the store then rolls every listener back)."""
Stamp = tuple[tuple[int, int, int], ...]
"""(inode, mtime, size) of the policy file, then of each key file (-1s: missing)."""
_MISSING = (-1, -1, -1)
_UNREADABLE: Stamp = (_MISSING,)


class PolicyStore:
    """The policy in force, re-read from its file while the service runs.

    ``current`` is replaced by one attribute assignment, so a reader sees the old policy
    or the new one, never a mix. A file that fails validation is logged and ignored: a typo
    in an edit must not take the gateway down, nor leave it without a policy. A valid policy
    is committed only after every listener has applied it; when one refuses (raises), the
    listeners that had applied it get the previous policy back and nothing changes.
    """

    def __init__(self, path: str | os.PathLike[str], poll_interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.poll_interval_s = poll_interval_s
        self._listeners: list[PolicyListener] = []
        self.reloads: Counter[str] = Counter()
        """ok | error -> file changes applied or refused (``fairlane_policy_reloads_total``)."""
        self._key_files: tuple[Path, ...] = ()
        data = self.path.read_bytes()
        self.current: Policy = _parse_bytes(data, str(self.path))
        self._watch(self.current, data)

    def on_change(self, callback: PolicyListener) -> None:
        """Call ``callback(new_policy)`` before each swap (queues resize their limits); it
        may raise to refuse the policy."""
        self._listeners.append(callback)

    def _stat(self) -> Stamp:
        """The policy file's stat (``OSError`` when it has none), then each key file's."""
        st = self.path.stat()
        return ((st.st_ino, st.st_mtime_ns, st.st_size), *map(_key_file_stat, self._key_files))

    def _fingerprint(self, data: bytes) -> bytes:
        """What the policy's meaning depends on: its bytes and its key files' bytes."""
        digest = hashlib.sha256(data)
        for path in self._key_files:
            try:
                digest.update(hashlib.sha256(path.read_bytes()).digest())
            except OSError:
                digest.update(b"missing")
        return digest.digest()

    def _watch(self, policy: Policy, data: bytes) -> None:
        """Watch ``policy``'s file and key files from now on (``data``: the bytes it was
        parsed from)."""
        self._key_files = policy.key_files
        try:
            self._stamp = self._stat()
        except OSError:
            self._stamp = _UNREADABLE
        self._digest = self._fingerprint(data)

    def reload(self) -> bool:
        """Re-read the file if it changed; return whether a new policy was swapped in.

        ``load_if_changed`` then ``commit``, in one go; the service runs the first in a
        worker thread (a large policy takes seconds to parse) and the second on its loop."""
        return self.commit(self.load_if_changed())

    def load_if_changed(self) -> Policy | PolicyError | None:
        """The file's policy if it changed since the last load: the new ``Policy``, the
        ``PolicyError`` that refuses it, or None when there is nothing new (same stat, same
        bytes, unreadable). A stat per call when unchanged.

        Touches nothing that requests read (not ``current``, not the listeners), so it may
        run in a worker thread while the loop serves; calls must not overlap each other.
        The result goes to ``commit``, on the thread that owns the listeners."""
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return None
            data = self.path.read_bytes()
        except OSError as exc:  # e.g. mid-way through an editor's delete-and-recreate
            if self._stamp != _UNREADABLE:
                log.warning("policy %s not readable, keeping the previous one: %s", self.path, exc)
            self._stamp = _UNREADABLE
            return None
        self._stamp = stamp
        digest = self._fingerprint(data)
        if digest == self._digest:
            return None
        self._digest = digest  # a bad file is reported once, not on every poll
        try:
            policy = _parse_bytes(data, str(self.path))
        except PolicyError as exc:
            return exc
        self._watch(policy, data)  # the key files it names now
        return policy

    def commit(self, loaded: Policy | PolicyError | None) -> bool:
        """Swap in what ``load_if_changed`` returned; return whether a new policy is in force.

        A ``Policy`` goes to every listener and then replaces ``current``, unless a listener
        refuses it; a ``PolicyError`` is logged and counted, and the old policy stays."""
        if loaded is None:
            return False
        if isinstance(loaded, PolicyError):
            log.error("policy %s not reloaded, keeping the previous one: %s", self.path, loaded)
            self.reloads["error"] += 1
            return False
        policy = loaded
        if not self._apply(policy):
            self.reloads["error"] += 1
            return False
        self.current = policy
        self.reloads["ok"] += 1
        log.info(
            "policy %s reloaded: %d tiers, %d tenants, %d rules",
            self.path,
            len(policy.tiers),
            len(policy.tenants),
            len(policy.rules),
        )
        return True

    def _apply(self, policy: Policy) -> bool:
        """Hand ``policy`` to every listener; on a refusal, roll back the ones that took it."""
        applied: list[PolicyListener] = []
        for listener in self._listeners:
            try:
                listener(policy)
            except Exception:
                log.exception(
                    "policy %s refused by %r; keeping the previous one", self.path, listener
                )
                for done in reversed(applied):
                    try:
                        done(self.current)
                    except Exception:
                        log.exception("policy listener %r failed to roll back", done)
                return False
            applied.append(listener)
        return True


def _key_file_stat(path: Path) -> tuple[int, int, int]:
    try:
        st = path.stat()
    except OSError:
        return _MISSING
    return (st.st_ino, st.st_mtime_ns, st.st_size)
