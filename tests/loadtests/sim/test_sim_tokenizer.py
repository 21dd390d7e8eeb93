"""``fairlane sim --tokenizer DIR`` and ``cache_salt``: prompts tokenized by the model's own
tokenizer and chat template (``extproc.fleet.tokenizer.EngineTokenizer``), a salted first
block, and both reaching the block hashes, the KV events and the prompt's token count.

The tokenizer is the tiny model's, trained offline in a fraction of a second
(``loadtests.conformance.tiny_model.build_tokenizer``); the conformance test runs the same
against the real vLLM (``tests/conformance/test_kv_events_conformance.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.core.blockhash import BlockHasher
from extproc.core.prompt import render_chat, tokenize
from extproc.fleet.tokenizer import MAX_PROMPT_CHARS, EngineTokenizer
from extproc.ops.processes import free_port
from loadtests.conformance.tiny_model import BOS
from loadtests.sim.blocks import BlockPool, block_hashes
from loadtests.sim.cli import add_arguments, config_from_args, run
from loadtests.sim.kv_events import Event, block_stored
from loadtests.sim.kv_publisher import KVEventsConfig
from loadtests.sim.request import ApiError, GenerateRequest, parse_generate
from loadtests.sim.server import SIM_KEY, SimConfig, start
from tests.polling import until

MESSAGES = [
    {"role": "system", "content": "be brief and kind to the ratu"},
    {"role": "user", "content": "kalo mine ratu sepo difa " * 12},
]
SALT_EMPTY = "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"
SALT_BAD = (
    "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
    "'\\\\', or NUL. (parameter=cache_salt)"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer: Path) -> EngineTokenizer:
    return EngineTokenizer.from_dir(tiny_tokenizer, max_chars=None)


def with_template(tiny_tokenizer: Path, target: Path, template: str | None) -> Path:
    """A copy of the tiny tokenizer with another chat template (None: none at all)."""
    target.mkdir()
    shutil.copy(tiny_tokenizer / "tokenizer.json", target / "tokenizer.json")
    config = json.loads((tiny_tokenizer / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if template is not None:
        config["chat_template"] = template
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def parse(
    body: dict[str, Any],
    tokenizer: EngineTokenizer | None,
    chat: bool = True,
    max_model_len: int = 4096,
) -> GenerateRequest:
    return parse_generate(chat, {"model": "m", **body}, {}, ("m",), max_model_len, 0, tokenizer)


# ----------------------------------------------------------------------------- tokenizer


def test_a_chat_is_the_models_template_and_tokens(tokenizer: EngineTokenizer) -> None:
    body = {"messages": MESSAGES}
    gen = parse(body, tokenizer)
    assert gen.prompt_token_ids == tokenizer.body_ids(body)
    text = tokenizer.render_chat(MESSAGES)
    assert text.startswith(BOS) and text.endswith("<|assistant|>")
    assert gen.prompt_token_ids == tokenizer.encode(text)  # no special tokens added to chat
    assert gen.prompt_token_ids != tokenize(render_chat(MESSAGES))  # not the builtin's
    # vLLM's chat options reach the template and the encoder
    no_prompt = parse({"messages": MESSAGES, "add_generation_prompt": False}, tokenizer)
    assert no_prompt.prompt_token_ids == tokenizer.encode(tokenizer.render_chat(MESSAGES, False))


def test_a_completion_gets_the_tokenizers_special_tokens_and_token_ids_stay(
    tokenizer: EngineTokenizer,
) -> None:
    prompt = "kalo mine ratu sepo difa"
    gen = parse({"prompt": prompt}, tokenizer, chat=False)
    assert gen.prompt_token_ids == tokenizer.encode(prompt, add_special_tokens=True)
    assert parse({"prompt": [prompt]}, tokenizer, chat=False).prompt_token_ids == (
        gen.prompt_token_ids
    )
    bare = parse({"prompt": prompt, "add_special_tokens": False}, tokenizer, chat=False)
    assert bare.prompt_token_ids == tokenizer.encode(prompt)
    # a stray "messages" in a completion body does not make it a chat
    stray = parse({"prompt": prompt, "messages": MESSAGES}, tokenizer, chat=False)
    assert stray.prompt_token_ids == gen.prompt_token_ids
    assert parse({"prompt": [5, 6, 7]}, tokenizer, chat=False).prompt_token_ids == [5, 6, 7]


def test_the_real_count_decides_length_limits_and_a_long_prompt_is_not_cut(
    tokenizer: EngineTokenizer,
) -> None:
    gen = parse({"messages": MESSAGES}, tokenizer)
    assert gen.max_tokens == 4096 - gen.prompt_len  # chat: what the real prompt leaves
    with pytest.raises(ApiError) as info:
        parse({"messages": MESSAGES}, tokenizer, max_model_len=gen.prompt_len - 1)
    assert info.value.param == "input_tokens"
    assert f"at least {gen.prompt_len} input tokens" in info.value.message
    # the gateway cuts its lookups at MAX_PROMPT_CHARS; the engine counts every token
    prompt = "kalo mine ratu sepo difa " * (MAX_PROMPT_CHARS // 10)
    long = parse({"prompt": prompt}, tokenizer, chat=False, max_model_len=1 << 20)
    assert long.prompt_token_ids == tokenizer.encode(prompt, add_special_tokens=True)
    gateways = EngineTokenizer.from_dir(tokenizer.source).body_ids({"prompt": prompt})
    assert gateways is not None and len(gateways) < long.prompt_len


def test_template_errors_and_a_missing_template_are_400s(
    tiny_tokenizer: Path, tmp_path: Path
) -> None:
    strict = with_template(
        tiny_tokenizer,
        tmp_path / "strict",
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tools here') }}{% endif %}{{ m['content'] }}{% endfor %}",
    )
    tok = EngineTokenizer.from_dir(strict)
    assert parse({"messages": MESSAGES}, tok).prompt_len > 0
    with pytest.raises(ApiError) as info:
        parse({"messages": [{"role": "tool", "content": "x"}]}, tok)
    assert (info.value.status, info.value.err_type, info.value.message) == (
        400,
        "BadRequestError",
        "no tools here",
    )
    bare = EngineTokenizer.from_dir(with_template(tiny_tokenizer, tmp_path / "bare", None))
    with pytest.raises(ApiError) as info:
        parse({"messages": MESSAGES}, bare)
    assert info.value.status == 400 and "chat template" in info.value.message
    assert parse({"prompt": "kalo"}, bare, chat=False).prompt_len > 0  # completions still work


def test_the_flag(tiny_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).tokenizer is None
    args = parser.parse_args(["--tokenizer", str(tiny_tokenizer), "--port", str(free_port())])
    assert config_from_args(args).tokenizer == tiny_tokenizer
    # a directory without a tokenizer: a one-line error, no traceback, exit status 2
    assert run(parser.parse_args(["--tokenizer", str(tmp_path), "--port", "1"])) == 2
    assert "--tokenizer" in capsys.readouterr().err


# ----------------------------------------------------------------------------- cache_salt


@pytest.mark.parametrize("chat", [True, False])
def test_cache_salt_is_checked_as_vllm_checks_it_before_anything_else(chat: bool) -> None:
    base = {"messages": MESSAGES} if chat else {"prompt": "kalo"}
    assert parse({**base, "cache_salt": "tenant-a"}, None, chat).cache_salt == "tenant-a"
    assert parse({**base, "cache_salt": None}, None, chat).cache_salt is None
    assert parse({**base, "cache_salt": "x" * 128}, None, chat).cache_salt == "x" * 128
    for salt, message in [
        ("", SALT_EMPTY),
        (5, SALT_EMPTY),
        (["a"], SALT_EMPTY),
        (True, SALT_EMPTY),
        ("x" * 129, SALT_BAD),
        ("a@b", SALT_BAD),
        ("a/b", SALT_BAD),
        ("a\\b", SALT_BAD),
        ("a\x00b", SALT_BAD),
    ]:
        # before the field checks (a bad priority) and the model (an unknown one)
        body = {**base, "cache_salt": salt, "priority": "high", "model": "other"}
        with pytest.raises(ApiError) as info:
            parse_generate(chat, body, {}, ("m",), 4096, 0)
        error = info.value
        assert (error.status, error.err_type, error.param, error.message) == (
            400,
            "BadRequestError",
            "cache_salt",
            message,
        ), salt


def test_a_salt_changes_the_first_blocks_hash_and_so_the_chain() -> None:
    tokens = list(range(100, 148))
    salted = block_hashes(tokens, 16, cache_salt="tenant-a")
    assert salted == BlockHasher().chain(tokens, 16, "tenant-a")
    assert not set(salted) & set(block_hashes(tokens, 16))
    assert salted != block_hashes(tokens, 16, cache_salt="tenant-b")


def test_the_first_blocks_event_carries_the_salt_untagged() -> None:
    pool = BlockPool(8, 16)
    pool.record_events()
    tokens = list(range(64))
    hashes = block_hashes(tokens, 16, cache_salt="tenant-a")
    keys = BlockHasher().keys(tokens, 16, "tenant-a")
    blocks = pool.allocate(4)
    assert blocks is not None
    pool.cache_full(blocks, hashes, 0, 2, tokens, "tenant-a")
    pool.cache_full(blocks, hashes, 2, 4, tokens, "tenant-a")
    assert pool.take_events() == [
        block_stored(keys[:2], None, tokens[:32], 16, [["tenant-a"], None]),
        block_stored(keys[2:], keys[1], tokens[32:], 16, [None, None]),
    ]


# ----------------------------------------------------------------------------- the server


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_the_server_hashes_and_counts_the_models_tokens_and_the_salt(
    tiny_tokenizer: Path, tokenizer: EngineTokenizer, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """``--tokenizer`` with KV events: ``usage.prompt_tokens``, the prefix cache and the
    BlockStored events are the model tokenizer's ids, the salt on the first block."""
    port = free_port()
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/pub.sock"})
    config = SimConfig(
        model="tiny",
        speedup=50,
        block_size=16,
        tokenizer=tiny_tokenizer,
        kv_events_config=KVEventsConfig.parse(events),
    )
    runner = await start(config, "127.0.0.1", port)
    sim = runner.app[SIM_KEY]
    assert sim.publisher is not None
    published: list[Event] = []

    def capture(events: list[Event], ts: float | None = None) -> int:
        published.extend(events)  # what would go on the wire, before encoding
        return 0

    sim.publisher.publish = capture  # type: ignore[method-assign]
    base = f"http://127.0.0.1:{port}"
    hasher = sim.hasher

    async def post(body: dict[str, Any]) -> dict[str, Any]:
        published.clear()
        body = {"model": "tiny", "max_tokens": 2, "messages": MESSAGES, **body}
        async with session.post(base + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            answer: dict[str, Any] = await resp.json()
        await until(lambda: bool(published), "the request's BlockStored")
        return answer

    try:
        ids = tokenizer.body_ids({"messages": MESSAGES})
        assert ids is not None and len(ids) >= 48
        answer = await post({})
        assert answer["usage"]["prompt_tokens"] == len(ids)
        stored = [e for e in published if e["type"] == "BlockStored"]
        full = len(ids) // 16
        assert [k for e in stored for k in e["block_hashes"]] == hasher.keys(ids, 16)
        assert [t for e in stored for t in e["token_ids"]] == ids[: full * 16]
        assert [x for e in stored for x in e["extra_keys"]] == [None] * full

        salted = await post({"cache_salt": "tenant-a"})
        assert salted["usage"]["prompt_tokens"] == len(ids)
        stored = [e for e in published if e["type"] == "BlockStored"]
        keys = [k for e in stored for k in e["block_hashes"]]
        assert keys == hasher.keys(ids, 16, "tenant-a")  # nothing shared: all stored again
        extra = [x for e in stored for x in e["extra_keys"]]
        assert extra == [["tenant-a"]] + [None] * (full - 1)
        assert stored[0]["parent_block_hash"] is None
    finally:
        await runner.cleanup()
