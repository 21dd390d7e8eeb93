"""Request parsing: output lengths, priorities and vLLM's 400/404 errors, without sockets."""

from __future__ import annotations

import re
from typing import Any

import pytest

from extproc.core.prompt import count_tokens
from loadtests.sim.request import (
    ApiError,
    GenerateRequest,
    parse_body,
    parse_generate,
)
from loadtests.sim.response import output_text


def parse(
    body: dict[str, Any], headers: dict[str, str] | None = None, chat: bool = True
) -> GenerateRequest:
    if chat:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    else:
        body = {"model": "m", "prompt": "hi", **body}
    return parse_generate(chat, body, headers or {}, ("m",), 1000, seed=1)


def test_ignore_eos_gives_exactly_max_tokens() -> None:
    assert parse({"max_tokens": 321, "ignore_eos": True}).output_len == 321


def test_without_ignore_eos_output_may_stop_early_but_never_before_min_tokens() -> None:
    lens = [
        parse(
            {
                "messages": [{"role": "user", "content": f"q{i}"}],
                "max_tokens": 400,
                "min_tokens": 50,
            }
        ).output_len
        for i in range(200)
    ]
    assert all(50 <= n <= 400 for n in lens)
    assert min(lens) < 400  # some answers end at a simulated EOS
    again = parse(
        {"messages": [{"role": "user", "content": "q7"}], "max_tokens": 400, "min_tokens": 50}
    )
    assert again.output_len == lens[7]  # seeded: same prompt, same length


def test_defaults_follow_vllm() -> None:
    assert parse({}, chat=False).max_tokens == 16  # completions default
    chat = parse({})
    assert chat.max_tokens == 1000 - chat.prompt_len  # chat: the rest of the model length
    assert parse({"max_completion_tokens": 9, "max_tokens": 3}).max_tokens == 9


def test_header_priority_wins_and_a_bad_header_is_ignored() -> None:
    assert parse({"priority": 7}, {"x-vllm-priority": "3"}).priority == 3
    assert parse({"priority": 7}, {"x-vllm-priority": "high"}).priority == 7
    assert parse({}, {"x-vllm-priority": "-2"}).priority == -2
    assert parse({}).priority == 0


@pytest.mark.parametrize(
    ("body", "status", "err_type", "param"),
    [
        ({"model": "other"}, 404, "NotFoundError", "model"),
        ({"messages": None}, 400, "BadRequestError", None),
        ({"messages": "x"}, 400, "Bad Request", "body.messages"),
        ({"priority": "urgent"}, 400, "Bad Request", "body.priority"),
        ({"priority": 1.5}, 400, "Bad Request", "body.priority"),
        ({"max_tokens": [3]}, 400, "Bad Request", "body.max_tokens"),
        ({"max_tokens": 5000}, 400, "BadRequestError", "max_tokens"),
        ({"max_tokens": 0}, 400, "BadRequestError", "max_tokens"),
        ({"min_tokens": -1}, 400, "BadRequestError", None),
        ({"max_tokens": 5, "min_tokens": 6}, 400, "BadRequestError", None),
    ],
)
def test_errors(body: dict[str, Any], status: int, err_type: str, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert (info.value.status, info.value.err_type, info.value.param) == (status, err_type, param)


def test_validation_messages_as_vllm() -> None:
    """Texts as vLLM 0.32 sends them (taken from the real server)."""
    with pytest.raises(ApiError) as info:
        parse({"priority": "abc"})
    assert info.value.message == (
        "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.priority', 'msg': 'Input "
        "should be a valid integer, unable to parse string as an integer', 'input': 'abc'}"
    )
    with pytest.raises(ApiError) as info:
        parse_body(b'{"model": "tiny", "messages": [')
    assert info.value.param == "body.31" and info.value.err_type == "Bad Request"
    assert info.value.message == (
        "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.31', 'msg': 'JSON decode "
        "error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting value'}}"
    )
    with pytest.raises(ApiError) as info:
        parse_body(b"")
    assert info.value.param == "body"
    with pytest.raises(ApiError) as info:
        parse_body(b"[1, 2]")
    assert info.value.param == "body" and "'input': '<list of 2 items>'" in info.value.message
    with pytest.raises(ApiError) as info:
        parse_generate(True, {"model": "tiny"}, {}, ("tiny",), 512, seed=0)
    assert info.value.param == "body.messages" and "'input': '<dict of 1 items>'" in str(
        info.value.message
    )


def test_lax_integers_and_max_tokens_clamped_to_the_model_length() -> None:
    assert parse({"priority": "3"}).priority == 3
    assert parse({"priority": "1.0"}).priority == 1
    assert parse({"priority": True}).priority == 1
    assert parse({"priority": 2.0}).priority == 2
    req = parse({"max_tokens": 1000, "ignore_eos": True})  # fits the model, not beside the prompt
    assert req.max_tokens == req.output_len == 1000 - req.prompt_len


def test_request_ids_have_16_hex_digits() -> None:
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", parse({}).request_id)
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", parse({}, chat=False).request_id)


def test_filler_text_counts_as_its_token_count() -> None:
    assert count_tokens(output_text(123)) == 123
