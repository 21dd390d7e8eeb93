"""The backends' host set the service serves Envoy: levels from the pool, versioning, and EDS
over real gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import grpc
import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc

from extproc.fleet.backend import BackendPool, BackendSpec
from extproc.transport.codec import ENDPOINTS_TYPE_URL, endpoints_response
from extproc.transport.endpoints import Endpoint, EndpointSet, Level, levels_of
from extproc.transport.h2grpc import GrpcServer
from extproc.transport.limits import ServerLimits
from extproc.transport.servicer import EndpointDiscovery
from extproc.wire import BACKEND_CLUSTER
from tests.loopback_grpc import serving

WAIT_S = 5.0


def test_levels_are_the_configured_regions_in_order_empty_ones_kept() -> None:
    pool = BackendPool(
        [BackendSpec("10.0.0.2", 8000, "b", weight=3)], regions=("a", "b"), dynamic=True
    )
    assert levels_of(pool) == (
        Level("a", 0, ()),
        Level("b", 1, (Endpoint("10.0.0.2", 8000, 3),)),
    )
    joined = pool.add(BackendSpec("10.0.0.1", 8000, "a"))
    assert joined.membership == "warming"  # Envoy knows it before it gets traffic
    assert levels_of(pool)[0] == Level("a", 0, (Endpoint("10.0.0.1", 8000, 1),))
    pool.remove("10.0.0.2:8000")
    assert levels_of(pool)[1] == Level("b", 1, ())


def test_publish_bumps_the_version_only_on_change() -> None:
    endpoints = EndpointSet()
    level = (Level("a", 0, (Endpoint("10.0.0.1", 1, 1),)),)
    assert endpoints.publish(level) and endpoints.version == 1
    assert not endpoints.publish((Level("a", 0, (Endpoint("10.0.0.1", 1, 1),)),))
    assert endpoints.publish(()) and endpoints.version == 2


def test_the_response_is_a_cluster_load_assignment_with_priorities() -> None:
    levels = (
        Level("east", 0, (Endpoint("10.0.0.1", 8000, 2), Endpoint("fd00::1", 8000, 1))),
        Level("west", 1, ()),
    )
    response = endpoints_response(BACKEND_CLUSTER, 7, levels)
    assert (response.version_info, response.nonce, response.type_url) == (
        "7",
        "7",
        ENDPOINTS_TYPE_URL,
    )
    assignment = unpack(response)
    assert assignment.cluster_name == BACKEND_CLUSTER
    assert assignment.policy.overprovisioning_factor.value == 140
    east, west = assignment.endpoints
    assert (east.locality.region, east.priority, west.locality.region, west.priority) == (
        "east",
        0,
        "west",
        1,
    )
    hosts = [
        (e.endpoint.address.socket_address.address, e.endpoint.address.socket_address.port_value)
        for e in east.lb_endpoints
    ]
    assert hosts == [("10.0.0.1", 8000), ("fd00::1", 8000)]
    assert [e.load_balancing_weight.value for e in east.lb_endpoints] == [2, 1]
    assert not west.lb_endpoints


def unpack(response: discovery_pb2.DiscoveryResponse) -> endpoint_pb2.ClusterLoadAssignment:
    (resource,) = response.resources
    assignment = endpoint_pb2.ClusterLoadAssignment()
    assert resource.Unpack(assignment)
    return assignment


@pytest.fixture
async def eds() -> AsyncIterator[tuple[EndpointSet, grpc.aio.Channel]]:
    """A host set served by the service's gRPC server on loopback, and a grpc.aio
    channel to it."""
    endpoints = EndpointSet()
    endpoints.publish((Level("a", 0, (Endpoint("10.0.0.1", 8000, 1),)),))
    servicer = EndpointDiscovery(endpoints)
    register = partial(eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server, servicer)
    async with serving(GrpcServer(ServerLimits()), register) as channel:
        yield endpoints, channel


async def test_eds_serves_the_set_and_every_change(
    eds: tuple[EndpointSet, grpc.aio.Channel],
) -> None:
    endpoints, channel = eds
    requests: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()

    async def send() -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        while (request := await requests.get()) is not None:
            yield request

    call: Any = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel).StreamEndpoints(send())
    try:
        requests.put_nowait(
            discovery_pb2.DiscoveryRequest(
                type_url=ENDPOINTS_TYPE_URL, resource_names=[BACKEND_CLUSTER]
            )
        )
        first = await asyncio.wait_for(call.read(), WAIT_S)
        (level,) = unpack(first).endpoints
        assert [e.endpoint.address.socket_address.address for e in level.lb_endpoints] == [
            "10.0.0.1"
        ]
        requests.put_nowait(  # the ACK
            discovery_pb2.DiscoveryRequest(
                type_url=ENDPOINTS_TYPE_URL,
                resource_names=[BACKEND_CLUSTER],
                version_info=first.version_info,
                response_nonce=first.nonce,
            )
        )
        endpoints.publish(
            (Level("a", 0, (Endpoint("10.0.0.1", 8000, 1), Endpoint("10.0.0.2", 8000, 1))),)
        )
        second = await asyncio.wait_for(call.read(), WAIT_S)
        assert int(second.version_info) == int(first.version_info) + 1
        (level,) = unpack(second).endpoints
        assert len(level.lb_endpoints) == 2
    finally:
        call.cancel()
        requests.put_nowait(None)
