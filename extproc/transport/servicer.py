"""The grpc.aio servicers: translate Envoy's streams to gateway calls and back.

Deliberately thin. ``ExternalProcessor.Process`` runs once per HTTP request: it answers the
headers message (or decides on it when there is no body), holds the request with
``override_message_timeout`` while it waits in a queue, and sends the final body response
or immediate response. ``AccessLog.StreamAccessLogs`` receives Envoy's access-log entries,
which tell the gateway when each request finished.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from time import perf_counter

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from extproc.core.decisions import Forward, Hold
from extproc.transport import codec
from extproc.transport.held import HeldRequests

log = logging.getLogger("fairlane.service")


class ExternalProcessor(external_processor_pb2_grpc.ExternalProcessorServicer):
    def __init__(self, held: HeldRequests) -> None:
        self.held = held
        self._service_time = held.gateway.stats.service_time

    async def Process(
        self,
        request_iterator: AsyncIterator[codec.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[codec.ProcessingResponse]:
        headers: codec.HeadersPart | None = None
        busy_s = 0.0  # this request's own work here, without the time it is held
        async for message in request_iterator:
            started = perf_counter()
            phase = codec.kind(message)
            if phase == "request_headers":
                headers = codec.decode_headers(message)
                if not headers.end_of_stream:
                    busy_s += perf_counter() - started
                    yield codec.continue_headers()
                    continue
                info = headers.request_info()
            elif phase == "request_body" and headers is not None:
                body, _ = codec.body_of(message)
                info = headers.request_info(body)
            else:
                log.warning(
                    "unexpected ext_proc message %r; check the filter's processing_mode", phase
                )
                continue
            outcome = self.held.handle(info)
            if isinstance(outcome, Hold):
                busy_s += perf_counter() - started
                yield codec.hold(outcome.hold_s)
                # A client that disconnects now cancels this task (CancelledError), which
                # takes the request out of its queue.
                outcome = await self.held.outcome(outcome)
                started = perf_counter()
            if isinstance(outcome, Forward):
                response = codec.forward(outcome, phase)
            else:
                response = codec.respond(outcome)
            self._service_time.observe(busy_s + perf_counter() - started)
            yield response
            return


class AccessLog(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self, held: HeldRequests) -> None:
        self.held = held

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext,
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            for completion in codec.completions(message.http_logs.log_entry):
                self.held.completed(completion)
        return als_pb2.StreamAccessLogsResponse()
