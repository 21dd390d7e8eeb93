"""How a prompt is cut into pieces that tokenize apart to the ids of the whole.

Precise prefix routing needs a prompt's token ids only as far as some engine holds its
prefix (``extproc.core.blockhash.BlockKeys``), so both tokenizers the gateway knows (a
model's own, ``extproc.fleet.tokenizer``; the simulator's, ``extproc.core.prompt``) hand
them out a piece at a time, each tokenized when it is read.
"""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenPieces:
    """A prompt's token ids as the engine computes them, produced a piece at a time: each
    item is a piece's ids and how many of the prompt's characters it covers."""

    pieces: Iterator[tuple[Sequence[int], int]]
    chars: int
    """The prompt's length in characters (what a partial read extrapolates to)."""


PIECE_CHARS = 512
"""Prompts are tokenized in pieces of about this many characters (~190 tokens of the tiny
model, ~0.2 ms of its tokenizer), so matching reads only as far as an engine holds."""
_CUT = re.compile(r"(?<=\S) (?=\S)")


def text_pieces(
    text: str, start: int = 0, end: int | None = None, size: int = PIECE_CHARS
) -> Iterator[tuple[int, int]]:
    """Spans ``(from, to)`` covering ``text[start:end]``, each about ``size`` characters,
    cut only before a space between two non-spaces.

    That is where the usual pre-tokenizers start a word (byte-level BPE's regex, a
    metaspace split, the builtin tokenizer's pieces), and BPE merges never cross a word:
    each piece tokenizes to the ids it has inside the whole text. A tokenizer for which
    that does not hold is found out when it is loaded (``EngineTokenizer``) and tokenizes
    whole texts.
    """
    stop = len(text) if end is None else end
    while stop - start > size:
        cut = _CUT.search(text, start + size, stop)
        if cut is None:
            break
        yield start, cut.start()
        start = cut.start()
    if stop > start:
        yield start, stop


COLD_CHARS = 512
"""At most this much text that is not in the cache is tokenized for one request's match:
one piece (the first piece is always read), ~0.2-0.4 ms here. A longer prefix an engine
holds that this process never read (another replica sent it, or it was new when first
sent) reads as ended there, so engines holding that far tie (the picker breaks the tie with
the approximate index, then load), and the rest of it is read between requests
(``ReadLater``), so the next request that meets it finds it whole. Without that second part
a budget of 1 KiB cost `prefix-kv-bound` 3-7 points of hit rate in two runs of four (its
system prompts are 6-8 KiB, read a KiB per request) and the budget was 8 KiB: 3-6 ms for
the request that first met such a prompt (loadtests/bench/README.md)."""


class ColdBudget:
    """What is left of one request's ``COLD_CHARS``."""

    __slots__ = ("left", "stopped")

    def __init__(self, chars: int = COLD_CHARS) -> None:
        self.left = chars
        self.stopped = False
        """A piece was refused: the prompt's reading ends there."""

    def take(self, chars: int) -> bool:
        """Spend ``chars`` if anything is left (a piece is never split)."""
        if self.left <= 0:
            self.stopped = True
            return False
        self.left -= chars
        return True


PIECE_CACHE_TOKENS = 2_000_000
"""Token ids a piece cache keeps (4 bytes each: 8 MB, thousands of long prompts)."""


class PieceCache:
    """Token ids of recently tokenized pieces, by their text, within a budget of ids.

    Prompts repeat: a shared system prompt, a document asked about again, a conversation
    re-sent with one more turn. Pieces are cut at the same places in the same text
    (``text_pieces`` starts from the text before it), so such a prompt costs a lookup per
    piece and only its new text is tokenized. The oldest pieces are dropped first.
    """

    def __init__(self, budget: int = PIECE_CACHE_TOKENS) -> None:
        self._pieces: OrderedDict[str, array[int]] = OrderedDict()
        self._budget = budget
        self._held = 0
        self.hits = 0
        self.misses = 0

    def ids(
        self,
        text: str,
        tokenize: Callable[[str], Sequence[int]],
        budget: ColdBudget | None = None,
    ) -> array[int] | None:
        """``text``'s ids, from the cache or from ``tokenize`` (then remembered); None when
        they are not cached and ``budget`` is spent."""
        pieces = self._pieces
        found = pieces.get(text)
        if found is not None:
            pieces.move_to_end(text)
            self.hits += 1
            return found
        if budget is not None and not budget.take(len(text)):
            return None
        self.misses += 1
        ids = array("I", tokenize(text))
        if len(ids) <= self._budget // 4:
            pieces[text] = ids
            self._held += len(ids)
            while self._held > self._budget:
                _, dropped = pieces.popitem(last=False)
                self._held -= len(dropped)
        return ids

    def pieces(
        self,
        text: str,
        tokenize: Callable[[str], Sequence[int]],
        budget: ColdBudget | None = None,
        start: int = 0,
        end: int | None = None,
    ) -> Iterator[tuple[Sequence[int], int]]:
        """The ids of ``text[start:end]`` piece by piece (``text_pieces``), each with the
        characters it covers, until ``budget`` refuses one (``budget.stopped`` says so)."""
        for a, b in text_pieces(text, start, end):
            ids = self.ids(text[a:b], tokenize, budget)
            if ids is None:
                return
            yield ids, b - a


Reader = Callable[[ColdBudget | None], Iterator[tuple[Sequence[int], int]]]
"""A prompt's pieces read again from its start (cached pieces are lookups), within a
budget of new text."""

READ_LATER_PROMPTS = 256
"""Prompts waiting to be read on; past it the longest-waiting one is forgotten (a prompt
matched once in a burst of new ones may never come back)."""

READ_LATER_CHARS = 8 * 1024 * 1024
"""Characters of prompt text held while waiting, at most (the longest-waiting go first)."""

READ_LATER_WALKS = 8
"""Prompts one ``ReadLater.read`` looks at, at most: a prompt the requests have read
meanwhile is walked piece by piece through the cache before it is found whole, and a call
must stay short whatever waits."""


class ReadLater:
    """Prompts whose reading one request's ``COLD_CHARS`` stopped, read on a piece at a
    time when the service has a moment (``extproc.transport.read_later``), so the pieces
    the budget left unread are in the cache when the prompt comes back (the next turn of a
    conversation, the next request on a long system prompt).

    A request never waits for it: its own reading stays within its budget. What it costs is
    the tokenizing the budget deferred, spent between requests instead of on one. Pure
    bookkeeping and tokenizing, no I/O: the transport decides when.
    """

    __slots__ = ("_held", "_limit", "_limit_chars", "_waiting")

    def __init__(self, limit: int = READ_LATER_PROMPTS, chars: int = READ_LATER_CHARS) -> None:
        self._waiting: OrderedDict[object, tuple[Reader, int]] = OrderedDict()
        self._limit = limit
        self._limit_chars = chars
        self._held = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def reading(
        self, key: object, reader: Reader, budget: ColdBudget | None, size: int
    ) -> Iterator[tuple[Sequence[int], int]]:
        """``reader(budget)``'s pieces; when ``budget`` stops them, the prompt (``key``, of
        ``size`` characters) waits here to be read on."""
        yield from reader(budget)
        if budget is not None and budget.stopped:
            self.add(key, reader, size)

    def add(self, key: object, reader: Reader, size: int) -> None:
        """Read the prompt ``key`` names (``size`` characters) on later, with ``reader``;
        the longest-waiting ones go past ``READ_LATER_PROMPTS`` or ``READ_LATER_CHARS``."""
        waiting = self._waiting
        if key in waiting:
            return
        waiting[key] = (reader, size)
        self._held += size
        while len(waiting) > self._limit or self._held > self._limit_chars:
            self._drop(next(iter(waiting)))

    def read(self, chars: int) -> int:
        """Tokenize up to ``chars`` of new text (at least one piece if any waits), from the
        longest-waiting prompt on, looking at ``READ_LATER_WALKS`` prompts at most; the
        characters tokenized. A prompt read to its end leaves the queue."""
        spent = 0
        waiting = self._waiting
        for _ in range(READ_LATER_WALKS):
            if not waiting or spent >= chars:
                break
            key, (reader, _) = next(iter(waiting.items()))
            budget = ColdBudget(chars - spent)
            try:
                for _ in reader(budget):
                    pass
            except Exception:  # the tokenizer failed on odd text: as the request's read did
                self._drop(key)
                continue
            spent += (chars - spent) - budget.left
            if budget.stopped:
                break
            self._drop(key)
        return spent

    def _drop(self, key: object) -> None:
        _, size = self._waiting.pop(key)
        self._held -= size
