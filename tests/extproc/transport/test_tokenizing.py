"""Long prompts tokenized in a worker thread (extproc.transport.tokenizing)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from extproc.fleet.tokenizer import EngineTokenizer
from extproc.transport.tokenizing import OffLoopTokenizer


class RecordingTokenizer(EngineTokenizer):
    """The tiny model's tokenizer, noting which thread each body was tokenized in."""

    threads: list[str]

    def body_ids(self, body: Any) -> list[int] | None:
        self.threads.append(threading.current_thread().name)
        return super().body_ids(body)


@pytest.fixture
def tokenizer(tiny_tokenizer: Path) -> RecordingTokenizer:
    plain = EngineTokenizer.from_dir(tiny_tokenizer)
    recording = RecordingTokenizer.__new__(RecordingTokenizer)
    recording.__dict__.update(plain.__dict__)
    recording.threads = []
    return recording


def chat(text: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}]}).encode()


async def test_ids_are_the_inline_ids_computed_in_a_worker_thread(
    tokenizer: RecordingTokenizer,
) -> None:
    off = OffLoopTokenizer(tokenizer, min_bytes=1024)
    try:
        body = chat("the kaloto generation of minerals " * 400)
        assert off.wants(body) and not off.wants(chat("short"))
        ids = await off.ids(body)
        assert ids == tokenizer.body_ids(json.loads(body))
        assert tokenizer.threads[0].startswith("tokenize")
        assert tokenizer.threads[1] == threading.current_thread().name
        assert off.offloaded == 1
    finally:
        off.close()


async def test_bodies_without_one_text_prompt_give_none(tokenizer: RecordingTokenizer) -> None:
    off = OffLoopTokenizer(tokenizer, min_bytes=0)
    try:
        assert await off.ids(b"{not json") is None
        assert await off.ids(b"[1, 2]") is None
        assert await off.ids(json.dumps({"prompt": [1, 2, 3]}).encode()) is None
    finally:
        off.close()
