"""The ext_proc servicer driven as grpc drives it: real protobuf messages, no sockets.

grpc.aio iterates ``Process`` (an async generator) and sends each answer; when a send fails
(the client or Envoy went away) it closes the generator where it stands. These tests do the
same by hand.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.core.decisions import Forward
from extproc.transport.held import HeldRequests
from extproc.transport.servicer import ExternalProcessor
from tests.extproc.factories import make_gateway, request

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def messages(request_id: str, key: str = "sk-chat-demo") -> list[pb.ProcessingRequest]:
    """Envoy's two messages for a chat completion in BUFFERED mode: headers, then body."""
    pairs = [
        (":method", b"POST"),
        (":path", b"/v1/chat/completions"),
        ("authorization", f"Bearer {key}".encode()),
        ("x-request-id", request_id.encode()),
    ]
    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in pairs]
            )
        )
    )
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True))
    return [headers, body]


class Stream:
    """grpc's request iterator: an async generator, as grpc.aio's is."""

    def __init__(self, items: list[pb.ProcessingRequest]) -> None:
        self.closed = False
        self.read = 0
        self._items = items

    async def generate(self) -> AsyncIterator[pb.ProcessingRequest]:
        try:
            for item in self._items:
                self.read += 1
                yield item
        finally:
            self.closed = True


def saturated() -> HeldRequests:
    """Both backends of the default policy full (one seat each): the next request waits."""
    held = HeldRequests(make_gateway(limit=1))
    for i in range(2):
        assert isinstance(held.handle(request(request_id=f"run{i}")), Forward)
    return held


async def test_a_stream_closed_while_its_hold_is_sent_leaves_the_queue() -> None:
    held = saturated()
    admission = held.gateway.admission
    stream = Stream(messages("waiting"))
    process = ExternalProcessor(held).Process(stream.generate(), None)  # type: ignore[arg-type]
    assert (await anext(process)).HasField("request_headers")  # the headers: continue
    hold = await anext(process)
    assert hold.HasField("override_message_timeout")
    assert len(held) == 1 and len(admission.scheduler) == 1
    await process.aclose()  # grpc could not send the hold: the stream is gone
    assert len(held) == 0 and len(admission.scheduler) == 0
    admission.release("run0")  # the freed seat goes to nobody: nothing was left queued
    assert admission.in_flight == 1
    assert stream.closed


async def test_an_answered_stream_closes_grpcs_request_iterator() -> None:
    held = HeldRequests(make_gateway())
    stream = Stream([*messages("one"), *messages("never read")])
    process = ExternalProcessor(held).Process(stream.generate(), None)  # type: ignore[arg-type]
    answers = [answer async for answer in process]
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    # closed by the servicer itself, not left for asyncio's finaliser (a task per request)
    assert stream.closed


async def test_overloaded_a_least_urgent_key_is_refused_before_its_body_is_read() -> None:
    held = HeldRequests(make_gateway())
    held.gateway.overload.period(1.0)  # far behind
    assert held.overloaded
    batch = Stream(messages("batch", key="sk-batch-demo"))
    process = ExternalProcessor(held).Process(batch.generate(), None)  # type: ignore[arg-type]
    answers = [answer async for answer in process]
    assert [a.WhichOneof("response") for a in answers] == ["immediate_response"]
    assert answers[0].immediate_response.status.code == 429
    assert batch.read == 1 and batch.closed  # the body message was never read
    # chat's key is not limited to the least urgent tier: decided on its body, and admitted
    chat = Stream(messages("chat"))
    process = ExternalProcessor(held).Process(chat.generate(), None)  # type: ignore[arg-type]
    answers = [answer async for answer in process]
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
