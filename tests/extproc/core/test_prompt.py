"""The prompt estimator shared with the simulator (``extproc.core.prompt``): a chat's count
taken message by message, cached, equals the count of the whole rendered text."""

from __future__ import annotations

import random
from typing import Any

from extproc.core.prompt import (
    BuiltinTokenizer,
    _CountCache,
    chat_text_and_tokens,
    count_tokens,
    pieces,
    render_chat,
)
from extproc.fleet.pieces import PIECE_CHARS

# Characters that make every kind of piece and its edges: letters, digits, punctuation,
# runs of spaces and newlines, tabs, non-ASCII, and the template's own markers.
_ALPHABET = "aZ09 \n\t.,<|>é中"


def _text(rng: random.Random) -> str:
    size = rng.choice((0, 1, 3, 40, 600))  # 600: long enough to be cached
    return "".join(rng.choice(_ALPHABET) for _ in range(size))


def _message(rng: random.Random) -> dict[str, Any]:
    content: Any = rng.choice(
        (_text(rng), None, [{"text": _text(rng)} for _ in range(rng.randint(0, 3))])
    )
    return {"role": rng.choice(("system", "user", " x\n", "")), "content": content}


def test_the_count_is_the_number_of_pieces() -> None:
    rng = random.Random(3)
    for _ in range(500):
        text = _text(rng)
        assert count_tokens(text) == len(pieces(text)), text


def test_counting_message_by_message_equals_counting_the_whole_chat() -> None:
    rng = random.Random(7)
    for _ in range(1_500):
        messages = [_message(rng) for _ in range(rng.randint(0, 6))]
        text = render_chat(messages)
        assert chat_text_and_tokens(messages) == (text, count_tokens(text)), messages
        assert chat_text_and_tokens(messages) == (text, count_tokens(text))  # cached now


def test_a_long_message_is_counted_once_and_the_cache_keeps_to_its_budget() -> None:
    cache = _CountCache(budget=3_000, shortest=100)
    first, second = "word " * 300, "other " * 300  # 1,500 and 1,800 characters
    assert cache.count(first) == count_tokens(first)
    assert cache.count(first) == count_tokens(first)
    assert list(cache._counts) == [first]
    cache.count(second)  # 3,300 characters held: the least recently used goes
    assert list(cache._counts) == [second] and cache._held == len(second)
    cache.count("short")  # under `shortest`: counted, not kept
    assert list(cache._counts) == [second]


def test_the_builtin_tokenizer_read_in_pieces_gives_the_whole_prompts_ids() -> None:
    """The simulator tokenizes whole prompts; the gateway reads them a piece at a time."""
    rng = random.Random(5)
    words = [" kaloto", " the", "generation", " 12", "345", ".", ",", "\n", "  ", " é", "<|x|>"]
    tokenizer = BuiltinTokenizer()
    for _ in range(30):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(100, 1500)))
        for body in ({"prompt": text}, {"messages": [{"role": "user", "content": text}]}):
            pieces = tokenizer.body_pieces(body, None)
            assert pieces is not None
            read = list(pieces.pieces)
            assert len(read) > 1 and sum(chars for _, chars in read) == pieces.chars
            assert [i for ids, _ in read for i in ids] == tokenizer.body_ids(body)
    assert tokenizer.body_pieces({"prompt": [1, 2]}) is None


def test_the_builtin_tokenizer_reads_later_what_a_budget_left_unread() -> None:
    tokenizer = BuiltinTokenizer()
    text = " ".join(f"kaloto{n} the generation" for n in range(800))
    body = {"prompt": text}
    first = tokenizer.body_pieces(body)
    assert first is not None
    assert sum(chars for _, chars in first.pieces) < len(text)
    while tokenizer.later.read(PIECE_CHARS):
        pass
    misses = tokenizer.cache.misses
    again = tokenizer.body_pieces(body)
    assert again is not None
    assert [i for ids, _ in again.pieces for i in ids] == tokenizer.body_ids(body)
    assert tokenizer.cache.misses == misses
