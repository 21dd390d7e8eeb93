"""Per-request decisions: body parsing, authentication, tier, user, workload, size."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.core.body import parse_body
from extproc.core.classify import RequestClass, authenticate, classify, prompt_tokens
from extproc.core.errors import Rejection
from extproc.core.events import RequestInfo
from extproc.policy import DEFAULT_POLICY_PATH, Policy, load_policy, parse_policy

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def policy() -> Policy:
    return load_policy(DEFAULT_POLICY_PATH)


def request(
    key: str | None = "sk-chat-demo",
    body: dict[str, Any] | bytes | None = None,
    path: str = CHAT,
    method: str = "POST",
    raw_headers: dict[str, str] | None = None,
    **headers: str,
) -> RequestInfo:
    all_headers = {name.replace("_", "-"): value for name, value in headers.items()}
    all_headers.update(raw_headers or {})
    if key is not None:
        all_headers["authorization"] = f"Bearer {key}"
    if body is None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return RequestInfo(method=method, path=path, headers=all_headers, body=raw)


def run(policy: Policy, info: RequestInfo) -> RequestClass:
    return classify(policy, info, parse_body(policy, info))


def rejection(policy: Policy, info: RequestInfo) -> Rejection:
    with pytest.raises(Rejection) as caught:
        run(policy, info)
    return caught.value


def error_of(rej: Rejection) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(rej.body)["error"]
    return error


# --------------------------------------------------------------------------- parse_body


def test_parse_body_returns_the_object(policy: Policy) -> None:
    assert parse_body(policy, request(body={"model": "m"})) == {"model": "m"}


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'{"model": ', "could not parse the JSON body"),
        (b"\xff\xfe\xfa", "could not parse the JSON body"),
        (b"[1, 2]", "must be a JSON object, not an array"),
        (b'"text"', "must be a JSON object, not a string"),
        (b"3", "must be a JSON object, not an integer"),
        (b"3.5", "must be a JSON object, not a number"),
        (b"null", "must be a JSON object, not null"),
        (b"", "body is empty"),
        (b"[" * 100_000 + b"]" * 100_000, "could not parse the JSON body"),
    ],
)
def test_malformed_body_is_400(policy: Policy, raw: bytes, words: str) -> None:
    rej = rejection(policy, request(body=raw))
    assert rej.status == 400
    assert words in rej.message
    assert error_of(rej)["type"] == "invalid_request_error"


def test_empty_body_is_fine_for_bodiless_methods(policy: Policy) -> None:
    assert parse_body(policy, request(body=b"", method="GET")) == {}


def test_body_over_the_limit_is_413(policy: Policy) -> None:
    text = DEFAULT_POLICY_PATH.read_text()
    small = parse_policy(text.replace("max_body_bytes: 8388608", "max_body_bytes: 100"), "s.yaml")
    fits = {"model": "m", "prompt": "x" * 60}
    assert len(json.dumps(fits)) <= 100
    assert parse_body(small, request(body=fits))["prompt"] == "x" * 60
    rej = rejection(small, request(body={"model": "m", "prompt": "x" * 200}))
    assert rej.status == 413
    assert "limit is 100 bytes" in rej.message
    # checked before parsing: oversized garbage is 413, not 400
    assert rejection(small, request(body=b"{" * 101)).status == 413


def test_invalid_headers_are_named(policy: Policy) -> None:
    info = RequestInfo(
        "POST",
        CHAT,
        {"authorization": "Bearer sk-chat-demo"},
        b"{}",
        invalid_headers=("x-name", "x-city"),
    )
    rej = rejection(policy, info)
    assert rej.status == 400
    assert "x-city, x-name" in rej.message


# --------------------------------------------------------------------------- authentication


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer "},
        {"authorization": "Basic sk-chat-demo"},
        {"x-api-key": ""},
    ],
)
def test_missing_key_is_401(policy: Policy, headers: dict[str, str]) -> None:
    rej = rejection(policy, request(key=None, raw_headers=headers))
    assert rej.status == 401
    assert rej.code == "invalid_api_key"
    assert error_of(rej)["type"] == "authentication_error"


def test_unknown_key_is_401_without_echoing_the_key(policy: Policy) -> None:
    rej = rejection(policy, request(key="sk-wrong-but-long-key"))
    assert (rej.status, rej.code) == (401, "invalid_api_key")
    assert "sk-wrong-but-long-key" not in rej.message
    assert "sk-w***-key" in rej.message


def test_keys_are_exact(policy: Policy) -> None:
    assert rejection(policy, request(key="SK-CHAT-DEMO")).status == 401


def test_x_api_key_and_bearer_scheme_case(policy: Policy) -> None:
    info = request(key=None, x_api_key="sk-api-demo")
    assert authenticate(policy, info).name == "code-review"
    info = request(key=None, authorization="bearer   sk-batch-demo ")
    assert authenticate(policy, info).name == "nightly-batch"


def test_auth_is_checked_before_anything_else_in_classify(policy: Policy) -> None:
    info = request(key="nope", x_priority="martian")
    assert rejection(policy, info).status == 401


# --------------------------------------------------------------------------- tiers


@pytest.mark.parametrize(
    ("key", "tier"),
    [("sk-chat-demo", "interactive"), ("sk-api-demo", "api"), ("sk-batch-demo", "batch")],
)
def test_default_tier_by_key(policy: Policy, key: str, tier: str) -> None:
    result = run(policy, request(key=key))
    assert result.tier.name == tier
    assert (result.asked_tier, result.downgraded) == (None, False)


@pytest.mark.parametrize(
    ("word", "tier"),
    [
        ("high", "interactive"),
        ("normal", "api"),
        ("low", "batch"),
        ("batch", "batch"),
        ("API", "api"),
        (" Low ", "batch"),
        ("interactive", "interactive"),
    ],
)
def test_alias_words_via_header(policy: Policy, word: str, tier: str) -> None:
    result = run(policy, request(key="sk-chat-demo", x_priority=word))
    assert result.tier.name == tier
    assert result.asked_tier == tier
    assert result.downgraded is False


def test_asking_via_the_body(policy: Policy) -> None:
    body = {"model": "m", "prompt": "p", "priority": "low"}
    result = run(policy, request(body=body))
    assert (result.tier.name, result.asked_tier) == ("batch", "batch")


def test_a_numeric_body_priority_is_not_an_ask(policy: Policy) -> None:
    result = run(policy, request(key="sk-api-demo", body={"model": "m", "priority": -100}))
    assert (result.tier.name, result.asked_tier, result.downgraded) == ("api", None, False)


def test_the_header_beats_the_body(policy: Policy) -> None:
    body = {"model": "m", "priority": "high"}
    assert run(policy, request(body=body, x_priority="low")).tier.name == "batch"


def test_unknown_tier_is_400(policy: Policy) -> None:
    rej = rejection(policy, request(x_priority="urgent!!"))
    assert (rej.status, rej.param) == (400, "priority")
    assert "high" in rej.message and "batch" in rej.message
    rej = rejection(policy, request(body={"model": "m", "priority": "vip"}))
    assert (rej.status, rej.param) == (400, "priority")


def test_escalation_is_downgraded(policy: Policy) -> None:
    result = run(policy, request(key="sk-batch-demo", x_priority="high"))
    assert result.tier.name == "batch"
    assert result.asked_tier == "interactive"
    assert result.downgraded is True
    result = run(policy, request(key="sk-api-demo", x_priority="interactive"))
    assert (result.tier.name, result.downgraded) == ("api", True)


def test_escalation_is_403_when_the_policy_rejects() -> None:
    strict = parse_policy(
        DEFAULT_POLICY_PATH.read_text().replace(
            "on_escalation: downgrade", "on_escalation: reject"
        ),
        "strict.yaml",
    )
    rej = rejection(strict, request(key="sk-api-demo", x_priority="high"))
    assert (rej.status, rej.code, rej.param) == (403, "tier_not_allowed", "priority")
    assert error_of(rej)["type"] == "permission_error"
    # asking lower stays fine, and a rule is capped quietly rather than refused
    assert run(strict, request(key="sk-api-demo", x_priority="low")).tier.name == "batch"


def test_asking_lower_than_allowed_is_always_fine(policy: Policy) -> None:
    result = run(policy, request(key="sk-chat-demo", x_priority="api"))  # api not in its list
    assert (result.tier.name, result.downgraded) == ("api", False)


# --------------------------------------------------------------------------- rules


def test_batch_path_rule_rewrites_the_path(policy: Policy) -> None:
    result = run(policy, request(path="/v1/batch/chat/completions"))
    assert result.tier.name == "batch"
    assert result.path == "/v1/chat/completions"
    assert result.workload == "batch"
    assert run(policy, request()).path == CHAT


def test_the_client_ask_beats_rules_but_the_path_is_still_rewritten(policy: Policy) -> None:
    result = run(policy, request(path="/v1/batch/completions", x_priority="normal"))
    assert (result.tier.name, result.path) == ("api", "/v1/completions")


def test_header_rule(policy: Policy) -> None:
    result = run(policy, request(x_workload="eval"))
    assert (result.tier.name, result.workload) == ("batch", "eval")


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_body_rule(policy: Policy, field: str) -> None:
    long = {"model": "m", "prompt": "p", field: 10_000}
    result = run(policy, request(body=long))
    assert (result.tier.name, result.workload) == ("batch", "long-generation")
    assert result.max_tokens == 10_000
    short = {"model": "m", "prompt": "p", field: 8192}
    assert run(policy, request(body=short)).tier.name == "interactive"


def test_rules_never_escalate() -> None:
    text = DEFAULT_POLICY_PATH.read_text().replace(
        "rules:\n",
        "rules:\n  - name: vip\n    match: {headers: {x-vip: 'yes'}}\n    tier: interactive\n",
    )
    custom = parse_policy(text, "vip.yaml")
    result = run(custom, request(key="sk-batch-demo", x_vip="yes"))
    assert (result.tier.name, result.downgraded) == ("batch", True)
    assert run(custom, request(key="sk-api-demo")).tier.name == "api"


def test_workload_and_tier_come_from_the_first_rule_that_sets_each() -> None:
    text = DEFAULT_POLICY_PATH.read_text().replace(
        "rules:\n",
        "rules:\n  - name: label\n    match: {body: {model: tagged}}\n    workload: tagged\n",
    )
    custom = parse_policy(text, "label.yaml")
    result = run(custom, request(body={"model": "tagged", "prompt": "p"}, x_workload="eval"))
    assert (result.tier.name, result.workload) == ("batch", "tagged")


# --------------------------------------------------------------------------- user, size, shape


def test_user_from_body_then_header_then_tenant(policy: Policy) -> None:
    body = {"model": "m", "prompt": "p", "user": "u-body"}
    assert run(policy, request(body=body, x_user_id="u-header")).user == "u-body"
    assert run(policy, request(x_user_id="u-header")).user == "u-header"
    assert run(policy, request()).user == "chat-app"
    assert run(policy, request(body={"model": "m", "user": 42})).user == "chat-app"


def test_model_stream_and_max_tokens(policy: Policy) -> None:
    body = {
        "model": "llama",
        "messages": [],
        "stream": True,
        "max_tokens": 5,
        "max_completion_tokens": 7,
    }
    result = run(policy, request(body=body))
    assert (result.model, result.stream, result.max_tokens) == ("llama", True, 7)
    result = run(policy, request(body={"stream": "yes"}))  # stream is vLLM's to judge
    assert (result.model, result.stream, result.max_tokens) == (None, False, None)
    result = run(policy, request(body={"model": None, "max_tokens": None}))
    assert (result.model, result.max_tokens) == (None, None)


@pytest.mark.parametrize("value", ["100", 1.5, -1, True, [1]])
def test_bad_max_tokens_is_400(policy: Policy, value: object) -> None:
    rej = rejection(policy, request(body={"model": "m", "max_tokens": value}))
    assert (rej.status, rej.param) == (400, "max_tokens")


def test_token_estimate_grows_with_the_prompt(policy: Policy) -> None:
    def chat(text: str) -> int:
        body = {"model": "m", "messages": [{"role": "user", "content": text}]}
        return run(policy, request(body=body)).prompt_tokens

    short, long = chat("hello there"), chat("hello there " * 200)
    assert 0 < short < long
    assert long - short >= 200


@pytest.mark.parametrize(
    ("body", "at_least"),
    [
        ({"prompt": "one two three four"}, 4),
        ({"prompt": ["one two", "three four"]}, 4),
        ({"prompt": [1, 2, 3, 4, 5]}, 5),
        ({"prompt": [[1, 2], [3, 4, 5]]}, 5),
        ({"input": "one two three"}, 3),
        ({"input": [{"role": "user", "content": "one two three"}]}, 3),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a b c"}]}]}, 3),
        ({}, 0),
    ],
)
def test_prompt_shapes(body: dict[str, Any], at_least: int) -> None:
    assert prompt_tokens(body) >= at_least
    if at_least == 0:
        assert prompt_tokens(body) == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"prompt": {"text": "hi"}}, "prompt"),
        ({"prompt": [{"text": "hi"}]}, "prompt[0]"),
    ],
)
def test_bad_prompt_shapes_are_400(policy: Policy, body: dict[str, Any], param: str) -> None:
    rej = rejection(policy, request(body=body))
    assert (rej.status, rej.param) == (400, param)


@pytest.mark.parametrize(
    ("body", "text"),
    [
        (
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                ]
            },
            "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n",
        ),
        ({"prompt": "one two"}, "one two"),
        ({"prompt": ["only one"]}, "only one"),
        ({"prompt": ["two", "prompts"]}, ""),
        ({"prompt": [1, 2, 3]}, ""),
        ({"input": "respond"}, "respond"),
        ({}, ""),
    ],
)
def test_prompt_text_is_the_rendered_prompt_the_picker_hashes(
    policy: Policy, body: dict[str, Any], text: str
) -> None:
    request_class = run(policy, request(body={"model": "m", **body}))
    assert request_class.prompt_text == text
    assert request_class.prompt_tokens == prompt_tokens(body)


def test_the_parsed_body_goes_to_the_picker(policy: Policy) -> None:
    body = {"model": "m", "prompt": "hello"}
    assert run(policy, request(body=body)).body == body


# --------------------------------------------------------------------------- strict fields


def invalid(policy: Policy, body: dict[str, Any], ask: str | None = None) -> tuple[str, str | None]:
    """The (param, code) of the 400 a body's fields get (``ask``: an x-priority header)."""
    rej = rejection(policy, request(body=body, raw_headers={"x-priority": ask} if ask else None))
    error = error_of(rej)
    assert (rej.status, error["type"]) == (400, "invalid_request_error")
    assert error["param"] == rej.param
    return error["param"], error["code"]


@pytest.mark.parametrize("model", [3, 1.5, True, ["m"], {"a": 1}])
def test_model_must_be_a_string(policy: Policy, model: object) -> None:
    assert invalid(policy, {"model": model, "prompt": "x"}) == ("model", "invalid_type")


@pytest.mark.parametrize("priority", [{"a": 1}, [1], True, False])
def test_priority_must_be_a_number_or_a_tier_word(policy: Policy, priority: object) -> None:
    assert invalid(policy, {"model": "m", "priority": priority}) == ("priority", "invalid_type")


@pytest.mark.parametrize("priority", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_priority_is_refused_even_from_code(policy: Policy, priority: float) -> None:
    """parse_body refuses these literals first; classify does not rely on it."""
    body = {"model": "m", "priority": priority}
    with pytest.raises(Rejection) as caught:
        classify(policy, request(), body)
    assert (caught.value.status, caught.value.param) == (400, "priority")


@pytest.mark.parametrize("priority", [None, 5, -3, 2.5, 1e300, 10**400, "low", " High "])
def test_priority_may_be_absent_null_a_number_or_a_word(policy: Policy, priority: object) -> None:
    run(policy, request(body={"model": "m", "priority": priority}))


def test_a_body_priority_word_is_checked_even_when_the_header_asks(policy: Policy) -> None:
    body = {"model": "m", "priority": "platinum"}
    assert invalid(policy, body, ask="low") == ("priority", "invalid_priority")


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"max_tokens": 2**31}, "max_tokens", "invalid_value"),
        ({"max_tokens": 10**400}, "max_tokens", "invalid_value"),
        ({"max_completion_tokens": -1}, "max_completion_tokens", "invalid_value"),
        ({"max_completion_tokens": "5"}, "max_completion_tokens", "invalid_type"),
        ({"max_completion_tokens": 5, "max_tokens": True}, "max_tokens", "invalid_type"),
        ({"max_tokens": 16.0}, "max_tokens", "invalid_type"),
    ],
)
def test_max_tokens_must_be_a_usable_integer(
    policy: Policy, body: dict[str, Any], param: str, code: str
) -> None:
    assert invalid(policy, {"model": "m", **body}) == (param, code)


def test_the_largest_max_tokens_is_taken(policy: Policy) -> None:
    body = {"model": "m", "max_tokens": 2**31 - 1, "max_completion_tokens": None}
    assert run(policy, request(body=body)).max_tokens == 2**31 - 1


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ({"role": "user"}, "messages"),
        ([{"role": "user", "content": "a"}, 3], "messages[1]"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": True}], "messages[0].content"),
        ([{"role": "user", "content": {"text": "a"}}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}],
            "messages[0].content[1]",
        ),
    ],
)
def test_messages_must_be_objects_with_string_parts_or_null_content(
    policy: Policy, messages: object, param: str
) -> None:
    assert invalid(policy, {"model": "m", "messages": messages}) == (param, "invalid_type")


def test_message_content_may_be_a_string_parts_null_or_absent(policy: Policy) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "tool_call_id": "1"},
    ]
    assert run(policy, request(body={"model": "m", "messages": messages})).prompt_tokens > 0


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        (3, "prompt"),
        (True, "prompt"),
        ([1, True], "prompt[1]"),
        ([1.5], "prompt[0]"),
        ([[1, 2], [3, "x"]], "prompt[1]"),
        ([None], "prompt[0]"),
    ],
)
def test_prompt_must_be_text_or_token_ids(policy: Policy, prompt: object, param: str) -> None:
    assert invalid(policy, {"model": "m", "prompt": prompt}) == (param, "invalid_type")


def test_a_null_prompt_or_input_is_unread(policy: Policy) -> None:
    assert run(policy, request(body={"model": "m", "prompt": None})).prompt_tokens == 0
    assert run(policy, request(body={"model": "m", "input": None})).prompt_tokens == 0


def test_fields_the_gateway_does_not_read_are_not_judged(policy: Policy) -> None:
    body = {
        "model": "m",
        "prompt": "x",
        "temperature": "hot",
        "stream": "yes",
        "user": 42,
        "n": {"a": 1},
        "messages": None,
    }
    assert run(policy, request(body=body)).model == "m"
