"""The engine's tokenizer and chat template in the gateway (extproc.fleet.tokenizer).

The tokenizer is the tiny model's (loadtests/conformance/tiny_model.py trains it offline in
a fraction of a second): a byte-level BPE with special role tokens, as real chat models have.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, normalizers

from extproc.fleet.pieces import COLD_CHARS, PIECE_CHARS
from extproc.fleet.tokenizer import EngineTokenizer, TokenizerError
from loadtests.conformance.tiny_model import BOS


@pytest.fixture
def tokenizer(tiny_tokenizer: Path) -> EngineTokenizer:
    return EngineTokenizer.from_dir(tiny_tokenizer)


def test_segments_encode_as_the_whole_text(
    tokenizer: EngineTokenizer, tiny_tokenizer: Path
) -> None:
    """Text between special tokens is tokenized on its own, so caching it changes nothing."""
    plain = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json"))
    rng = random.Random(7)
    words = ["kaloto", " the", "gen", "12", " 345", ".", "\n", "  ", "<|user|>", "</s>", "<s>", "é"]
    for _ in range(200):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(0, 60)))
        assert tokenizer.encode(text) == plain.encode(text, add_special_tokens=False).ids, text
    assert tokenizer.cache.hits > 0


def test_long_texts_read_in_pieces_give_the_whole_texts_ids(
    tokenizer: EngineTokenizer, tiny_tokenizer: Path
) -> None:
    """Pieces are cut only where a word starts (``text_pieces``), so their ids are the
    whole text's, with the special tokens a completion's encoding puts around it too."""
    plain = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json"))
    rng = random.Random(11)
    words = [" kaloto", " the", "gen", " 12", "345", ".", ",", "\n", "  ", " é", "\t", "<|user|>"]
    for _ in range(30):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(200, 2000)))
        pieces = tokenizer.body_pieces({"prompt": text, "add_special_tokens": False}, None)
        assert pieces is not None and pieces.chars == len(text)
        read = list(pieces.pieces)
        assert len(read) > 1 and sum(chars for _, chars in read) == len(text)
        assert [i for ids, _ in read for i in ids] == plain.encode(
            text, add_special_tokens=False
        ).ids
        assert tokenizer.body_ids({"prompt": text}) == plain.encode(text).ids


def test_one_request_tokenizes_at_most_its_budget_of_new_text(
    tokenizer: EngineTokenizer, tiny_tokenizer: Path
) -> None:
    """Past ``COLD_CHARS`` of text not in the cache a prompt reads as ended; what was read
    is cached, so the next request with the same prompt reads that far and further."""
    plain = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json"))
    text = " ".join(f"kaloto{n} the gen" for n in range(1500))  # within MAX_PROMPT_CHARS
    whole = plain.encode(text, add_special_tokens=False).ids
    read: list[int] = []
    for _ in range(100):
        pieces = tokenizer.body_pieces({"prompt": text, "add_special_tokens": False})
        assert pieces is not None
        again = [i for ids, chars in pieces.pieces for i in ids]
        assert again == whole[: len(again)]
        assert len(read) < len(again) or len(again) == len(whole)
        if len(read) == len(whole):
            break
        new_chars = len(plain.decode(again[len(read) :]))
        assert new_chars <= COLD_CHARS + PIECE_CHARS * 2
        read = again
    assert read == whole


def test_what_a_budget_left_unread_is_read_later_and_the_next_request_reads_it_whole(
    tokenizer: EngineTokenizer, tiny_tokenizer: Path
) -> None:
    """The rest of a prompt one request's budget stopped is read between requests
    (``later.read``): the next request with it reads all of it from the cache, within its
    budget, and gets the ids of the whole."""
    plain = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json"))
    text = " ".join(f"mineral{n} the gen" for n in range(1500))
    body = {"prompt": text, "add_special_tokens": False}
    first = tokenizer.body_pieces(body)
    assert first is not None
    read = [i for ids, _ in first.pieces for i in ids]
    whole = plain.encode(text, add_special_tokens=False).ids
    assert len(read) < len(whole) and len(tokenizer.later) == 1
    rounds = 0
    while tokenizer.later.read(PIECE_CHARS):
        rounds += 1
    assert rounds >= (len(text) - 2 * COLD_CHARS) // (2 * PIECE_CHARS)  # a piece or so each
    misses = tokenizer.cache.misses
    again = tokenizer.body_pieces(body)
    assert again is not None
    assert [i for ids, _ in again.pieces for i in ids] == whole
    assert tokenizer.cache.misses == misses and len(tokenizer.later) == 0


def test_a_tokenizer_whose_ids_change_where_text_is_cut_reads_it_whole(
    tiny_tokenizer: Path,
) -> None:
    """A normalizer that prepends to every input (older SentencePiece conversions) would
    give each piece a token the whole text has once: such a tokenizer is found out when it
    is loaded and tokenizes whole texts."""
    plain = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json"))
    plain.normalizer = normalizers.Prepend("@")
    tokenizer = EngineTokenizer(plain, None, {})
    text = " ".join(["kaloto the gen"] * 400)
    pieces = tokenizer.body_pieces({"prompt": text})
    assert pieces is not None and len(list(pieces.pieces)) == 1
    assert tokenizer.encode(text) == plain.encode(text, add_special_tokens=False).ids


def test_chat_renders_the_template_without_added_special_tokens(
    tokenizer: EngineTokenizer, tiny_tokenizer: Path
) -> None:
    plain = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json"))
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}],
        },
    ]
    text = tokenizer.render_chat(messages)
    assert text == f"{BOS}<|system|>be brief</s>\n<|user|>hello\nthere</s>\n<|assistant|>"
    ids = tokenizer.body_ids({"messages": messages})
    assert ids == plain.encode(text, add_special_tokens=False).ids
    assert ids is not None and ids[0] == plain.token_to_id(BOS)


def test_completion_prompt_and_bodies_without_one(
    tokenizer: EngineTokenizer, tiny_tokenizer: Path
) -> None:
    plain = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json"))
    assert tokenizer.body_ids({"prompt": "the kaloto"}) == plain.encode("the kaloto").ids
    assert tokenizer.body_ids({"prompt": ["the kaloto"]}) == plain.encode("the kaloto").ids
    assert tokenizer.body_ids({"prompt": [1, 2, 3]}) is None
    assert tokenizer.body_ids({"prompt": ["a", "b"]}) is None
    assert tokenizer.body_ids({"input": "x"}) is None


def test_a_conversation_resent_costs_only_its_new_turn(tokenizer: EngineTokenizer) -> None:
    history = [{"role": "user", "content": "the kaloto " * 200}]
    tokenizer.body_ids({"messages": history})
    misses = tokenizer.cache.misses
    longer = [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    tokenizer.body_ids({"messages": longer})
    assert tokenizer.cache.misses - misses == 2  # "ok" and "more"


def test_missing_or_broken_files_say_which(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: no such file"):
        EngineTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        EngineTokenizer.from_dir(tmp_path)


def test_no_template_means_no_chat_ids(tiny_tokenizer: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text((tiny_tokenizer / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS}))
    tokenizer = EngineTokenizer.from_dir(tmp_path)
    assert tokenizer.body_ids({"messages": [{"role": "user", "content": "x"}]}) is None
    assert tokenizer.body_ids({"prompt": "x"}) is not None
