"""How a prompt is cut into pieces that tokenize apart to the ids of the whole.

Precise prefix routing needs a prompt's token ids only as far as some engine holds its
prefix (``extproc.core.blockhash.BlockKeys``), so both tokenizers the gateway knows (a
model's own, ``extproc.fleet.tokenizer``; the simulator's, ``extproc.core.prompt``) hand
them out a piece at a time, each tokenized when it is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
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
