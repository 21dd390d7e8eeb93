"""The transport's floor: what no Python decision code behind this Envoy config could beat.

``python -m loadtests.bench.overhead.floor`` runs the overhead bench's instant backend and
the gateway's own Envoy bootstrap (ext_proc in BUFFERED mode, the completion access log,
the runtime layer), but in place of the fairlane service a trivial servicer: it answers the
headers message with "continue" and the body message with the endpoint header and metadata,
deciding nothing, and drains the access log. It runs on the service's gRPC server
(``h2``, ``extproc.transport.h2grpc``) and on grpc.aio (``grpcio``, the well-kept library it
is measured against), one after the other. The saturation and concurrency-1 figures it prints
are the floor the real service sits on: the difference is fairlane's own work, the rest is
the gRPC server and the event loop.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import grpc
import yaml
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from google.protobuf import struct_pb2

from extproc.envoy.binary import envoy_argv
from extproc.envoy.bootstrap import render_bootstrap
from extproc.envoy.params import EnvoyParams
from extproc.fleet.backend import BackendSpec
from extproc.ops.processes import ProcessGroup, free_port, wait_http_ready, wait_port_open
from extproc.transport.h2grpc import GrpcServer
from extproc.transport.limits import ServerLimits
from extproc.wire import DESTINATION_HEADER, LB_NAMESPACE
from loadtests.bench.cpu import process_cpu_seconds
from loadtests.bench.overhead.eventloop import run_loop
from loadtests.bench.overhead.loadgen import LoadGenerator, concurrency1


class Continue(external_processor_pb2_grpc.ExternalProcessorServicer):
    """Continue the headers; send the body on to ``endpoint``, unchanged."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in request_iterator:
            if message.WhichOneof("request") == "request_headers":
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                continue
            common = pb.CommonResponse()
            header = common.header_mutation.set_headers.add().header
            header.key, header.raw_value = DESTINATION_HEADER, self.endpoint.encode()
            metadata = struct_pb2.Struct()
            lb = metadata.fields[LB_NAMESPACE].struct_value
            lb.fields[DESTINATION_HEADER].string_value = self.endpoint
            yield pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
            )
            return


class Drain(als_pb2_grpc.AccessLogServiceServicer):
    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: Any
    ) -> als_pb2.StreamAccessLogsResponse:
        async for _ in request_iterator:
            pass
        return als_pb2.StreamAccessLogsResponse()


SERVERS = ("h2", "grpcio")

GRPCIO_OPTIONS = [
    # Envoy pings its connections every 10 s; grpc's default answers that with GOAWAY.
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", ServerLimits.max_message_bytes),
]


def grpc_server(kind: str) -> GrpcServer | grpc.aio.Server:
    """The service's server (``h2``) or the reference (``grpcio``), nothing registered."""
    if kind == "h2":
        return GrpcServer(ServerLimits())
    if kind == "grpcio":
        return grpc.aio.server(options=GRPCIO_OPTIONS)
    raise ValueError(f"unknown gRPC server {kind!r}: one of {', '.join(SERVERS)}")


async def serve(port: int, endpoint: str, kind: str) -> None:
    server = grpc_server(kind)
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(Continue(endpoint), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(Drain(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def measure(
    port: int, backend: int, service_pid: int, seconds: float, c1_requests: int
) -> dict[str, float]:
    gen = LoadGenerator(port)
    for _ in range(300):
        await gen.one()
    before, started = process_cpu_seconds(service_pid) or 0.0, time.monotonic()
    latencies, errors = await gen.closed_loop(32, seconds)
    elapsed = time.monotonic() - started
    cores = ((process_cpu_seconds(service_pid) or 0.0) - before) / elapsed
    rps = len(latencies) / elapsed
    through, direct, c1_errors = await concurrency1(gen, LoadGenerator(backend), c1_requests)
    through.sort()
    direct.sort()
    return {
        "saturation_rps": round(rps),
        "service_cores": round(cores, 2),
        "rps_per_service_core": round(rps / max(cores, 1e-9)),
        "c1_p50_ms": round(through[len(through) // 2], 3),
        "c1_backend_p50_ms": round(direct[len(direct) // 2], 3),
        "c1_added_p50_ms": round(through[len(through) // 2] - direct[len(direct) // 2], 3),
        "errors": errors + c1_errors,
    }


def run(seconds: float, kind: str, c1_requests: int = 2000) -> dict[str, float]:
    """Start backend, trivial servicer (on a ``kind`` gRPC server) and Envoy; measure;
    stop them all."""
    with TemporaryDirectory() as folder, ProcessGroup(Path(folder)) as group:
        backend = BackendSpec("127.0.0.1", free_port(), "local")
        argv = [sys.executable, "-m", "loadtests.bench.overhead.backend"]
        child = group.start("backend", [*argv, "--port", str(backend.port)])
        wait_http_ready(f"{backend.url}/health", child, timeout=30)
        service_port = free_port()
        me = [sys.executable, "-m", "loadtests.bench.overhead.floor", "--serve"]
        service = group.start("floor", [*me, str(service_port), backend.address, kind])
        wait_port_open(service_port, service)
        port, admin = free_port(), free_port()
        params = EnvoyParams(
            listen_port=port, admin_port=admin, extproc_port=service_port, backends=(backend,)
        )
        config = Path(folder) / "envoy.yaml"
        config.write_text(yaml.safe_dump(render_bootstrap(params), sort_keys=False))
        envoy = group.start("envoy", envoy_argv(config))
        wait_http_ready(f"http://127.0.0.1:{admin}/ready", envoy, timeout=30)
        pid = service.popen.pid
        return run_loop(measure(port, backend.port, pid, seconds, c1_requests))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.overhead.floor")
    parser.add_argument("--seconds", type=float, default=10.0, help="saturation phase length")
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure each server this many times, alternating"
    )
    parser.add_argument(
        "--serve", nargs=3, metavar=("PORT", "ENDPOINT", "KIND"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.serve:
        import uvloop

        uvloop.run(serve(int(args.serve[0]), args.serve[1], args.serve[2]))
        return 0
    for _ in range(args.rounds):
        for kind in SERVERS:
            figures = run(args.seconds, kind)
            print(kind, " ".join(f"{key}={value:g}" for key, value in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
