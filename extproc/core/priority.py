"""The continuous vLLM priority number.

vLLM (``--scheduling-policy priority``) runs lower numbers first and breaks ties by arrival;
it never ages a waiting request. A tier gives the base number; a user's requests already in
flight push its next one back, so a power user's fourth request ranks behind another user's
first request of the same tier instead of tying with it and winning by arrival time.

One user's own requests must still keep their order. Counting only the requests in flight at
each grant does not: a user with 88 in flight sends its next at +88, some of its earlier ones
finish, and the one after goes at +80 and overtakes it in the engine's queue, again and again,
until a few of its requests wait in the engine many times longer than the rest
(docs/benchmarks/internals.md, ``shared-prefix``). So a user's offset never falls below the
highest its requests still in flight went with (``UserOffsets``): within a user, ties, which
vLLM runs in arrival order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field


def vllm_priority(tier_base: int, offset: int) -> int:
    """Tier base plus the user's offset (0 for a user with nothing in flight)."""
    return tier_base + max(0, offset)


@dataclass(slots=True)
class _InFlight:
    """One user's requests in flight: how many, and how many went with each offset."""

    count: int = 0
    offsets: Counter[int] = field(default_factory=Counter)
    top: int = 0
    """The highest offset among them (0 when none)."""


class UserOffsets:
    """Each user's requests in flight and the offset from the tier base each went with.

    The next request's offset is its user's count in flight, or the highest offset one of
    them went with, whichever is more: it never overtakes its own user's earlier requests,
    and it drops back to the count once those finish. O(1) a grant; a completion of the
    user's top offset rescans that user's distinct offsets (few: they rise with the grants).
    """

    __slots__ = ("_users",)

    def __init__(self) -> None:
        self._users: dict[Hashable, _InFlight] = {}

    def next(self, user: Hashable) -> int:
        """The offset ``user``'s next request goes with."""
        state = self._users.get(user)
        return 0 if state is None else max(state.count, state.top)

    def granted(self, user: Hashable, offset: int) -> None:
        """A request of ``user`` went with ``offset`` and is now in flight."""
        state = self._users.get(user)
        if state is None:
            state = self._users[user] = _InFlight()
        state.count += 1
        state.offsets[offset] += 1
        state.top = max(state.top, offset)

    def finished(self, user: Hashable, offset: int) -> None:
        """A request of ``user`` that went with ``offset`` is no longer in flight."""
        state = self._users.get(user)
        if state is None or not state.offsets[offset]:
            return
        state.count -= 1
        state.offsets[offset] -= 1
        if state.offsets[offset]:
            return
        del state.offsets[offset]
        if not state.offsets:
            del self._users[user]
        elif offset == state.top:
            state.top = max(state.offsets)

    def in_flight(self, user: Hashable) -> int:
        """``user``'s requests in flight."""
        state = self._users.get(user)
        return 0 if state is None else state.count
