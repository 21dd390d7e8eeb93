"""The locust module's classes, prompts and stream parsing.

Not collected by the main pytest run (the file name does not start with ``test_``):
importing locust monkey-patches the whole process with gevent, which would break every
asyncio and grpc test that runs after it. ``test_locustfile.py`` runs this file in a
pytest process of its own.
"""

from __future__ import annotations

from itertools import islice

import pytest
from locust import User

from loadtests import locustfile


def test_user_classes_exist_with_weights() -> None:
    classes = {
        name: obj
        for name, obj in vars(locustfile).items()
        if isinstance(obj, type) and issubclass(obj, User) and not obj.abstract
    }
    assert set(classes) == {
        "InteractiveUser",
        "ApiUser",
        "BatchUser",
        "SharedPrefixUser",
        "ConversationUser",
    }
    assert all(cls.weight > 0 for cls in classes.values())
    assert locustfile.InteractiveUser.weight > locustfile.ApiUser.weight


def test_each_tier_sends_its_demo_key() -> None:
    assert locustfile.InteractiveUser.group.api_key == "sk-chat-demo"
    assert locustfile.ApiUser.group.api_key == "sk-api-demo"
    assert locustfile.BatchUser.group.api_key == "sk-batch-demo"
    assert locustfile.ConversationUser.group.api_key == "sk-chat-demo"
    assert locustfile.InteractiveUser.group.stream
    assert not locustfile.ApiUser.group.stream


def test_prompts_are_seeded_and_reproducible() -> None:
    group = locustfile.INTERACTIVE
    first = list(islice(locustfile.request_bodies(group, client=3, seed=7), 3))
    again = list(islice(locustfile.request_bodies(group, client=3, seed=7), 3))
    other = list(islice(locustfile.request_bodies(group, client=4, seed=7), 3))
    assert first == again
    assert first != other
    assert first[0]["model"] == locustfile.MODEL
    batch = next(locustfile.request_bodies(locustfile.BATCH, client=0))
    assert len(str(batch["messages"])) > len(str(first[0]["messages"]))


def test_conversation_turns_resend_the_history() -> None:
    bodies = list(islice(locustfile.request_bodies(locustfile.CONVERSATION, client=0), 2))
    first, second = (body["messages"] for body in bodies)
    assert first[0]["role"] == "system"
    assert second[: len(first)] == first  # turn 2 = turn 1 + answer + a new message
    assert len(second) == len(first) + 2


class _Lines:
    """Stands in for geventhttpclient's response: ``readline`` hands out canned lines."""

    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines

    def readline(self, sep: bytes = b"\r\n") -> bytes:
        return self.lines.pop(0) if self.lines else b""


class _Response:
    def __init__(self, lines: list[bytes]) -> None:
        self._response = _Lines(lines)


def _chunk(text: str) -> bytes:
    return f'data: {{"choices": [{{"delta": {{"content": "{text}"}}}}]}}\n'.encode()


def test_stream_times_each_content_chunk() -> None:
    lines = [
        b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n',
        b"\n",
        _chunk("a"),
        b"\n",
        _chunk("b"),
        b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n',
        b"data: [DONE]\n",
    ]
    size = sum(map(len, lines))
    times, read = locustfile._read_stream(_Response(lines))  # type: ignore[arg-type]
    assert len(times) == 2 and times[0] <= times[1]
    assert read == size


@pytest.mark.parametrize(
    ("lines", "reason"),
    [
        ([_chunk("a")], "without data: \\[DONE\\]"),
        ([_chunk("a"), b'data: {"error": {"message": "boom"}}\n'], "error event"),
    ],
)
def test_incomplete_stream_is_a_failure(lines: list[bytes], reason: str) -> None:
    with pytest.raises(locustfile.StreamError, match=reason):
        locustfile._read_stream(_Response(lines))  # type: ignore[arg-type]
