"""Request parsing: output lengths, priorities and vLLM's 400/404 errors, without sockets."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.prompt import count_tokens
from loadtests.sim.api import ApiError, GenerateRequest, output_text, parse_generate


def parse(body: dict[str, Any], headers: dict[str, str] | None = None,
          chat: bool = True) -> GenerateRequest:
    if chat:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    else:
        body = {"model": "m", "prompt": "hi", **body}
    return parse_generate(chat, body, headers or {}, ("m",), 1000, seed=1)


def test_ignore_eos_gives_exactly_max_tokens() -> None:
    assert parse({"max_tokens": 321, "ignore_eos": True}).output_len == 321


def test_without_ignore_eos_output_may_stop_early_but_never_before_min_tokens() -> None:
    lens = [parse({"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 400,
                   "min_tokens": 50}).output_len for i in range(200)]
    assert all(50 <= n <= 400 for n in lens)
    assert min(lens) < 400  # some answers end at a simulated EOS
    again = parse({"messages": [{"role": "user", "content": "q7"}], "max_tokens": 400,
                   "min_tokens": 50})
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
    ("body", "status", "param"),
    [
        ({"model": "other"}, 404, "model"),
        ({"messages": None}, 400, "messages"),
        ({"priority": "urgent"}, 400, "priority"),
        ({"max_tokens": 5000}, 400, "max_tokens"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 5, "min_tokens": 6}, 400, "min_tokens"),
    ],
)
def test_errors(body: dict[str, Any], status: int, param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert (info.value.status, info.value.param) == (status, param)


def test_filler_text_counts_as_its_token_count() -> None:
    assert count_tokens(output_text(123)) == 123
