"""The transport's floor: what no Python decision code behind this Envoy config could beat.

``python -m loadtests.bench.overhead.floor`` runs the overhead bench's instant backend and
the gateway's own Envoy bootstrap (ext_proc in BUFFERED mode, the completion access log,
the runtime layer), but in place of the fairlane service a trivial servicer: it answers the
headers message with "continue" and the body message with the endpoint header and metadata,
deciding nothing, and drains the access log. It runs on the service's gRPC server (``h2``,
``extproc.transport.h2grpc``), on grpc.aio (``grpcio``, the reference) and, as ``direct``,
with Envoy alone (no ext_proc), one after the other. The figures it prints, with the CPU per
1,000 requests of Envoy and of the servicer at concurrency 1, are the floor the real service
sits on: the rest is fairlane's own work. ``--headers-only`` and ``--no-access-log`` leave
the body message or the access log out of Envoy's config: what each costs.
"""

from __future__ import annotations

import argparse
import sys
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
from extproc.wire import DESTINATION_HEADER, EXT_PROC_FILTER, LB_NAMESPACE
from loadtests.bench.fifo_bootstrap import render_fifo_bootstrap
from loadtests.bench.overhead.driver import Meter
from loadtests.bench.overhead.eventloop import run_loop
from loadtests.bench.overhead.gateways import cpu_per_1000
from loadtests.bench.overhead.loadgen import LoadGenerator, concurrency1
from loadtests.bench.overhead.phase import summarize_concurrency1
from loadtests.bench.overhead.scenario import DIRECT


class Continue(external_processor_pb2_grpc.ExternalProcessorServicer):
    """Continue the headers; send the body on to ``endpoint``, unchanged (``headers_only``:
    Envoy sends no body, so the headers' answer names the endpoint)."""

    def __init__(self, endpoint: str, headers_only: bool = False) -> None:
        self.endpoint = endpoint
        self.headers_only = headers_only

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in request_iterator:
            phase = message.WhichOneof("request")
            if phase == "request_headers" and not self.headers_only:
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                continue
            common = pb.CommonResponse()
            header = common.header_mutation.set_headers.add().header
            header.key, header.raw_value = DESTINATION_HEADER, self.endpoint.encode()
            metadata = struct_pb2.Struct()
            lb = metadata.fields[LB_NAMESPACE].struct_value
            lb.fields[DESTINATION_HEADER].string_value = self.endpoint
            if phase == "request_headers":
                yield pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
                )
            else:
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
KINDS = (*SERVERS, DIRECT)
HEADERS_ONLY = "headers"

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


async def serve(port: int, endpoint: str, kind: str, headers_only: bool = False) -> None:
    server = grpc_server(kind)
    servicer = Continue(endpoint, headers_only)
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(Drain(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


SERVICER = "floor"
ENVOY = "envoy"


def trimmed(bootstrap: dict[str, Any], headers_only: bool, access_log: bool) -> dict[str, Any]:
    """The gateway's bootstrap less what it is asked to leave out: the request body in the
    ext_proc stream (``headers_only``: one message and one answer per request), the
    completion access log (``access_log`` False)."""
    for listener in bootstrap["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                hcm = network_filter["typed_config"]
                if not access_log:
                    hcm.pop("access_log", None)
                for http_filter in hcm["http_filters"]:
                    if headers_only and http_filter["name"] == EXT_PROC_FILTER:
                        mode = http_filter["typed_config"]["processing_mode"]
                        mode["request_body_mode"] = "NONE"
    return bootstrap


async def measure(
    port: int, backend: int, pids: dict[str, int], seconds: float, c1_requests: int
) -> dict[str, float | None]:
    """Saturation (closed loop, 32 connections), then concurrency 1 (the gateway and the
    backend alternately): req/s, the servicer's cores, the added p50, and the CPU seconds
    per 1,000 requests at concurrency 1 of each process in ``pids`` and of all of them."""
    gen = LoadGenerator(port)
    for _ in range(300):
        await gen.one()
    meter = Meter(pids)
    latencies, errors = await gen.closed_loop(32, seconds)
    usage = meter.stop()
    figures: dict[str, float | None] = {"saturation_rps": round(len(latencies) / usage.wall_s)}
    service = usage.cpu_s.get(SERVICER)
    if service is not None:
        figures["service_cores"] = round(service / usage.wall_s, 2)
        figures["rps_per_service_core"] = round(len(latencies) / max(service, 1e-9))
    backend_gen = LoadGenerator(backend)
    meter = Meter(pids)
    through, direct, c1_errors = await concurrency1(gen, backend_gen, c1_requests)
    c1 = summarize_concurrency1(through, direct, c1_errors, meter.stop())
    gen.close()
    backend_gen.close()
    figures |= {
        "c1_p50_ms": c1["p50_ms"],
        "c1_backend_p50_ms": c1["backend_p50_ms"],
        "c1_added_p50_ms": c1["c1_added_p50_ms"],
        **{f"c1_{name}_cpu_s_per_1000": cpu_per_1000(c1, name) for name in pids},
        "c1_cpu_s_per_1000": cpu_per_1000(c1),
        "errors": errors + c1_errors,
    }
    return figures


def run(
    seconds: float,
    kind: str,
    c1_requests: int = 2000,
    headers_only: bool = False,
    access_log: bool = True,
) -> dict[str, float | None]:
    """Start backend, trivial servicer (on a ``kind`` gRPC server; none for ``direct``) and
    Envoy (its bootstrap :func:`trimmed`); measure; stop them all."""
    with TemporaryDirectory() as folder, ProcessGroup(Path(folder)) as group:
        backend = BackendSpec("127.0.0.1", free_port(), "local")
        argv = [sys.executable, "-m", "loadtests.bench.overhead.backend"]
        child = group.start("backend", [*argv, "--port", str(backend.port)])
        wait_http_ready(f"{backend.url}/health", child, timeout=30)
        port, admin = free_port(), free_port()
        pids: dict[str, int] = {}
        if kind == DIRECT:
            params = EnvoyParams(listen_port=port, admin_port=admin, backends=(backend,))
            bootstrap = render_fifo_bootstrap(params)
        else:
            service_port = free_port()
            me = [sys.executable, "-m", "loadtests.bench.overhead.floor", "--serve"]
            messages = HEADERS_ONLY if headers_only else "headers,body"
            args = [str(service_port), backend.address, kind, messages]
            service = group.start(SERVICER, [*me, *args])
            wait_port_open(service_port, service)
            pids[SERVICER] = service.popen.pid
            params = EnvoyParams(
                listen_port=port, admin_port=admin, extproc_port=service_port, backends=(backend,)
            )
            bootstrap = trimmed(render_bootstrap(params), headers_only, access_log)
        config = Path(folder) / "envoy.yaml"
        config.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        envoy = group.start(ENVOY, envoy_argv(config))
        wait_http_ready(f"http://127.0.0.1:{admin}/ready", envoy, timeout=30)
        pids[ENVOY] = envoy.popen.pid
        return run_loop(measure(port, backend.port, pids, seconds, c1_requests))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.overhead.floor")
    parser.add_argument("--seconds", type=float, default=10.0, help="saturation phase length")
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure each server this many times, alternating"
    )
    parser.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"comma-separated, measured in this order (default: {','.join(KINDS)})",
    )
    parser.add_argument(
        "--c1-requests",
        type=int,
        default=2000,
        help="requests through the gateway at concurrency 1",
    )
    parser.add_argument(
        "--headers-only",
        action="store_true",
        help="ext_proc without the request body: one message and one answer per request",
    )
    parser.add_argument(
        "--no-access-log", action="store_true", help="Envoy without the completion access log"
    )
    parser.add_argument(
        "--serve", nargs=4, metavar=("PORT", "ENDPOINT", "KIND", "MESSAGES"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.serve:
        import uvloop

        port, endpoint, kind, messages = args.serve
        uvloop.run(serve(int(port), endpoint, kind, messages == HEADERS_ONLY))
        return 0
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in KINDS:
            parser.error(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    for _ in range(args.rounds):
        for kind in kinds:
            figures = run(
                args.seconds, kind, args.c1_requests, args.headers_only, not args.no_access_log
            )
            print(kind, " ".join(f"{key}={_fmt(value)}" for key, value in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
