"""The gRPC servicers: translate Envoy's streams to gateway calls and back.

They run on either gRPC server (``transport.h2grpc``, the default, or grpc.aio), which call
them the same way: a request iterator and a context in, answers yielded or returned; a
stream the client resets cancels the call's task.

Deliberately thin. ``ExternalProcessor.Process`` runs once per HTTP request: it answers the
headers message (or decides on it when there is no body), holds the request with
``override_message_timeout`` while it waits in a queue, and sends the final body response
or immediate response.
``AccessLog.StreamAccessLogs`` receives Envoy's access-log entries, which tell the gateway
when each request finished. ``RuntimeDiscovery.StreamRuntime``
serves the runtime layer (``transport.runtime``) to every Envoy subscribed to it, and
``EndpointDiscovery.StreamEndpoints`` the backends' host set (``transport.endpoints``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from time import perf_counter, time
from typing import Protocol

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.runtime.v3 import rtds_pb2_grpc

from extproc.core.decisions import Forward, Hold, Respond
from extproc.fleet.adapters import AdapterLoader
from extproc.transport import codec
from extproc.transport.credentials import BackendCredentials
from extproc.transport.endpoints import EndpointSet
from extproc.transport.h2grpc import GrpcServer
from extproc.transport.held import HeldRequests
from extproc.transport.overload import Ages
from extproc.transport.runtime import RuntimeLayer
from extproc.wire import TIER_KEY

log = logging.getLogger("fairlane.service")


EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def add_external_processor(
    servicer: ExternalProcessor, server: grpc.aio.Server | GrpcServer
) -> None:
    """``add_ExternalProcessorServicer_to_server``, with ``codec.encoded`` as the answers'
    serializer: ``codec.forward`` hands over its answer encoded already. ``server`` is
    either gRPC server (grpc.aio's or ``transport.h2grpc``'s)."""
    handlers = {
        "Process": grpc.stream_stream_rpc_method_handler(
            servicer.Process,
            request_deserializer=codec.ProcessingRequest.FromString,
            response_serializer=codec.encoded,
        )
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, handlers),)
    )
    server.add_registered_method_handlers(EXT_PROC_SERVICE, handlers)


class ExternalProcessor(external_processor_pb2_grpc.ExternalProcessorServicer):
    def __init__(
        self,
        held: HeldRequests,
        ages: Ages | None = None,
        credentials: BackendCredentials | None = None,
        adapters: AdapterLoader | None = None,
    ) -> None:
        self.held = held
        self._adapters = adapters
        """Loads runtime LoRA adapters a forward asks for; None: forwards go as they are."""
        self._service_time = held.gateway.stats.service_time
        self._ages = ages or Ages()
        self._credentials = credentials
        """The engines' API keys, when they want any: the last word on a forward."""

    async def Process(
        self,
        request_iterator: AsyncIterator[codec.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncGenerator[codec.ProcessingResponse | bytes, None]:
        headers: codec.HeadersPart | None = None
        busy_s = 0.0  # this request's own work here, without the time it is held
        messages = aiter(request_iterator)
        unwaited: Hold | None = None  # held, but not yet waiting for its outcome
        try:
            async for message in messages:
                started = perf_counter()
                phase = codec.kind(message)
                if phase == "request_headers":
                    headers = codec.decode_headers(message)
                    if not headers.end_of_stream:
                        refused = None
                        if self.held.overloaded:
                            refused = self.held.refuse_early(headers.request_info())
                        busy_s += perf_counter() - started
                        if refused is not None:  # overloaded: not worth reading the body
                            self._service_time.observe(busy_s)
                            yield codec.respond(refused)
                            return
                        yield codec.continue_headers(self.held.may_preempt)
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
                if headers is not None and headers.received_at is not None:
                    self._ages.observe(time() - headers.received_at)
                outcome = self.held.handle(info)
                if isinstance(outcome, Hold):
                    busy_s += perf_counter() - started
                    unwaited = outcome
                    yield codec.hold(outcome.hold_s)
                    unwaited = None
                    # A client that disconnects now cancels this task (CancelledError), which
                    # takes the request out of its queue.
                    outcome = await self.held.outcome(outcome)
                    started = perf_counter()
                if isinstance(outcome, Forward) and outcome.load is not None:
                    busy_s += perf_counter() - started
                    outcome = await self._load_adapter(outcome)
                    started = perf_counter()
                if isinstance(outcome, Forward):
                    if self._credentials is not None:
                        outcome = self._credentials.apply(outcome)
                    response = codec.forward(outcome, phase)
                else:
                    response = codec.respond(outcome)
                self._service_time.observe(busy_s + perf_counter() - started)
                yield response
                if isinstance(outcome, Forward) and outcome.cancel_id is not None:
                    async for reply in self._while_running(outcome, outcome.cancel_id, messages):
                        yield reply
                return
        finally:
            if unwaited is not None:
                # grpc closes this generator at the yield when it cannot send the hold:
                # nobody will wait for that request's outcome, so it must leave its queue.
                self.held.abandon(unwaited)
            # grpc's request iterator is an async generator, left suspended once the answer
            # is sent. Closed here it costs a throw; left to the garbage collector, asyncio
            # finalises it with a new task and a cross-thread wake-up of the loop, per request.
            aclose = getattr(messages, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _load_adapter(self, forward: Forward) -> Forward | Respond:
        """``forward`` once its engine has loaded its adapter, or the 503 that says it
        could not (the seat it was granted is given back when Envoy logs the answer)."""
        load = forward.load
        if load is None or self._adapters is None:
            return forward
        reason = await self._adapters.load(load.address, load.name, load.base, load.path)
        if reason is None:
            return forward
        tier = forward.metadata.get(TIER_KEY, "")
        return self.held.gateway.adapter_unavailable(load, tier, reason)

    async def _while_running(
        self,
        forward: Forward,
        request_id: str,
        messages: AsyncIterator[codec.ProcessingRequest],
    ) -> AsyncIterator[codec.ProcessingResponse]:
        """A cancellable request runs upstream: keep its stream open until its answer
        starts (Envoy sends the response headers), so that a more urgent request can take
        its seat meanwhile. Cancelled, it is answered 503 with ``retry-after``: Envoy
        resets it upstream (vLLM aborts it) and its client, who got nothing yet, sends
        it again."""
        preempted = self.held.cancellable(request_id)
        answer = asyncio.ensure_future(anext(aiter(messages), None))
        try:
            await asyncio.wait((preempted, answer), return_when=asyncio.FIRST_COMPLETED)
            if preempted.done():
                tier = forward.metadata.get(TIER_KEY, "")
                yield codec.respond(self.held.gateway.preempted(tier))
            elif answer.result() is not None and codec.kind(answer.result()) == "response_headers":
                yield codec.continue_response_headers()
        finally:
            self.held.settled(request_id)
            if not answer.done():
                # Stop reading the stream, and wait until the read has let go of grpc's
                # iterator: ``Process`` closes it next, which fails while it is running.
                answer.cancel()
                await asyncio.wait((answer,))


class AccessLog(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self, held: HeldRequests) -> None:
        self.held = held

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext,
    ) -> als_pb2.StreamAccessLogsResponse:
        held = self.held
        async for message in request_iterator:
            entries = message.http_logs.log_entry
            for completion in codec.completions(entries, held.in_flight, held.done_elsewhere):
                held.completed(completion)
        return als_pb2.StreamAccessLogsResponse()


class RuntimeDiscovery(rtds_pb2_grpc.RuntimeDiscoveryServiceServicer):
    """RTDS, state of the world: the whole layer when an Envoy subscribes and again on every
    change. Envoy's acknowledgements are read and otherwise ignored (a rejection is logged):
    the layer is small and always valid, so there is nothing to roll back."""

    def __init__(self, layer: RuntimeLayer) -> None:
        self.layer = layer

    async def StreamRuntime(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        layer = self.layer

        def response(version: int) -> discovery_pb2.DiscoveryResponse:
            return codec.runtime_response(layer.name, version, layer.values)

        subscription = _state_of_the_world(
            request_iterator, layer, response, layer.name, "runtime layer", wildcard=False
        )
        async for answer in subscription:
            yield answer


class EndpointDiscovery(eds_pb2_grpc.EndpointDiscoveryServiceServicer):
    """EDS, state of the world: the whole host set of the backends' cluster when an Envoy
    subscribes and again on every change. A rejection (Envoy keeps its previous set) is
    logged; there is nothing else to roll back."""

    def __init__(self, endpoints: EndpointSet) -> None:
        self.endpoints = endpoints

    async def StreamEndpoints(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        cluster = self.endpoints.cluster
        endpoints = self.endpoints

        def response(version: int) -> discovery_pb2.DiscoveryResponse:
            return codec.endpoints_response(cluster, version, endpoints.levels)

        subscription = _state_of_the_world(
            request_iterator, endpoints, response, cluster, "backends' host set", wildcard=True
        )
        async for answer in subscription:
            yield answer


class _Versioned(Protocol):
    """What an xDS resource served here has: a version that changes with it."""

    version: int

    async def changed_since(self, version: int) -> None: ...


async def _state_of_the_world(
    requests: AsyncIterator[discovery_pb2.DiscoveryRequest],
    resource: _Versioned,
    response: Callable[[int], discovery_pb2.DiscoveryResponse],
    name: str,
    what: str,
    wildcard: bool,
) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
    """xDS state of the world: once Envoy's first request has come, the whole resource
    ``name`` now and again on every change, while Envoy's acknowledgements are read (and a
    rejection logged). A first request that names other resources is logged and served
    anyway; one that names none is a wildcard where the type has them (``wildcard``)."""
    first = await anext(aiter(requests), None)
    if first is None:
        return
    names = list(first.resource_names)
    if name not in names and not (wildcard and not names):
        log.warning("an Envoy asked for %s; this service serves the %s %r", names, what, name)
    acks = asyncio.create_task(_read_acks(requests, what))
    try:
        while True:
            version = resource.version
            yield response(version)
            await resource.changed_since(version)
    finally:
        acks.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await acks


async def _read_acks(requests: AsyncIterator[discovery_pb2.DiscoveryRequest], what: str) -> None:
    async for request in requests:
        if request.HasField("error_detail"):
            log.error("Envoy rejected the %s: %s", what, request.error_detail.message)
