"""``POST /tokenize``: the ids a generate request with the same body would have.

vllm-router's ``kv_aware`` policy asks an engine for a prompt's tokens this way and matches
them against the ``token_ids`` of its KV events, so the answer must be the engine's own ids,
with the built-in tokenizer and with ``--tokenizer DIR``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.core.prompt import pieces, render_chat, tokenize
from extproc.ops.processes import free_port
from loadtests.sim.request import ApiError, parse_generate
from loadtests.sim.server import SimConfig, start
from loadtests.sim.tokenize import tokenize_answer

MESSAGES = [
    {"role": "system", "content": "be brief and kind to the ratu"},
    {"role": "user", "content": "kalo mine ratu sepo difa " * 12},
]


def test_a_chat_is_the_ids_a_generate_request_would_have() -> None:
    body: dict[str, Any] = {"model": "m", "messages": MESSAGES}
    answer = tokenize_answer(body, ("m",), 4096)
    generate = parse_generate(True, {**body, "max_tokens": 1}, {}, ("m",), 4096, 0)
    assert answer["tokens"] == generate.prompt_token_ids == tokenize(render_chat(MESSAGES))
    assert answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == 4096
    assert answer["token_strs"] is None


def test_a_completion_prompt_and_the_token_strings() -> None:
    answer = tokenize_answer({"prompt": "hello there", "return_token_strs": True}, ("m",), 10)
    assert answer["tokens"] == tokenize("hello there")
    assert answer["token_strs"] == pieces("hello there")


def test_an_unknown_model_is_vllms_404_and_an_empty_body_a_400() -> None:
    with pytest.raises(ApiError) as unknown:
        tokenize_answer({"model": "other", "messages": MESSAGES}, ("m",), 10)
    assert unknown.value.status == 404
    with pytest.raises(ApiError) as empty:
        tokenize_answer({"model": "m"}, ("m",), 10)
    assert empty.value.status == 400


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_the_server_answers_with_the_model_tokenizers_ids(
    tiny_tokenizer: Path, session: aiohttp.ClientSession
) -> None:
    """With ``--tokenizer DIR``: the template's and the model tokenizer's ids, the same the
    request's ``usage.prompt_tokens`` counts."""
    port = free_port()
    config = SimConfig(model="tiny", speedup=50, tokenizer=tiny_tokenizer)
    runner = await start(config, "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    try:
        body = {"model": "tiny", "messages": MESSAGES}
        async with session.post(base + "/tokenize", json=body) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        async with session.post(
            base + "/v1/chat/completions", json={**body, "max_tokens": 1}
        ) as resp:
            usage = (await resp.json())["usage"]
        assert answer["count"] == usage["prompt_tokens"] == len(answer["tokens"])
        assert answer["tokens"] != tokenize(render_chat(MESSAGES))
        async with session.post(base + "/tokenize", json={"model": "x", "prompt": "a"}) as resp:
            assert resp.status == 404
    finally:
        await runner.cleanup()
