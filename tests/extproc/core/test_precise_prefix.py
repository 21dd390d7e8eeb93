"""Precise prefix affinity: prompts matched against what engines' KV events say they hold.

The gateway tokenizes with the engine's tokenizer and chat template (the tiny model's,
trained offline in a fraction of a second) and hashes with vLLM's chain; the engines' block
indexes are filled here as their KV events would fill them (``KVBlockIndex.apply``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from extproc.core.admission import Admission
from extproc.core.blockhash import BlockHasher
from extproc.core.prefix import EngineHashing, PromptBlocks, PromptTokenizer
from extproc.fleet.backend import Backend, BackendPool, BackendSpec, KVEventPorts
from extproc.fleet.kv_events import EXPECT_S, BlocksStored
from extproc.fleet.pieces import COLD_CHARS, TokenPieces
from extproc.fleet.tokenizer import EngineTokenizer
from tests.extproc.factories import API, FakeClock, Request, policy, scraped

SYSTEM = "You are the support assistant of kaloto. Answer with the generation of minerals. " * 8


@pytest.fixture(scope="module")
def engine(tiny_tokenizer: Path) -> EngineHashing:
    return EngineHashing(EngineTokenizer.from_dir(tiny_tokenizer), BlockHasher())


def chat(question: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    }


def setup(
    engine: EngineHashing, backends: int = 2, events: bool = True
) -> tuple[Admission, BackendPool, FakeClock]:
    clock = FakeClock()
    ports = KVEventPorts(5557) if events else None
    specs = [
        BackendSpec("127.0.0.1", 9000 + i, "r", seats=16, kv_events=ports) for i in range(backends)
    ]
    pool = BackendPool(specs, clock=clock)
    for backend in pool.backends:
        scraped(backend, clock)
        if backend.kv_index is not None:
            backend.kv_index.live = True
    admission = Admission(pool, policy(16))
    admission.engine = engine
    return admission, pool, clock


def submit(admission: Admission, request_id: str, request: Request) -> None:
    admission.submit(request_id, request)  # type: ignore[arg-type]


def request(body: dict[str, Any]) -> Request:
    return Request(API, prompt_text="", body=body)


def holds(backend: Backend, engine: EngineHashing, body: dict[str, Any]) -> None:
    keys = PromptBlocks("", "", body, engine).keys(backend.block_size)
    assert keys, "the prompt must span full blocks"
    assert backend.kv_index is not None
    backend.kv_index.apply([BlocksStored(tuple(keys), backend.block_size)])


def test_the_engine_that_holds_the_prefix_gets_the_request(engine: EngineHashing) -> None:
    admission, pool, _ = setup(engine)
    second = pool.backends[1]
    holds(second, engine, chat("an earlier question"))
    keys = PromptBlocks("", "", chat("a new question"), engine).keys(second.block_size)
    assert keys is not None
    held = second.precise_prefix(keys)
    assert held  # the system prompt's blocks, held since the earlier question
    submit(admission, "q", request(chat("a new question")))
    assert admission.backend_of("q") is second
    assert admission.picks[(second.address, "prefix")] == 1
    assert admission.prefix_index[(second.address, "precise")] == 1
    assert admission.prefix_tokens[(second.address, "precise")] == held * second.block_size


def test_a_burst_follows_the_first_before_the_engine_confirms(engine: EngineHashing) -> None:
    admission, pool, clock = setup(engine)
    submit(admission, "a", request(chat("one")))
    chosen = admission.backend_of("a")
    submit(admission, "b", request(chat("two")))
    assert admission.backend_of("b") is chosen  # expected there, not yet stored
    admission.release("a")
    admission.release("b")
    clock.now += EXPECT_S + 1  # never confirmed by an event: the expectation lapses
    for backend in pool.backends:
        scraped(backend, clock)
    other = next(b for b in pool.backends if b is not chosen)
    holds(other, engine, chat("x"))
    submit(admission, "c", request(chat("three")))
    assert admission.backend_of("c") is other


def test_an_index_not_yet_live_falls_back_to_the_approximate_one(engine: EngineHashing) -> None:
    admission, pool, _ = setup(engine)
    first, second = pool.backends
    holds(second, engine, chat("y"))
    assert second.kv_index is not None
    second.kv_index.live = False
    submit(admission, "q", Request(API, prompt_text="unrelated", body=chat("z")))
    assert admission.backend_of("q") is first  # load tie: the first configured
    assert admission.prefix_index[(first.address, "precise")] == 1
    assert second.precise_prefix([1, 2]) is None


def test_without_events_or_tokenizer_affinity_is_approximate(engine: EngineHashing) -> None:
    admission, pool, _ = setup(engine, events=False)
    assert all(b.kv_index is None for b in pool.backends)
    submit(admission, "q", request(chat("q")))
    assert sum(admission.prefix_index[(b.address, "approximate")] for b in pool.backends) == 1
    assert PromptBlocks("text", "", chat("q"), None).keys(16) is None


def test_bodies_without_one_text_prompt_have_no_keys(engine: EngineHashing) -> None:
    assert PromptBlocks("", "", {"prompt": [1, 2, 3]}, engine).keys(16) is None
    short = PromptBlocks("", "", {"prompt": "too short"}, engine).keys(16)
    assert short is not None and short.all() == [] and short.total() == 0


def test_cache_salt_keeps_tenants_apart(engine: EngineHashing) -> None:
    plain = PromptBlocks("", "", chat("q"), engine).keys(16)
    salted = PromptBlocks("", "", {**chat("q"), "cache_salt": "t1"}, engine).keys(16)
    assert plain and salted and not set(plain) & set(salted)


class CountingTokenizer:
    """The engine's tokenizer, counting the token ids the picker reads."""

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache = tokenizer.cache
        self.later = tokenizer.later
        self.read = 0

    def body_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        return self.tokenizer.body_ids(body)

    def body_pieces(self, body: Mapping[str, Any]) -> TokenPieces | None:
        pieces = self.tokenizer.body_pieces(body)
        if pieces is None:
            return None

        def counted() -> Iterator[tuple[Sequence[int], int]]:
            for piece in pieces.pieces:
                self.read += len(piece[0])
                yield piece

        return TokenPieces(counted(), pieces.chars)


def long_chat(document: str, question: str) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": SYSTEM + document},
            {"role": "user", "content": question},
        ]
    }


DOCUMENT = " ".join(f"Paragraph {n} says the mineral kaloto{n} grows slowly." for n in range(300))


def test_keys_read_lazily_are_the_whole_prompts_keys(engine: EngineHashing) -> None:
    body = long_chat(DOCUMENT, "what grows?")
    ids = engine.tokenizer.body_ids(body)
    assert ids and len(ids) > 1000
    for size in (16, 128):
        keys = PromptBlocks("", "", body, engine).keys(size)
        assert keys is not None
        assert keys.total() > 0
        assert keys.all() == engine.hasher.keys(ids, size)
        assert keys.total() == len(ids) // size  # exact once all is read


PIECE_TOKENS = 400
"""More than a piece of ``PIECE_CHARS`` characters of this text ever tokenizes to."""


def test_a_prompt_no_engine_holds_is_tokenized_no_further_than_its_first_block(
    engine: EngineHashing,
) -> None:
    admission, _, _ = setup(engine)
    counting = CountingTokenizer(engine.tokenizer)
    admission.engine = EngineHashing(counting, engine.hasher)
    body = long_chat(DOCUMENT, "what grows?")
    whole = engine.tokenizer.body_ids(body)
    assert whole is not None and len(whole) > 10 * PIECE_TOKENS
    submit(admission, "q", request(body))
    assert admission.backend_of("q") is not None
    assert 0 < counting.read < 16 + PIECE_TOKENS  # nobody holds the first block: no more


def test_matching_reads_one_block_past_the_longest_held_prefix(engine: EngineHashing) -> None:
    admission, pool, _ = setup(engine)
    counting = CountingTokenizer(engine.tokenizer)
    admission.engine = EngineHashing(counting, engine.hasher)
    holder = pool.backends[1]
    assert holder.kv_index is not None
    earlier = long_chat(DOCUMENT, "an earlier question")
    keys = PromptBlocks("", "", earlier, engine).keys(holder.block_size)
    assert keys is not None
    held = keys.all()[:40]  # the engine kept the first 40 blocks of the document
    holder.kv_index.apply([BlocksStored(tuple(held), holder.block_size)])
    submit(admission, "q", request(long_chat(DOCUMENT, "a new question")))
    assert admission.backend_of("q") is holder
    assert 41 * holder.block_size <= counting.read < 41 * holder.block_size + PIECE_TOKENS


def test_holders_tied_where_reading_stopped_are_told_apart_by_what_was_sent_there(
    engine: EngineHashing, tiny_tokenizer: Path
) -> None:
    """Both engines hold all of a long prompt this service never read: one request reads
    only its budget of it (``COLD_CHARS``), so both match all that was read. The one this
    gateway sent the prompt to before (the approximate index) keeps it, not the one a
    load tie would pick."""
    admission, pool, _ = setup(engine)
    admission.engine = EngineHashing(EngineTokenizer.from_dir(tiny_tokenizer), engine.hasher)
    first, second = pool.backends
    body = long_chat(DOCUMENT, "a question")
    text = str(body["messages"][0]["content"])
    assert len(text) > COLD_CHARS
    for backend in (first, second):
        keys = PromptBlocks("", "", body, engine).keys(backend.block_size)
        assert keys is not None and backend.kv_index is not None
        backend.kv_index.apply([BlocksStored(tuple(keys.all()), backend.block_size)])
    second.prefix_cache.record(PromptBlocks(text).blocks(second.block_size))
    submit(admission, "q", Request(API, prompt_text=text, body=body))
    assert admission.backend_of("q") is second
    assert admission.picks[(second.address, "prefix")] == 1
