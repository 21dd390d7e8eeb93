"""Servicers on a real gRPC server on loopback, and grpc's own client channel to it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from extproc.transport.h2grpc import GrpcServer


@contextlib.asynccontextmanager
async def serving(
    server: grpc.aio.Server | GrpcServer,
    register: Callable[[Any], None],
    channel_options: Sequence[tuple[str, Any]] = (),
) -> AsyncIterator[grpc.aio.Channel]:
    """``register(server)`` (an ``add_*_to_server``), the server started on a free loopback
    port, and a channel to it; both closed at the end, also when the test fails."""
    register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=list(channel_options))
    try:
        yield channel
    finally:
        await channel.close()
        await server.stop(None)
