"""Cutting prompts into pieces and remembering their ids (extproc.fleet.pieces)."""

from __future__ import annotations

import itertools
import random
from array import array

from extproc.fleet.pieces import ColdBudget, PieceCache, text_pieces


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
