"""The HTTP connection manager settings a hold depends on, and the access logs.

Shared by the bootstrap's listener, the mesh snippet and Istio's EnvoyFilter, which merge
them into a connection manager they did not render. The access logs are here because Envoy
configures them on the connection manager: the first is not a log at all but the completion
feed, Envoy's gRPC access-log stream to the service, which is how the service learns that a
request finished and frees its backend slot without response bodies passing through Python.
"""

from __future__ import annotations

from typing import Any

from extproc.core.errors import error_body
from extproc.envoy.params import EnvoyParams
from extproc.envoy.protojson import duration
from extproc.envoy.replicas import completion_clusters
from extproc.wire import (
    COMPLETIONS_LOG,
    FAIRLANE_NAMESPACE,
    QUEUE_MS_KEY,
    TIER_KEY,
)


def hcm_settings(params: EnvoyParams) -> dict[str, Any]:
    """HTTP connection manager fields the hold depends on (for the bootstrap's own HCM and
    for meshes that merge them into an HCM they generate)."""
    return {
        # Keeps ticking while ext_proc holds the request: must exceed the longest hold.
        "stream_idle_timeout": duration(params.stream_idle_timeout_s),
        # Slow-loris guard; unrelated to holds (the headers are complete before ext_proc).
        "request_headers_timeout": "10s",
        # Huge headers get a clear 431 instead of a reset.
        "max_request_headers_kb": 96,
        # x-request-id ties the service's logs, the access log and the client together.
        "generate_request_id": True,
        "access_log": access_logs(params),
        "local_reply_config": local_reply_config(),
    }


UNAVAILABLE_MESSAGE = (
    "the gateway's scheduler did not answer (down, overloaded or too slow); retry later"
)
UNAVAILABLE_CODE = "gateway_unavailable"


def local_reply_config() -> dict[str, Any]:
    """Envoy's own answer when its call to the service fails, in OpenAI's error shape.

    The ext_proc filter answers ``status_on_error`` (503), or 504 on a message timeout,
    with an empty body when the service is down, too slow, or when the service cluster's
    circuit breaker turns a stream away (a burst far past the service's capacity, before its
    overload control reacts). Clients read OpenAI's JSON and ``retry-after``, so those
    answers get both. Matched on the response code details Envoy gives them
    (``ext_proc_error...``), so the service's own answers, which already carry them, and
    the backends' answers pass unchanged.
    """
    return {
        "mappers": [
            {
                "filter": {
                    "extension_filter": {
                        "name": "envoy.access_loggers.extension_filters.cel",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.access_loggers."
                            "filters.cel.v3.ExpressionFilter",
                            "expression": "response.code_details.startsWith('ext_proc_error')",
                        },
                    }
                },
                "headers_to_add": [
                    {
                        "header": {"key": "retry-after", "value": "1"},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    }
                ],
                "body_format_override": {
                    "text_format_source": {
                        "inline_string": error_body(
                            503, UNAVAILABLE_MESSAGE, UNAVAILABLE_CODE
                        ).decode()
                    },
                    "content_type": "application/json",
                },
            }
        ]
    }


def access_logs(params: EnvoyParams) -> list[dict[str, Any]]:
    """The completion feed first (one logger per service replica), then the optional file log.

    Entries are batched for at most ``completion_flush_s``, 10 ms by default
    (``buffer_flush_interval``; Envoy's default of
    1 s would leave a freed engine seat idle for up to a second), and up to 16 KiB, about
    30 entries, per message. One gRPC message per finished request cost the service about
    5 % of its throughput at saturation (A/B in loadtests/bench/README.md); 10 ms is under
    one engine step, so a freed seat is refilled about as soon as it would have been.
    """
    logs = [
        {
            "name": "envoy.access_loggers.http_grpc",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3."
                "HttpGrpcAccessLogConfig",
                "common_config": {
                    "log_name": COMPLETIONS_LOG,
                    "transport_api_version": "V3",
                    "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                    "buffer_size_bytes": 16384,
                    "buffer_flush_interval": duration(params.completion_flush_s),
                },
            },
        }
        # With replicas, one logger per replica, each to that replica alone: every replica
        # must see every completion (extproc.envoy.replicas).
        for cluster in completion_clusters(params)
    ]
    if params.access_log_path is not None:
        logs.append(file_access_log(params.access_log_path))
    return logs


def file_access_log(path: str) -> dict[str, Any]:
    """A one-line-per-request text log with the tier and the time held (from the
    ``fairlane`` metadata; empty for requests the service never saw)."""
    fields = [
        "[%START_TIME%]",
        '"%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%"',
        "%RESPONSE_CODE% %RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION%ms",
        "upstream=%UPSTREAM_HOST%",
        f"tier=%DYNAMIC_METADATA({FAIRLANE_NAMESPACE}:{TIER_KEY})%",
        f"queue_ms=%DYNAMIC_METADATA({FAIRLANE_NAMESPACE}:{QUEUE_MS_KEY})%",
        "id=%REQ(X-REQUEST-ID)%",
    ]
    return {
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": path,
            "log_format": {"text_format_source": {"inline_string": " ".join(fields) + "\n"}},
        },
    }
