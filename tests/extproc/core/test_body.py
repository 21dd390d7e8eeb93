"""Strict JSON: what the gateway could not forward faithfully is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.core.body import find, parse_body, with_member
from extproc.core.errors import Rejection
from extproc.core.events import RequestInfo
from extproc.policy import DEFAULT_POLICY_PATH, Policy, load_policy

CHAT = '{"model": "m", "messages": [{"role": "user", "content": %s}]}'


@pytest.fixture(scope="module")
def policy() -> Policy:
    return load_policy(DEFAULT_POLICY_PATH)


def info(raw: bytes) -> RequestInfo:
    return RequestInfo("POST", "/v1/chat/completions", {}, raw)


def refused(policy: Policy, raw: bytes) -> Rejection:
    with pytest.raises(Rejection) as caught:
        parse_body(policy, info(raw))
    rejection = caught.value
    error = json.loads(rejection.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (rejection.status, error["type"]) == (400, "invalid_request_error")
    assert error["param"] == rejection.param
    return rejection


@pytest.mark.parametrize(
    ("raw", "param", "literal"),
    [
        (b'{"model": "m", "temperature": NaN}', "temperature", "NaN"),
        (b'{"model": "m", "priority": Infinity}', "priority", "Infinity"),
        (b'{"model": "m", "top_p": -Infinity}', "top_p", "-Infinity"),
        (b'{"model": "m", "logit_bias": {"50256": 1e999}}', "logit_bias.50256", "1e999"),
        (b'{"model": "m", "seeds": [1, 2.5, -1E400]}', "seeds[2]", "-1E400"),
        (b'{"model": "m", "x": [NaN', None, "NaN"),  # broken after it too: no field to name
    ],
)
def test_non_finite_numbers_are_refused_naming_the_field(
    policy: Policy, raw: bytes, param: str | None, literal: str
) -> None:
    rejection = refused(policy, raw)
    assert (rejection.code, rejection.param) == ("invalid_json", param)
    assert f"{literal} " in rejection.message and "not a finite JSON number" in rejection.message


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (CHAT.encode() % b'"hi \\ud800 there"', "messages[0].content"),
        (CHAT.encode() % b'"\\uDFFF"', "messages[0].content"),
        (CHAT.encode() % b'"\\ude00\\ud83d"', "messages[0].content"),  # pair in the wrong order
        (b'{"model": "\\udbff"}', "model"),
        (b'{"model": "m", "metadata": {"a": [1, {"b": "\\ud800"}]}}', "metadata.a[1].b"),
        (b'{"model": "m", "\\ud800": 1}', "\\ud800"),  # a key, shown escaped
    ],
)
def test_lone_surrogates_are_refused_naming_the_field(
    policy: Policy, raw: bytes, param: str
) -> None:
    rejection = refused(policy, raw)
    assert (rejection.code, rejection.param) == ("invalid_value", param)
    assert "lone UTF-16 surrogate" in rejection.message


@pytest.mark.parametrize(
    "raw",
    [
        CHAT.encode() % b'"\\ud83d\\ude00 a pair is one character"',
        CHAT.encode() % b'"\\\\ud800 is an escaped backslash, then text"',
        CHAT.encode() % b'"NaN, Infinity and 1e999 in a string are text"',
        b'{"model": "m", "temperature": 1e308, "n": 100000000000000000000000000000}',
    ],
)
def test_what_json_can_carry_passes(policy: Policy, raw: bytes) -> None:
    body = parse_body(policy, info(raw))
    assert json.loads(json.dumps(body)) == body  # forwarded as the client meant it


@pytest.mark.parametrize(
    "raw",
    [
        CHAT.encode() % '"caf\udce9"'.encode("utf-8", "surrogateescape"),  # Latin-1 é
        CHAT.encode() % '"\ud800"'.encode("utf-8", "surrogatepass"),  # a surrogate as UTF-8
        '{"model": "m"}'.encode("utf-16"),
    ],
)
def test_bodies_that_are_not_utf8_are_refused(policy: Policy, raw: bytes) -> None:
    rejection = refused(policy, raw)
    assert rejection.code == "invalid_json" and "not valid UTF-8" in rejection.message


def test_find_walks_in_document_order_without_recursion() -> None:
    body: Any = {"a": [0, {"b": 1}], "c": {"d": 1}}
    assert find(body, lambda value: value == 1) == "a[1].b"
    assert find(body, lambda value: value == 2) is None
    assert find(body, lambda value: value == "c") == "c"  # keys are looked at too
    deep: Any = 1
    for _ in range(10_000):  # ten times the recursion limit
        deep = [deep]
    assert find({"x": deep}, lambda value: value == 1) == "x" + "[0]" * 10_000


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "messages": [{"role": "user", "content": "h\xc3\xa9llo"}]}\n',
        b"{ }",
        b'{"model":"m","stream":true}  \r\n',
    ],
    ids=["spaced-and-utf8", "empty", "trailing-whitespace"],
)
def test_a_member_is_spliced_into_the_clients_own_bytes(raw: bytes) -> None:
    body = json.loads(raw)
    forwarded = with_member(raw, dict(body), "priority", 12)
    assert json.loads(forwarded) == {**body, "priority": 12}
    assert forwarded.startswith(raw.rstrip()[:-1])  # the client's bytes, untouched


def test_a_member_the_client_sent_is_replaced_not_repeated() -> None:
    raw = b'{"model": "m", "priority": -100}'
    forwarded = with_member(raw, json.loads(raw), "priority", 3)
    assert forwarded.count(b"priority") == 1
    assert json.loads(forwarded) == {"model": "m", "priority": 3}
