from datetime import UTC, datetime

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.runtime.v3 import rtds_pb2
from google.protobuf import struct_pb2

from extproc.core.decisions import Forward, Respond
from extproc.transport import codec
from extproc.wire import RUNTIME_LAYER, SHED_RUNTIME_KEY


def headers_message(
    pairs: list[tuple[str, bytes]], end_of_stream: bool = False
) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in pairs]
            ),
            end_of_stream=end_of_stream,
        )
    )


def test_decode_headers_builds_request_info_and_flags_non_utf8_values() -> None:
    message = headers_message(
        [
            (":method", b"POST"),
            (":path", b"/v1/chat/completions"),
            ("x-request-id", b"rid-1"),
            ("x-bad", b"\xff\xfe"),
        ]
    )
    assert codec.kind(message) == "request_headers"
    part = codec.decode_headers(message)
    info = part.request_info(b"{}")
    assert (info.method, info.path, info.request_id, info.body) == (
        "POST",
        "/v1/chat/completions",
        "rid-1",
        b"{}",
    )
    assert info.invalid_headers == ("x-bad",)
    assert "x-bad" not in info.headers
    assert not part.end_of_stream


def test_the_key_envoy_moved_aside_is_read_as_authorization() -> None:
    """The shipped Envoy moves the client's authorization to x-fairlane-client-authorization
    (extproc.envoy.owned_headers); the service authenticates with it, and both names stay in
    the headers so that the gateway strips both."""
    moved = codec.decode_headers(
        headers_message([("x-fairlane-client-authorization", b"Bearer sk-chat-demo")])
    ).headers
    assert moved["authorization"] == "Bearer sk-chat-demo"
    assert "x-fairlane-client-authorization" in moved
    direct = codec.decode_headers(headers_message([("authorization", b"Bearer k")])).headers
    assert direct == {"authorization": "Bearer k"}  # an Envoy without the filter (a mesh)


def set_headers(mutation: pb.HeaderMutation) -> dict[str, bytes]:
    return {o.header.key: o.header.raw_value for o in mutation.set_headers}


def test_forward_on_body_sets_body_content_length_endpoints_and_metadata() -> None:
    decision = Forward(
        body=b'{"priority":3}',
        endpoints=("10.0.0.1:8000", "10.0.0.2:8000"),
        set_headers={"x-vllm-priority": "3"},
        remove_headers=("x-priority",),
        metadata={"tier": "api", "queue_ms": "12"},
    )
    response = pb.ProcessingResponse.FromString(codec.forward(decision, "request_body"))
    common = response.request_body.response
    headers = set_headers(common.header_mutation)
    assert common.body_mutation.body == b'{"priority":3}'
    assert headers["content-length"] == b"14"
    assert headers["x-vllm-priority"] == b"3"
    assert headers[codec.ENDPOINT_HEADER] == b"10.0.0.1:8000,10.0.0.2:8000"
    # raw_value, never value: Envoy reads only raw_value
    assert all(not o.header.value for o in common.header_mutation.set_headers)
    assert list(common.header_mutation.remove_headers) == ["x-priority"]
    metadata = response.dynamic_metadata
    lb = metadata.fields["envoy.lb"].struct_value.fields[codec.ENDPOINT_HEADER].string_value
    assert lb == "10.0.0.1:8000,10.0.0.2:8000"
    assert metadata.fields["fairlane"].struct_value.fields["tier"].string_value == "api"


def test_forward_on_headers_leaves_the_body_alone() -> None:
    encoded = codec.forward(Forward(body=b"", endpoints=("10.0.0.1:8000",)), "request_headers")
    response = pb.ProcessingResponse.FromString(encoded)
    common = response.request_headers.response
    assert not common.HasField("body_mutation")
    assert "content-length" not in set_headers(common.header_mutation)


def test_respond_is_an_immediate_json_response_with_headers() -> None:
    response = codec.respond(Respond(429, b'{"error":{}}', {"retry-after": "7"}))
    immediate = response.immediate_response
    assert immediate.status.code == 429
    assert immediate.body == b'{"error":{}}'
    headers = set_headers(immediate.headers)
    assert headers == {"content-type": b"application/json", "retry-after": b"7"}


def test_hold_is_a_standalone_timeout_override() -> None:
    response = codec.hold(12.5)
    assert response.WhichOneof("response") is None
    assert response.override_message_timeout.seconds == 12
    assert response.override_message_timeout.nanos == 500_000_000


def test_completions_from_access_log_entries() -> None:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.request.request_id = "rid-9"
    entry.response.response_code.value = 200
    entry.response.response_body_bytes = 1234
    entry.common_properties.upstream_remote_address.socket_address.address = "127.0.0.1"
    entry.common_properties.upstream_remote_address.socket_address.port_value = 8101
    entry.common_properties.duration.seconds = 2
    entry.common_properties.duration.nanos = 250_000_000
    (completion,) = codec.completions([entry])
    assert completion.request_id == "rid-9"
    assert completion.status == 200
    assert completion.upstream == "127.0.0.1:8101"
    assert completion.duration_s == 2.25
    assert completion.response_bytes == 1234
    (no_upstream,) = codec.completions([accesslog_pb2.HTTPAccessLogEntry()])
    assert no_upstream.upstream == "" and no_upstream.status == 0


def test_another_replicas_completions_give_only_their_backend() -> None:
    ours, theirs = accesslog_pb2.HTTPAccessLogEntry(), accesslog_pb2.HTTPAccessLogEntry()
    ours.request.request_id, theirs.request.request_id = "ours", "theirs"
    address = theirs.common_properties.upstream_remote_address.socket_address
    address.address, address.port_value = "10.0.0.2", 8000
    elsewhere: list[str] = []
    got = codec.completions([ours, theirs], lambda rid: rid == "ours", elsewhere.append)
    assert [c.request_id for c in got] == ["ours"]
    assert elsewhere == ["10.0.0.2:8000"]


# --------------------------------------------------------------------------- overload


def with_request_time(message: pb.ProcessingRequest, value: str) -> pb.ProcessingRequest:
    """``message`` with the ``request.time`` attribute as the ext_proc filter sends it."""
    attributes = message.attributes[codec.ATTRIBUTES_KEY]
    attributes.fields[codec.RECEIVED_ATTRIBUTE].string_value = value
    return message


REQUEST_HEADERS = [(":method", b"POST"), (":path", b"/v1/chat/completions")]


def test_received_at_is_envoys_request_time_as_unix_time() -> None:
    expected = datetime(2026, 11, 24, 2, 13, 32, 123456, tzinfo=UTC).timestamp()
    for text in (
        "2026-11-24T02:13:32.123456+00:00",  # what Envoy 1.40 sends (seen in a real run)
        "2026-11-24T02:13:32.123456789Z",  # RFC 3339 in UTC, nanoseconds
        "2026-11-24T02:13:32.123456Z",
        "2026-11-24T03:13:32.123456+01:00",
    ):
        message = with_request_time(headers_message(REQUEST_HEADERS), text)
        # through the wire format, as the servicer receives it
        wire = pb.ProcessingRequest.FromString(message.SerializeToString())
        part = codec.decode_headers(wire)
        assert part.received_at == pytest.approx(expected, abs=1e-6), text
        assert part.headers[":path"] == "/v1/chat/completions"


def test_received_at_is_none_without_the_attribute() -> None:
    assert codec.decode_headers(headers_message(REQUEST_HEADERS)).received_at is None
    # the filter's namespace present, without request.time in it
    message = headers_message(REQUEST_HEADERS)
    message.attributes[codec.ATTRIBUTES_KEY].fields["request.id"].string_value = "x"
    assert codec.decode_headers(message).received_at is None


@pytest.mark.parametrize("garbage", ["", "yesterday", "2026-13-45T99:00:00Z", "1795486412"])
def test_received_at_is_none_for_garbage(garbage: str) -> None:
    message = with_request_time(headers_message(REQUEST_HEADERS), garbage)
    part = codec.decode_headers(message)
    assert part.received_at is None
    assert part.headers[":method"] == "POST"  # the request itself still decodes


def test_runtime_response_packs_the_whole_layer() -> None:
    values = {SHED_RUNTIME_KEY: 35, "fairlane.other": 0.5}
    response = codec.runtime_response(RUNTIME_LAYER, 7, values)
    assert response.version_info == "7"
    assert response.nonce == "7"
    assert response.type_url == "type.googleapis.com/envoy.service.runtime.v3.Runtime"
    (resource,) = response.resources
    assert resource.type_url == response.type_url
    runtime = rtds_pb2.Runtime()
    assert resource.Unpack(runtime)
    assert runtime.name == RUNTIME_LAYER
    assert dict(runtime.layer.fields.items()) == {
        SHED_RUNTIME_KEY: struct_pb2.Value(number_value=35),
        "fairlane.other": struct_pb2.Value(number_value=0.5),
    }
    # the same bytes Envoy reads
    decoded = discovery_pb2.DiscoveryResponse.FromString(response.SerializeToString())
    assert decoded == response
    empty = codec.runtime_response(RUNTIME_LAYER, 0, {})
    assert empty.version_info == "0" and len(empty.resources) == 1


def built_with_upb(decision: Forward, phase: str) -> pb.ProcessingResponse:
    """What ``forward`` encodes by hand, built through the generated messages."""
    common = pb.CommonResponse()
    set_headers = dict(decision.set_headers)
    set_headers[codec.ENDPOINT_HEADER] = ",".join(decision.endpoints)
    if phase == "request_body":
        set_headers["content-length"] = str(len(decision.body))
        common.body_mutation.body = decision.body
    for key, value in set_headers.items():
        option = common.header_mutation.set_headers.add()
        option.header.key, option.header.raw_value = key, value.encode()
    common.header_mutation.remove_headers.extend(decision.remove_headers)
    metadata = struct_pb2.Struct()
    lb = metadata.fields["envoy.lb"].struct_value.fields
    lb[codec.ENDPOINT_HEADER].string_value = ",".join(decision.endpoints)
    for key, value in decision.metadata.items():
        metadata.fields["fairlane"].struct_value.fields[key].string_value = value
    if phase == "request_body":
        return pb.ProcessingResponse(
            request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
        )
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
    )


@pytest.mark.parametrize("phase", ["request_body", "request_headers"])
def test_the_hand_encoded_forward_is_the_generated_message(phase: str) -> None:
    decision = Forward(
        body=("é" * 300).encode(),  # lengths past one varint byte
        endpoints=("10.0.0.1:8000", "10.0.0.2:8000"),
        set_headers={"x-vllm-priority": "3", "x-long": "v" * 200},
        remove_headers=("authorization", "x-fairlane-client-authorization"),
        metadata={"tier": "api", "queue_ms": "12", "long": "9" * 200},
    )
    decoded = pb.ProcessingResponse.FromString(codec.forward(decision, phase))
    assert decoded == built_with_upb(decision, phase)
    assert codec.encoded(decoded) == decoded.SerializeToString()
