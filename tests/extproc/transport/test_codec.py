from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.core.decisions import Forward, Respond
from extproc.transport import codec


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
    response = codec.forward(decision, "request_body")
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
    response = codec.forward(Forward(body=b"", endpoints=("10.0.0.1:8000",)), "request_headers")
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
