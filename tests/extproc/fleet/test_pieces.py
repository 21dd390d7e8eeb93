"""Cutting prompts into pieces and remembering their ids (extproc.fleet.pieces)."""

from __future__ import annotations

import itertools
import random
from array import array
from collections.abc import Iterator, Sequence
from functools import partial

from extproc.fleet.pieces import (
    PIECE_CHARS,
    READ_LATER_WALKS,
    ColdBudget,
    PieceCache,
    Reader,
    ReadLater,
    text_pieces,
)


def test_pieces_cover_the_text_and_are_cut_only_where_a_word_starts() -> None:
    rng = random.Random(3)
    alphabet = "ab .\n\t,é "
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 3000)))
        size = rng.choice((1, 16, 512))
        spans = list(text_pieces(text, size=size))
        assert "".join(text[a:b] for a, b in spans) == text
        assert all(a < b for a, b in spans)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end == start
            assert text[start] == " " and not text[start - 1].isspace()
            assert not text[start + 1].isspace()
        assert all(b - a >= size for a, b in spans[:-1])  # only the last may be shorter


def test_pieces_of_a_span_and_a_text_that_only_grew_are_cut_alike() -> None:
    text = " ".join(f"word{n}" for n in range(2000))
    longer = text + " and more words at the end"
    first = list(text_pieces(text, size=100))
    assert list(text_pieces(longer, size=100))[: len(first) - 1] == first[:-1]
    inner = list(text_pieces(text, 10, 500, size=100))
    assert inner[0][0] == 10 and inner[-1][1] == 500


def test_the_cache_remembers_within_its_budget_oldest_out_first() -> None:
    calls: list[str] = []

    def tokenize(text: str) -> list[int]:
        calls.append(text)
        return [ord(c) for c in text]

    cache = PieceCache(budget=100)
    assert cache.ids("abc", tokenize) == array("I", [97, 98, 99])
    assert cache.ids("abc", tokenize) == array("I", [97, 98, 99])
    assert calls == ["abc"] and (cache.hits, cache.misses) == (1, 1)
    for n in range(30):
        cache.ids(f"{n:04d}", tokenize)  # 4 ids each: 120 > 100, the oldest go
    cache.ids("abc", tokenize)
    assert calls.count("abc") == 2
    cache.ids("x" * 26, tokenize)  # over a quarter of the budget: computed, not kept
    cache.ids("x" * 26, tokenize)
    assert calls.count("x" * 26) == 2


def test_a_spent_budget_tokenizes_nothing_more_but_cached_pieces_still_come() -> None:
    def tokenize(text: str) -> list[int]:
        return [ord(c) for c in text]

    cache = PieceCache()
    cache.ids("known", tokenize)
    budget = ColdBudget(10)
    assert cache.ids("first piece, longer than the budget", tokenize, budget) is not None
    assert budget.left < 0 and not budget.stopped
    assert cache.ids("second", tokenize, budget) is None  # spent: not tokenized
    assert budget.stopped
    assert cache.ids("known", tokenize, budget) is not None  # cached: free
    assert cache.ids("second", tokenize) is not None  # no budget: always


def _reader(cache: PieceCache, text: str, calls: list[str]) -> Reader:
    def tokenize(piece: str) -> list[int]:
        calls.append(piece)
        return [ord(c) for c in piece]

    return partial(cache.pieces, text, tokenize)


def test_a_prompt_its_budget_stopped_is_read_on_later_a_budget_at_a_time() -> None:
    """What one request's budget left unread is tokenized by ``ReadLater.read`` within the
    characters it is given, and then comes from the cache: the next request reads it
    whole within the same budget."""
    cache, later = PieceCache(), ReadLater()
    calls: list[str] = []
    text = " ".join(f"word{n:05d}" for n in range(600))  # 6,600 chars: 13 pieces
    reader = _reader(cache, text, calls)
    budget = ColdBudget(1024)
    first = list(later.reading("p", reader, budget, len(text)))
    assert budget.stopped and len(later) == 1
    assert sum(chars for _, chars in first) < len(text)
    read_by_request = len(calls)
    spent = later.read(1024)
    assert 1024 <= spent < 1024 + 2 * PIECE_CHARS
    assert len(later) == 1  # not done yet
    while later.read(1024):
        pass
    assert len(later) == 0
    assert "".join(calls) == text  # every piece tokenized once, in order
    assert len(calls) > read_by_request
    budget = ColdBudget(1024)
    again = list(later.reading("p", reader, budget, len(text)))
    assert sum(chars for _, chars in again) == len(text) and not budget.stopped
    assert len(later) == 0


def test_prompts_read_to_the_end_leave_and_the_longest_waiting_goes_past_the_limit() -> None:
    cache, later = PieceCache(), ReadLater(limit=2)
    calls: list[str] = []
    for name in ("a", "b", "c"):
        text = " ".join(f"{name}{n:05d}" for n in range(300))
        list(later.reading(name, _reader(cache, text, calls), ColdBudget(1), len(text)))
    assert len(later) == 2  # "a" forgotten
    calls.clear()
    while later.read(100_000):
        pass
    assert len(later) == 0 and {piece.strip()[0] for piece in calls} == {"b", "c"}
    list(later.reading("d", _reader(cache, "short", calls), ColdBudget(1), 5))
    assert len(later) == 0  # read whole: nothing left to read later
    assert later.read(1000) == 0


def test_a_prompt_the_tokenizer_fails_on_is_dropped() -> None:
    later = ReadLater()

    def failing(budget: ColdBudget | None) -> Iterator[tuple[Sequence[int], int]]:
        raise ValueError("odd text")
        yield  # a generator

    later.add("bad", failing, 10)
    assert later.read(1000) == 0 and len(later) == 0


def test_the_text_held_waiting_is_bounded_and_one_read_looks_at_few_prompts() -> None:
    cache = PieceCache()
    calls: list[str] = []
    later = ReadLater(chars=10_000)
    texts = [" ".join(f"t{n}w{i:04d}" for i in range(500)) for n in range(6)]  # ~4.5k chars
    for n, text in enumerate(texts):
        list(later.reading(n, _reader(cache, text, calls), ColdBudget(1), len(text)))
    assert len(later) == 2  # 4 x 4.5k chars: the oldest went
    for text in texts:  # the requests read them whole meanwhile: nothing left to tokenize
        list(cache.pieces(text, lambda piece: [len(piece)]))
    many = ReadLater()
    for n in range(20):
        many.add(n, _reader(cache, texts[n % 6], calls), len(texts[n % 6]))
    assert many.read(1000) == 0 and len(many) == 20 - READ_LATER_WALKS
