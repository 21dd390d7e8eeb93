"""The ext_proc servicer driven as grpc drives it: real protobuf messages, no sockets.

grpc.aio iterates ``Process`` (an async generator) and sends each answer; when a send fails
(the client or Envoy went away) it closes the generator where it stands. These tests do the
same by hand.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator

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


class Answers:
    """The servicer's answers as Envoy reads them: ``codec.forward`` yields its answer
    encoded already, the others are messages."""

    def __init__(self, process: AsyncGenerator[pb.ProcessingResponse | bytes, None]) -> None:
        self._process = process

    def __aiter__(self) -> Answers:
        return self

    async def __anext__(self) -> pb.ProcessingResponse:
        answer = await anext(self._process)
        if isinstance(answer, bytes):
            return pb.ProcessingResponse.FromString(answer)
        return answer

    async def aclose(self) -> None:
        await self._process.aclose()


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
    process = Answers(ExternalProcessor(held).Process(stream.generate(), None))  # type: ignore[arg-type]
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
    process = Answers(ExternalProcessor(held).Process(stream.generate(), None))  # type: ignore[arg-type]
    answers = [answer async for answer in process]
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    # closed by the servicer itself, not left for asyncio's finaliser (a task per request)
    assert stream.closed


async def test_overloaded_a_least_urgent_key_is_refused_before_its_body_is_read() -> None:
    held = HeldRequests(make_gateway())
    held.gateway.overload.period(1.0)  # far behind
    assert held.overloaded
    batch = Stream(messages("batch", key="sk-batch-demo"))
    process = Answers(ExternalProcessor(held).Process(batch.generate(), None))  # type: ignore[arg-type]
    answers = [answer async for answer in process]
    assert [a.WhichOneof("response") for a in answers] == ["immediate_response"]
    assert answers[0].immediate_response.status.code == 429
    assert batch.read == 1 and batch.closed  # the body message was never read
    # chat's key is not limited to the least urgent tier: decided on its body, and admitted
    chat = Stream(messages("chat"))
    process = Answers(ExternalProcessor(held).Process(chat.generate(), None))  # type: ignore[arg-type]
    answers = [answer async for answer in process]
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]


class OpenStream(Stream):
    """A stream Envoy keeps open after its request messages (a request running upstream);
    ``answer_started`` sends the response headers, as Envoy does when the answer starts."""

    def __init__(self, items: list[pb.ProcessingRequest]) -> None:
        super().__init__(items)
        self.response: asyncio.Future[pb.ProcessingRequest] = asyncio.Future()

    async def generate(self) -> AsyncIterator[pb.ProcessingRequest]:
        try:
            for item in self._items:
                self.read += 1
                yield item
            yield await self.response
        finally:
            self.closed = True

    def answer_started(self) -> None:
        headers = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
        self.response.set_result(headers)


async def _running_batch(
    held: HeldRequests, request_id: str
) -> tuple[OpenStream, asyncio.Future[pb.ProcessingResponse]]:
    """A non-streamed batch request sent upstream through the servicer; the future is its
    stream's next answer, which comes only when it ends or is preempted (and then checks
    that the servicer ends cleanly, as grpc would drive it)."""
    stream = OpenStream(messages(request_id, key="sk-batch-demo"))
    process = Answers(ExternalProcessor(held).Process(stream.generate(), None))  # type: ignore[arg-type]

    async def last_answer() -> pb.ProcessingResponse:
        answer = await anext(process)
        assert await anext(process, None) is None  # nothing after it, and no error
        assert stream.closed
        return answer

    headers = await anext(process)
    # the policy has a preemptible tier: response headers are asked for, the body still read
    mode = headers.mode_override
    assert (mode.response_header_mode, mode.request_body_mode) == (mode.SEND, mode.BUFFERED)
    assert (await anext(process)).HasField("request_body")  # forwarded
    following = asyncio.ensure_future(last_answer())
    await asyncio.sleep(0)
    assert not following.done()  # its stream stays open while it runs
    return stream, following


async def test_a_running_batch_request_is_answered_503_when_chat_takes_its_seat() -> None:
    held = HeldRequests(make_gateway(limit=64, seats=1))  # two backends, one seat each
    running = [await _running_batch(held, f"batch{i}") for i in range(2)]
    assert isinstance(held.handle(request(request_id="chat")), Forward)  # no wait
    await asyncio.wait([f for _, f in running], timeout=5, return_when=asyncio.FIRST_COMPLETED)
    answered = [following for _, following in running if following.done()]
    assert len(answered) == 1  # one seat taken, the other batch request runs on
    reply = answered[0].result().immediate_response
    assert reply.status.code == 503
    assert json.loads(reply.body)["error"]["code"] == "preempted"
    assert {h.header.key for h in reply.headers.set_headers} >= {"retry-after"}
    ((stream, following),) = [(s, f) for s, f in running if not f.done()]
    stream.answer_started()  # its answer starts: it can no longer be preempted
    assert (await following).HasField("response_headers")  # not a 503: it was never preempted
    assert isinstance(held.handle(request(request_id="chat2")), Forward)
    await asyncio.sleep(0)
    assert held.gateway.admission.take_preempted() == []
