"""Protocol-only stand-ins for the fairlane service, for tests of Envoy's configuration.

The real service (``extproc/transport/servicer.py``) decides per request; a double answers what the
test's own request headers tell it to, so a test can drive Envoy's routing, rejection and
hold paths directly. This module holds what every double needs: the servicer, serving it on
a loopback port on the real service's gRPC server, the headers phase (always "continue")
and header mutations. A subclass says how to answer the buffered body.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from extproc.transport.h2grpc import GrpcServer
from extproc.transport.limits import ServerLimits


def header_option(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode())
    )


class ExtProcDouble:
    """One ext_proc stream per request: headers answered "continue", then ``answer_body``."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        """The request headers of every stream, in arrival order."""
        double = self

        class Servicer(external_processor_pb2_grpc.ExternalProcessorServicer):
            async def Process(  # grpc's method name
                self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
            ) -> AsyncIterator[pb.ProcessingResponse]:
                async for response in double._process(request_iterator):
                    yield response

        self.servicer = Servicer()

    async def serve(self, port: int) -> GrpcServer:
        """Serve on 127.0.0.1:``port``; the caller stops the returned server."""
        server = GrpcServer(ServerLimits())
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(self.servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server

    def answer_body(
        self, headers: dict[str, str], body: bytes
    ) -> AsyncIterator[pb.ProcessingResponse]:
        raise NotImplementedError

    async def _process(
        self, requests: AsyncIterator[pb.ProcessingRequest]
    ) -> AsyncIterator[pb.ProcessingResponse]:
        headers: dict[str, str] = {}
        async for request in requests:
            if request.WhichOneof("request") == "request_headers":
                headers = {
                    h.key: h.raw_value.decode() for h in request.request_headers.headers.headers
                }
                self.seen.append(headers)
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                continue
            async for response in self.answer_body(headers, request.request_body.body):
                yield response
            return
