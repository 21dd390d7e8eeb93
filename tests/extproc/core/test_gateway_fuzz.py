"""Fuzzed malformed bodies through the whole per-request decision, no sockets.

Valid chat and completion bodies are mutated (a seeded generator, so every run sees the same
bodies): each field the gateway reads given a wrong type or value, lone surrogates, non-finite
and huge numbers, truncation, nesting past the parser's limit, bytes that are not UTF-8.
Every one must come back as a 4xx in OpenAI's error shape, without raising, without taking a
queue slot or a seat; and the gateway serves a valid request afterwards.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from extproc.core.decisions import Forward, Respond
from extproc.core.events import RequestInfo
from extproc.core.gateway import Gateway
from tests.extproc.factories import CHAT, make_gateway

SEED = 20_251_115
KEYS = ("sk-chat-demo", "sk-api-demo", "sk-batch-demo")

#: Wrong JSON values for each field the gateway reads, by field.
WRONG: dict[str, list[Any]] = {
    "model": [3, -1.5, True, False, [], ["m"], {}, {"a": 1}],
    "priority": [True, False, [], [0], {}, {"a": 1}, "platinum", "urgent!"],
    "max_tokens": ["16", 16.0, 1.5, -1, -(2**40), 2**31, 10**40, True, [16], {"n": 16}],
    "max_completion_tokens": ["16", 2.0, -7, 2**63, False, [1], {}],
    "messages": ["hi", 3, True, {"role": "user"}, ["hi"], [3], [None], [[{"a": 1}]]],
    "content": [3, 2.5, True, {"text": "hi"}, ["hi"], [3], [None], [[]]],
    "prompt": [3, 1.5, True, {"text": "hi"}, [{"text": "hi"}], [True], [1.5], [[1, "x"]], [None]],
}
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
NON_FINITE = ("NaN", "Infinity", "-Infinity", "1e999", "-2.5E400", "1e309")
SURROGATES = ("\\ud800", "\\udbff", "\\udc00", "\\uDFFF", "\\uD83D", "\\ude00\\ud83d")


def valid_bodies(rng: random.Random) -> Iterator[dict[str, Any]]:
    """Chat and completion bodies of the shapes clients send."""
    while True:
        turns = rng.randint(1, 6)
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
        for i in range(turns):
            text = " ".join(rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(8))
            content: Any = text if i % 2 else [{"type": "text", "text": text}]
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
        chat: dict[str, Any] = {
            "model": "m",
            "messages": messages,
            "max_tokens": rng.randint(1, 512),
            "temperature": round(rng.random(), 2),
            "stream": rng.random() < 0.5,
            "metadata": {"team": "x", "tags": ["a", "b"]},
        }
        yield chat
        words = [rng.choice(("once", "upon", "a", "time")) for _ in range(rng.randint(1, 9))]
        ids = [rng.randrange(32_000) for _ in range(rng.randint(1, 9))]
        yield {"model": "m", "prompt": rng.choice((" ".join(words), words, ids, [ids, ids]))}


def located(body: dict[str, Any], rng: random.Random) -> tuple[str, Any]:
    """A field the gateway reads in ``body`` (a message's content for chat), and a wrong
    value for it."""
    if "messages" in body and rng.random() < 0.4:
        i = rng.randrange(len(body["messages"]))
        return f"messages[{i}].content", rng.choice(WRONG["content"])
    fields = ["model", "priority", "max_tokens", "max_completion_tokens"]
    fields.append("messages" if "messages" in body else "prompt")
    name = rng.choice(fields)
    return name, rng.choice(WRONG[name])


def wrong_type(body: dict[str, Any], rng: random.Random) -> tuple[bytes, str | None]:
    field, value = located(body, rng)
    if field.startswith("messages["):
        body["messages"][int(field[9 : field.index("]")])]["content"] = value
    else:
        body[field] = value
    if isinstance(value, list) and value and field not in ("model", "priority", *TOKEN_FIELDS):
        field += "[0]"  # an array of the wrong items: the error names the first
    return json.dumps(body).encode(), field


def surrogate(body: dict[str, Any], rng: random.Random) -> tuple[bytes, str | None]:
    """A lone surrogate escape in a string the gateway reads, or in one it does not."""
    mark = "\x00LONE\x00"
    where = rng.choice(("model", "content", "metadata"))
    if where == "model":
        body["model"] = f"m{mark}"
        param = "model"
    elif where == "content" and "messages" in body:
        i = len(body["messages"]) - 1
        body["messages"][i]["content"] = f"say {mark} now"
        param = f"messages[{i}].content"
    else:
        body["metadata"] = {"note": [f"{mark}"]}
        param = "metadata.note[0]"
    raw = json.dumps(body).replace(json.dumps(mark)[1:-1], rng.choice(SURROGATES))
    return raw.encode(), param


def non_finite(body: dict[str, Any], rng: random.Random) -> tuple[bytes, str | None]:
    mark = 987_654_321
    field = rng.choice(("temperature", "priority", "max_tokens", "logprobs_weight"))
    body[field] = mark
    return json.dumps(body).replace(str(mark), rng.choice(NON_FINITE)).encode(), field


def truncated(body: dict[str, Any], rng: random.Random) -> tuple[bytes, str | None]:
    raw = json.dumps(body).encode()
    return raw[: rng.randrange(0, len(raw) - 1)], None


def deep(body: dict[str, Any], rng: random.Random) -> tuple[bytes, str | None]:
    """Nesting far past what the parser takes (in a field the gateway does not read)."""
    depth = rng.choice((5_000, 50_000, 200_000))
    opener, closer = rng.choice((("[", "]"), ('{"a":', "}")))
    body["metadata"] = 0
    raw = json.dumps(body).replace('"metadata": 0', '"metadata": ' + opener * depth + "1")
    return (raw[:-1] + closer * depth + "}").encode(), None


def huge_number(body: dict[str, Any], rng: random.Random) -> tuple[bytes, str | None]:
    """An integer too long to parse (Python refuses over 4,300 digits) or too big to count."""
    field = rng.choice(("max_tokens", "max_completion_tokens", "seed", "priority"))
    digits = 5_000 if field in ("seed", "priority") else rng.choice((40, 400, 5_000))
    body[field] = 987_654_321
    raw = json.dumps(body).replace("987654321", "9" * digits)
    return raw.encode(), field if digits < 4_300 else None


def not_utf8(body: dict[str, Any], rng: random.Random) -> tuple[bytes, str | None]:
    raw = json.dumps(body).encode()
    at = raw.index(b'"m"') + 2
    bad = rng.choice((b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xe9t\xe9"))
    return raw[:at] + bad + raw[at:], None


def not_an_object(body: dict[str, Any], rng: random.Random) -> tuple[bytes, str | None]:
    return json.dumps(rng.choice(([body], "text", 3, None, True, []))).encode(), None


MUTATIONS: list[Callable[[dict[str, Any], random.Random], tuple[bytes, str | None]]] = [
    wrong_type,
    wrong_type,
    wrong_type,  # the most varied: three shares
    surrogate,
    non_finite,
    truncated,
    deep,
    huge_number,
    not_utf8,
    not_an_object,
]


def malformed(count: int) -> list[tuple[str, bytes, str | None]]:
    """``count`` (mutation, body, the param its error must name or None) triples."""
    rng = random.Random(SEED)
    bodies = valid_bodies(rng)
    cases = []
    for _ in range(count):
        mutate = rng.choice(MUTATIONS)
        raw, param = mutate(next(bodies), rng)
        cases.append((mutate.__name__, raw, param))
    return cases


CASES = malformed(1_200)


def send(gateway: Gateway, raw: bytes, i: int) -> Respond | Forward:
    key = KEYS[i % len(KEYS)]
    headers = {":method": "POST", ":path": CHAT, "authorization": f"Bearer {key}"}
    decision = gateway.handle(RequestInfo("POST", CHAT, headers, raw, f"fuzz-{i}"))
    assert decision.grants == ()
    assert isinstance(decision.answer, Respond | Forward)
    return decision.answer


def test_the_generator_covers_every_mutation_and_is_deterministic() -> None:
    assert len(CASES) >= 1_000
    assert {name for name, _, _ in CASES} == {m.__name__ for m in MUTATIONS}
    assert malformed(50) == CASES[:50]
    assert len({raw for _, raw, _ in CASES}) > 900  # mostly distinct bodies


@pytest.fixture(scope="module")
def gateway() -> Gateway:
    return make_gateway(limit=1)


def test_every_malformed_body_is_a_4xx_in_openai_shape_and_takes_nothing(
    gateway: Gateway,
) -> None:
    admission = gateway.admission
    for i, (name, raw, param) in enumerate(CASES):
        answer = send(gateway, raw, i)
        where = f"case {i} ({name}): {raw[:160]!r}"
        assert isinstance(answer, Respond), where
        assert 400 <= answer.status < 500, where
        error = json.loads(answer.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, where
        assert error["type"] == "invalid_request_error", where
        assert isinstance(error["message"], str) and error["message"], where
        if param is not None:
            assert error["param"] == param, where
        assert admission.in_flight == 0 and len(admission.scheduler) == 0, where
    assert gateway.stats.rejected  # counted as client errors ...
    assert "500" not in {status for status, _ in gateway.stats.rejected}  # ... never ours


def test_the_gateway_serves_a_valid_request_after_the_fuzz(gateway: Gateway) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "still there?"}]}
    answer = send(gateway, json.dumps(body).encode(), 0)  # sk-chat-demo: interactive
    assert isinstance(answer, Forward)
    assert json.loads(answer.body)["priority"] == 0
