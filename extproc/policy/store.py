"""The policy in force while the service runs, re-read when its file changes.

The store only reads files and calls its listeners, so this package does no asynchronous
I/O. The transport's server polls on a timer: ``load_if_changed`` (stat, read, parse and
validate: seconds for a policy of 100,000 tenants) in a worker thread, then ``commit`` (the
listeners and the swap) on the event loop, so a reload never stalls the requests.
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
_UNREADABLE = (-1, -1, -1)


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
        data = self.path.read_bytes()
        self._stamp = self._stat()
        self._digest = hashlib.sha256(data).digest()
        self.current: Policy = _parse_bytes(data, str(self.path))

    def on_change(self, callback: PolicyListener) -> None:
        """Call ``callback(new_policy)`` before each swap (queues resize their limits); it
        may raise to refuse the policy."""
        self._listeners.append(callback)

    def _stat(self) -> tuple[int, int, int]:
        st = self.path.stat()
        return (st.st_ino, st.st_mtime_ns, st.st_size)

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
        digest = hashlib.sha256(data).digest()
        if digest == self._digest:
            return None
        self._digest = digest  # a bad file is reported once, not on every poll
        try:
            return _parse_bytes(data, str(self.path))
        except PolicyError as exc:
            return exc

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
