"""The runtime layer the service serves Envoy: its versioning, and RTDS over real gRPC."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import grpc
import pytest
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.runtime.v3 import rtds_pb2, rtds_pb2_grpc

from extproc.transport.codec import RUNTIME_TYPE_URL
from extproc.transport.h2grpc import GrpcServer
from extproc.transport.limits import ServerLimits
from extproc.transport.runtime import RuntimeLayer
from extproc.transport.servicer import RuntimeDiscovery
from extproc.wire import RUNTIME_LAYER, SHED_RUNTIME_KEY
from tests.loopback_grpc import serving
from tests.polling import until

WAIT_S = 5.0

# --------------------------------------------------------------------------- the layer


async def _yield_to_others(times: int = 5) -> None:
    """Let every ready task run (not a wait for a condition: nothing is due)."""
    for _ in range(times):
        await asyncio.sleep(0)


def test_publish_bumps_the_version_only_on_change() -> None:
    layer = RuntimeLayer()
    assert layer.name == RUNTIME_LAYER
    assert (layer.version, layer.values) == (0, {})
    layer.publish(SHED_RUNTIME_KEY, 0)
    assert (layer.version, layer.values) == (1, {SHED_RUNTIME_KEY: 0})
    layer.publish(SHED_RUNTIME_KEY, 0)
    assert layer.version == 1
    layer.publish(SHED_RUNTIME_KEY, 40)
    layer.publish(SHED_RUNTIME_KEY, 40)
    assert (layer.version, layer.values) == (2, {SHED_RUNTIME_KEY: 40})
    layer.publish("other", 1)
    assert (layer.version, layer.values) == (3, {SHED_RUNTIME_KEY: 40, "other": 1})
    copy = layer.values
    copy[SHED_RUNTIME_KEY] = 99  # a copy: the layer changes only through publish
    assert layer.values[SHED_RUNTIME_KEY] == 40 and layer.version == 3


async def test_changed_since_waits_for_a_change() -> None:
    layer = RuntimeLayer()
    layer.publish(SHED_RUNTIME_KEY, 0)
    version = layer.version
    waiter = asyncio.create_task(layer.changed_since(version))
    try:
        await _yield_to_others()
        assert not waiter.done()
        layer.publish(SHED_RUNTIME_KEY, 0)  # the same value: no change, nobody woken
        await _yield_to_others()
        assert not waiter.done()
        layer.publish(SHED_RUNTIME_KEY, 10)
        await asyncio.wait_for(waiter, WAIT_S)
        assert layer.version == version + 1
    finally:
        waiter.cancel()
    # A version already outdated: returns at once.
    await asyncio.wait_for(layer.changed_since(version), WAIT_S)


async def test_every_waiter_is_woken_and_a_later_one_waits_again() -> None:
    layer = RuntimeLayer()
    waiters = [asyncio.create_task(layer.changed_since(0)) for _ in range(3)]
    await _yield_to_others()
    layer.publish(SHED_RUNTIME_KEY, 5)
    await asyncio.wait_for(asyncio.gather(*waiters), WAIT_S)
    later = asyncio.create_task(layer.changed_since(layer.version))
    try:
        await _yield_to_others()
        assert not later.done()  # the event set for the first change does not wake it
        layer.publish(SHED_RUNTIME_KEY, 6)
        await asyncio.wait_for(later, WAIT_S)
    finally:
        later.cancel()


# --------------------------------------------------------------------------- RTDS over gRPC


class Subscription:
    """One RTDS stream as an Envoy opens it: requests sent through a queue, responses read."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._requests: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()
        stub = rtds_pb2_grpc.RuntimeDiscoveryServiceStub(channel)
        self.call: Any = stub.StreamRuntime(self._send())

    async def _send(self) -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        while (request := await self._requests.get()) is not None:
            yield request

    def send(self, **fields: Any) -> None:
        self._requests.put_nowait(
            discovery_pb2.DiscoveryRequest(type_url=RUNTIME_TYPE_URL, **fields)
        )

    def subscribe(self) -> None:
        self.send(resource_names=[RUNTIME_LAYER])

    async def read(self) -> tuple[discovery_pb2.DiscoveryResponse, rtds_pb2.Runtime]:
        response = await asyncio.wait_for(self.call.read(), WAIT_S)
        assert response is not grpc.aio.EOF, "the stream ended"
        assert response.type_url == RUNTIME_TYPE_URL
        (resource,) = response.resources
        runtime = rtds_pb2.Runtime()
        assert resource.Unpack(runtime)
        return response, runtime

    def ack(self, response: discovery_pb2.DiscoveryResponse) -> None:
        self.send(
            resource_names=[RUNTIME_LAYER],
            version_info=response.version_info,
            response_nonce=response.nonce,
        )


def shed_of(runtime: rtds_pb2.Runtime) -> float:
    assert runtime.name == RUNTIME_LAYER
    return runtime.layer.fields[SHED_RUNTIME_KEY].number_value


@pytest.fixture
async def rtds() -> AsyncIterator[tuple[RuntimeLayer, grpc.aio.Channel]]:
    """A layer served by the service's gRPC server on loopback, and a grpc.aio
    channel to it."""
    layer = RuntimeLayer()
    layer.publish(SHED_RUNTIME_KEY, 0)
    servicer = RuntimeDiscovery(layer)
    register = partial(rtds_pb2_grpc.add_RuntimeDiscoveryServiceServicer_to_server, servicer)
    async with serving(GrpcServer(ServerLimits()), register) as channel:
        yield layer, channel


@pytest.fixture
def service_errors(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.WARNING, logger="fairlane.service")
    yield caplog


async def test_rtds_serves_the_layer_and_every_change(
    rtds: tuple[RuntimeLayer, grpc.aio.Channel], service_errors: pytest.LogCaptureFixture
) -> None:
    layer, channel = rtds
    layer.publish(SHED_RUNTIME_KEY, 25)  # before the subscription: it gets the current layer
    envoy = Subscription(channel)
    try:
        envoy.subscribe()
        first, runtime = await envoy.read()
        assert shed_of(runtime) == 25
        assert first.version_info == str(layer.version) == first.nonce
        envoy.ack(first)

        layer.publish(SHED_RUNTIME_KEY, 25)  # unchanged: nothing is sent for it
        layer.publish(SHED_RUNTIME_KEY, 40)
        second, runtime = await envoy.read()
        assert shed_of(runtime) == 40
        assert int(second.version_info) == int(first.version_info) + 1
        envoy.ack(second)

        # Envoy rejects a layer (NACK): logged at ERROR, the stream goes on.
        envoy.send(
            resource_names=[RUNTIME_LAYER],
            version_info=first.version_info,
            response_nonce=second.nonce,
            error_detail={"code": 3, "message": "bad runtime value"},  # a google.rpc.Status
        )
        await until(
            lambda: any(
                r.levelno == logging.ERROR and "bad runtime value" in r.getMessage()
                for r in service_errors.records
            ),
            "the rejection logged",
            WAIT_S,
        )
        layer.publish(SHED_RUNTIME_KEY, 0)
        third, runtime = await envoy.read()
        assert shed_of(runtime) == 0
        assert int(third.version_info) > int(second.version_info)
        assert not envoy.call.done()
    finally:
        envoy.call.cancel()


async def test_every_subscriber_gets_the_same_layer(
    rtds: tuple[RuntimeLayer, grpc.aio.Channel],
) -> None:
    layer, channel = rtds
    envoys = [Subscription(channel) for _ in range(2)]
    try:
        for envoy in envoys:
            envoy.subscribe()
            _, runtime = await envoy.read()
            assert shed_of(runtime) == 0
        layer.publish(SHED_RUNTIME_KEY, 95)
        for envoy in envoys:
            response, runtime = await envoy.read()
            assert shed_of(runtime) == 95 and response.version_info == str(layer.version)
    finally:
        for envoy in envoys:
            envoy.call.cancel()


async def test_a_subscription_to_another_layer_is_warned_about_and_still_served(
    rtds: tuple[RuntimeLayer, grpc.aio.Channel], service_errors: pytest.LogCaptureFixture
) -> None:
    _, channel = rtds
    envoy = Subscription(channel)
    try:
        envoy.send(resource_names=["someone_else"])
        _, runtime = await envoy.read()
        assert shed_of(runtime) == 0
        warnings = [r for r in service_errors.records if r.levelno == logging.WARNING]
        assert any("someone_else" in r.getMessage() for r in warnings)
    finally:
        envoy.call.cancel()
