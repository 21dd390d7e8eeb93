"""The only module that touches Envoy's protobuf messages.

ext_proc ``ProcessingRequest`` / ``ProcessingResponse`` and access-log entries are converted
here to and from the plain objects of ``extproc.core.decisions``, and the runtime layer
(RTDS) and the backends' host set (EDS) the service serves Envoy are packed here.
upb-backed ``xds-protos`` classes are used because decoding them costs a few microseconds,
where betterproto-style dataclasses cost hundreds.
The one answer every admitted request gets, ``forward``'s, is written in the wire format
by hand instead: filling upb's message field by field cost more than the rest of the codec.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime

from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.runtime.v3 import rtds_pb2
from envoy.type.v3 import http_status_pb2
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message

from extproc.core.decisions import Forward, Respond
from extproc.core.events import Completion, RequestInfo
from extproc.transport.endpoints import Level
from extproc.wire import CLIENT_AUTHORIZATION_HEADER as CLIENT_AUTHORIZATION
from extproc.wire import DESTINATION_HEADER as ENDPOINT_HEADER
from extproc.wire import FAIRLANE_NAMESPACE, LB_NAMESPACE

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse


ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
"""Where Envoy puts the filter's ``request_attributes`` in the first message."""
RECEIVED_ATTRIBUTE = "request.time"


class HeadersPart:
    """The request-headers message, decoded: what is known before the body arrives."""

    __slots__ = ("end_of_stream", "headers", "invalid", "received_at")

    def __init__(
        self,
        headers: dict[str, str],
        invalid: tuple[str, ...],
        end_of_stream: bool,
        received_at: float | None = None,
    ):
        self.headers = headers
        self.invalid = invalid
        self.end_of_stream = end_of_stream
        self.received_at = received_at
        """When Envoy received the request (Unix time), if it said so."""

    def request_info(self, body: bytes = b"") -> RequestInfo:
        headers = self.headers
        return RequestInfo(
            method=headers.get(":method", ""),
            path=headers.get(":path", ""),
            headers=headers,
            body=body,
            request_id=headers.get("x-request-id", ""),
            invalid_headers=self.invalid,
        )


def decode_headers(message: pb.ProcessingRequest) -> HeadersPart:
    """Header names arrive lower-cased; values are bytes (``raw_value``) to be checked."""
    headers: dict[str, str] = {}
    invalid: list[str] = []
    http_headers = message.request_headers
    for header in http_headers.headers.headers:
        try:
            headers[header.key] = header.raw_value.decode("utf-8")
        except UnicodeDecodeError:
            invalid.append(header.key)
    if CLIENT_AUTHORIZATION in headers:
        # The shipped Envoy moved the client's key out of `authorization` (so a bypassed
        # request cannot carry it upstream): the service reads it under its usual name. Both
        # names stay, so the gateway strips both.
        headers["authorization"] = headers[CLIENT_AUTHORIZATION]
    return HeadersPart(headers, tuple(invalid), http_headers.end_of_stream, _received_at(message))


def _received_at(message: pb.ProcessingRequest) -> float | None:
    """Envoy's ``request.time`` attribute (RFC 3339) as Unix time; None if absent or bad."""
    if ATTRIBUTES_KEY not in message.attributes:
        return None
    fields = message.attributes[ATTRIBUTES_KEY].fields
    if RECEIVED_ATTRIBUTE not in fields:
        return None
    try:
        return datetime.fromisoformat(fields[RECEIVED_ATTRIBUTE].string_value).timestamp()
    except ValueError:
        return None


def kind(message: pb.ProcessingRequest) -> str:
    """Which phase a message belongs to: ``request_headers``, ``request_body``, ..."""
    return message.WhichOneof("request") or ""


def body_of(message: pb.ProcessingRequest) -> tuple[bytes, bool]:
    return message.request_body.body, message.request_body.end_of_stream


def _mutation(set_headers: Mapping[str, str], remove: Iterable[str]) -> pb.HeaderMutation:
    mutation = pb.HeaderMutation()
    _fill_mutation(mutation, set_headers, remove)
    return mutation


def _fill_mutation(
    mutation: pb.HeaderMutation, set_headers: Mapping[str, str], remove: Iterable[str]
) -> None:
    # In place (add() on the repeated field): building each HeaderValueOption and copying
    # the list in costs ~2x as much per header.
    for key, value in set_headers.items():
        header = mutation.set_headers.add().header
        header.key = key
        header.raw_value = value.encode()  # raw_value: Envoy reads only raw_value
    mutation.remove_headers.extend(remove)


def continue_headers(answer_phase: bool = False) -> pb.ProcessingResponse:
    """Let the headers through unchanged; the decision is made on the body.

    ``answer_phase``: also send this request's response headers (``mode_override``), so
    its stream can stay open until its answer starts (a cancellable request,
    ``extproc.core.preemption``); the rest of the filter's mode is restated as configured.
    """
    if not answer_phase:
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse())
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=_WITH_ANSWER)


_Mode = processing_mode_pb2.ProcessingMode
_WITH_ANSWER = _Mode(
    request_header_mode=_Mode.SEND,
    request_body_mode=_Mode.BUFFERED,
    response_header_mode=_Mode.SEND,
    response_body_mode=_Mode.NONE,
    request_trailer_mode=_Mode.SKIP,
    response_trailer_mode=_Mode.SKIP,
)
"""The filter's processing mode (``extproc.envoy.filter``) with response headers sent."""


def continue_response_headers() -> pb.ProcessingResponse:
    """Let the response go on unchanged (a cancellable request's answer has started)."""
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse())


def hold(seconds: float) -> pb.ProcessingResponse:
    """Extend Envoy's per-message timer while the request waits in a queue.

    Envoy honours one override per processing state, counted from its arrival.
    """
    whole = int(seconds)
    timeout = duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    return pb.ProcessingResponse(override_message_timeout=timeout)


def forward(decision: Forward, phase: str) -> bytes:
    """Release the request upstream with its rewritten body, headers and chosen endpoints:
    the ``ProcessingResponse``, already encoded (the wire format below).

    ``phase`` is the message being answered (``request_body``, or ``request_headers`` for a
    request without a body, where the body cannot be replaced).
    """
    endpoints = ",".join(decision.endpoints)
    set_headers = dict(decision.set_headers)
    if endpoints:
        set_headers[ENDPOINT_HEADER] = endpoints
    body_phase = phase == "request_body"
    if body_phase:
        # In BUFFERED mode the processor owns content-length; a stale one is a local 503.
        set_headers["content-length"] = str(len(decision.body))
    mutation = b"".join([_set_header(key, value) for key, value in set_headers.items()])
    mutation += b"".join(
        [_field(_REMOVE_HEADER, name.encode()) for name in decision.remove_headers]
    )
    common = _field(_HEADER_MUTATION, mutation)
    if body_phase:
        common += _field(_BODY_MUTATION, _field(_BODY, decision.body))
    metadata = b""
    if endpoints:
        metadata += _namespace(LB_NAMESPACE, _string_entry(ENDPOINT_HEADER, endpoints))
    if decision.metadata:
        entries = b"".join([_string_entry(k, v) for k, v in decision.metadata.items()])
        metadata += _namespace(FAIRLANE_NAMESPACE, entries)
    answer = _REQUEST_BODY if body_phase else _REQUEST_HEADERS
    return _field(answer, _field(_RESPONSE, common)) + _field(_DYNAMIC_METADATA, metadata)


# ``forward``'s answer in protobuf's wire format, by hand. Filling the generated message
# field by field and serializing it cost 23-29 us a request (upb's attribute and map
# accesses for ~9 headers and the metadata); this 15-23 us, the same decision, measured one
# after the other. Every field here is length-delimited (wire type 2): a tag
# byte, the length as a varint, the bytes. The field numbers are those of
# external_processor.proto, base.proto and struct.proto; test_codec.py checks the result
# against the message built through the generated classes.
_REQUEST_HEADERS, _REQUEST_BODY, _DYNAMIC_METADATA = 1, 3, 8  # ProcessingResponse
_RESPONSE = 1  # HeadersResponse / BodyResponse .response
_HEADER_MUTATION, _BODY_MUTATION = 2, 3  # CommonResponse
_SET_HEADER, _REMOVE_HEADER = 1, 2  # HeaderMutation
_HEADER = 1  # HeaderValueOption .header
_KEY, _RAW_VALUE = 1, 3  # HeaderValue (raw_value: Envoy reads only raw_value)
_BODY = 1  # BodyMutation
_ENTRY, _ENTRY_KEY, _ENTRY_VALUE = 1, 1, 2  # Struct .fields, a map: entries of key, value
_STRING_VALUE, _STRUCT_VALUE = 3, 5  # Value


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited field: tag, length (varint), bytes."""
    size = len(payload)
    if size < 0x80:
        return bytes((number << 3 | 2, size)) + payload
    length = bytearray()
    while size >= 0x80:
        length.append(size & 0x7F | 0x80)
        size >>= 7
    length.append(size)
    return bytes((number << 3 | 2,)) + length + payload


def _set_header(key: str, value: str) -> bytes:
    """A ``HeaderMutation.set_headers`` entry: ``{header: {key, raw_value}}``."""
    name, raw = key.encode(), value.encode()
    inner = 4 + len(name) + len(raw)  # the HeaderValue: two tags, two one-byte lengths
    if inner + 2 < 0x80:  # every length fits one byte (nearly every header): one format
        return b"\x0a%c\x0a%c\x0a%c%s\x1a%c%s" % (inner + 2, inner, len(name), name, len(raw), raw)
    return _field(_SET_HEADER, _field(_HEADER, _field(_KEY, name) + _field(_RAW_VALUE, raw)))


def _string_entry(key: str, value: str) -> bytes:
    """A ``Struct.fields`` entry holding a string ``Value``."""
    name, text = key.encode(), value.encode()
    inner = 4 + len(name) + len(text)  # key field, then the value field holding a Value
    if inner + 2 < 0x80:  # the Value's own field adds two bytes inside the value field
        return b"\x0a%c\x0a%c%s\x12%c\x1a%c%s" % (
            inner + 2,
            len(name),
            name,
            len(text) + 2,
            len(text),
            text,
        )
    value_field = _field(_ENTRY_VALUE, _field(_STRING_VALUE, text))
    return _field(_ENTRY, _field(_ENTRY_KEY, name) + value_field)


def _namespace(key: str, entries: bytes) -> bytes:
    """A ``Struct.fields`` entry holding a ``Struct`` of encoded entries (a namespace)."""
    value_field = _field(_ENTRY_VALUE, _field(_STRUCT_VALUE, entries))
    return _field(_ENTRY, _field(_ENTRY_KEY, key.encode()) + value_field)


def encoded(message: pb.ProcessingResponse | bytes) -> bytes:
    """The serializer of the servicer's answers: ``forward``'s are encoded already."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def respond(decision: Respond) -> pb.ProcessingResponse:
    """Answer the client from Envoy (429, 401, ...): nothing reaches a backend."""
    headers = {"content-type": "application/json", **decision.headers}
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=decision.status),
            headers=_mutation(headers, ()),
            body=decision.body,
        )
    )


def completions(
    entries: Iterable[accesslog_pb2.HTTPAccessLogEntry],
    wanted: Callable[[str], bool] = lambda request_id: True,
    elsewhere: Callable[[str], None] | None = None,
) -> Iterator[Completion]:
    """Finished requests from one batch of Envoy access-log entries, those whose request id
    is ``wanted`` only. With replicas every replica gets every completion: of another
    replica's request only the backend it finished on is read (``elsewhere(upstream)``), so
    a replica does not pay N times the feed."""
    for entry in entries:
        request_id = entry.request.request_id
        common = entry.common_properties
        if not wanted(request_id):
            if elsewhere is not None:
                elsewhere(_upstream(common))
            continue
        upstream = _upstream(common)
        ttfb = None
        if common.HasField("time_to_first_downstream_tx_byte"):
            ttfb = _seconds(common.time_to_first_downstream_tx_byte)
        yield Completion(
            request_id=request_id,
            status=entry.response.response_code.value,
            upstream=upstream,
            duration_s=_seconds(common.duration),
            response_bytes=entry.response.response_body_bytes,
            ttfb_s=ttfb,
        )


def _upstream(common: accesslog_pb2.AccessLogCommon) -> str:
    """``ip:port`` of the backend that answered last ('' when none did)."""
    if not common.HasField("upstream_remote_address"):
        return ""
    socket = common.upstream_remote_address.socket_address
    return f"{socket.address}:{socket.port_value}"


def _seconds(duration: duration_pb2.Duration) -> float:
    return duration.seconds + duration.nanos / 1e9


RUNTIME_TYPE_URL = "type.googleapis.com/envoy.service.runtime.v3.Runtime"


def runtime_response(
    name: str, version: int, values: Mapping[str, float]
) -> discovery_pb2.DiscoveryResponse:
    """The whole runtime layer ``name`` (state of the world), as one RTDS response."""
    runtime = rtds_pb2.Runtime(name=name)
    for key, value in values.items():
        runtime.layer.fields[key].number_value = value
    return _discovery_response(runtime, RUNTIME_TYPE_URL, version)


def _discovery_response(
    resource: Message, type_url: str, version: int
) -> discovery_pb2.DiscoveryResponse:
    """One xDS state-of-the-world response holding ``resource``; the version is its nonce
    too (each version is sent once per stream)."""
    packed = any_pb2.Any()
    packed.Pack(resource)
    return discovery_pb2.DiscoveryResponse(
        version_info=str(version), resources=[packed], type_url=type_url, nonce=str(version)
    )


ENDPOINTS_TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
OVERPROVISIONING_FACTOR = 140
"""Envoy's default, explicit as in the static cluster: priority 0 keeps all traffic until
fewer than 1/1.4 of its hosts are healthy."""


def endpoints_response(
    cluster: str, version: int, levels: Iterable[Level]
) -> discovery_pb2.DiscoveryResponse:
    """The whole host set of ``cluster`` (state of the world), as one EDS response."""
    assignment = endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster)
    assignment.policy.overprovisioning_factor.value = OVERPROVISIONING_FACTOR
    for level in levels:
        locality = assignment.endpoints.add()
        locality.locality.region = level.region
        locality.priority = level.priority
        for endpoint in level.endpoints:
            lb_endpoint = locality.lb_endpoints.add()
            socket = lb_endpoint.endpoint.address.socket_address
            socket.address = endpoint.host
            socket.port_value = endpoint.port
            lb_endpoint.load_balancing_weight.value = endpoint.weight
    return _discovery_response(assignment, ENDPOINTS_TYPE_URL, version)
