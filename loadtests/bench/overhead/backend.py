"""The overhead measurement's backend: every POST answered at once.

A raw asyncio HTTP/1.1 server (uvloop) that answers every POST with a 1-token chat
completion and serves a static vLLM ``/metrics`` page (an empty engine) so the service's
gates always pass. It is not the simulator on purpose: the simulator models engine steps and
token timing, work this measurement must not include.

``python -m loadtests.bench.overhead.backend --port 8000`` runs it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence

from loadtests.bench.overhead.eventloop import run_loop
from loadtests.bench.overhead.wire import http_response, take_message

_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-overhead",
        "object": "chat.completion",
        "created": 0,
        "model": "sim-llama-8b",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
    }
).encode()
_METRICS = (
    b'vllm:num_requests_running{model_name="sim-llama-8b"} 0\n'
    b'vllm:num_requests_waiting{model_name="sim-llama-8b"} 0\n'
    b'vllm:kv_cache_usage_perc{model_name="sim-llama-8b"} 0\n'
    b'vllm:inter_token_latency_seconds_sum{model_name="sim-llama-8b"} 0\n'
    b'vllm:inter_token_latency_seconds_count{model_name="sim-llama-8b"} 0\n'
    b'vllm:cache_config_info{block_size="16",num_gpu_blocks="100000"} 1\n'
)


ANSWERS: dict[object, bytes] = {
    "POST": http_response("200 OK", _COMPLETION, "application/json"),
    b"/metrics": http_response("200 OK", _METRICS, "text/plain; version=0.0.4"),
    b"/health": http_response("200 OK", b"", "text/plain"),
}


class _BackendProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, requests with ``content-length`` bodies, answered at once."""

    def __init__(self) -> None:
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (message := take_message(self.buffer)) is not None:
            head, self.buffer = message
            method, _, rest = head.partition(b" ")
            path = rest.split(b" ", 1)[0]
            answer = ANSWERS["POST"] if method == b"POST" else ANSWERS.get(path)
            assert self.transport is not None
            self.transport.write(answer or http_response("404 Not Found", b"", "text/plain"))


async def serve_backend(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_BackendProtocol, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.overhead.backend", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    run_loop(serve_backend(args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
