"""The simulator over real loopback sockets: shapes, errors, priority, metrics, aborts."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.fleet.vllm_metrics import MetricsError, parse_metrics
from extproc.ops.processes import ProcessGroup, free_port, wait_http_ready
from loadtests.sim.server import SimConfig, start

CHAT = [{"role": "user", "content": "Tell me a story about a gateway."}]


@dataclass
class Sim:
    base: str
    session: aiohttp.ClientSession
    log: Path

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.session.post(self.base + path, data=data, headers=headers) as resp:
            return resp.status, await resp.json()

    async def stream(self, path: str, body: dict[str, Any]) -> list[Any]:
        async with self.session.post(self.base + path, json={**body, "stream": True}) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            text = (await resp.read()).decode()
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    async def metrics(self) -> str:
        async with self.session.get(self.base + "/metrics") as resp:
            return await resp.text()

    def log_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exposed")


@pytest.fixture
async def sim(tmp_path: Path) -> AsyncIterator[Sim]:
    port = free_port()
    log = tmp_path / "requests.jsonl"
    config = SimConfig(
        model="tiny", speedup=20, seed=3, log_requests=log, scheduling_policy="priority"
    )
    runner = await start(config, "127.0.0.1", port)
    try:
        async with aiohttp.ClientSession() as session:
            yield Sim(f"http://127.0.0.1:{port}", session, log)
    finally:
        await runner.cleanup()


async def test_non_streamed_chat_and_completion(sim: Sim) -> None:
    status, body = await sim.post(
        "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 5}
    )
    assert status == 200 and body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-") and body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert "tool_calls" not in choice["message"]  # vLLM 0.32 leaves it out when there are none
    assert choice["routed_experts"] is None and body["prompt_text"] is None
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", body["id"])
    fingerprint = body["system_fingerprint"]
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5

    status, body = await sim.post(
        "/v1/completions", {"model": "tiny", "prompt": "Once upon", "max_tokens": 3}
    )
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"].count(" ") == 3
    assert body["usage"] == {
        "prompt_tokens": 2,
        "total_tokens": 5,
        "completion_tokens": 3,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert re.fullmatch(r"vllm-0\.32\.0-[0-9a-f]{8}", body["system_fingerprint"])
    assert body["system_fingerprint"] == fingerprint  # fixed per server
    assert {"ec_transfer_params", "metrics"} <= body.keys() and "prompt_text" not in body


async def test_streamed_chat_shapes_and_include_usage(sim: Sim) -> None:
    events = await sim.stream(
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": CHAT,
            "max_tokens": 4,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert {e["id"] for e in events} == {events[0]["id"]}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    tokens = events[1:-1]
    assert len(tokens) == 4 and all("content" in e["choices"][0]["delta"] for e in tokens)
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None, None, None, "length"]
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert events[0]["prompt_token_ids"] is None and events[0]["prompt_text"] is None
    assert all(e["choices"][0]["token_ids"] is None for e in tokens)
    assert usage["system_fingerprint"].startswith("vllm-0.32.0-")
    assert all("system_fingerprint" not in e for e in events[:-1])

    events = await sim.stream("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, "length"]
    assert all("usage" not in e for e in events)  # vLLM has no usage key in content chunks
    assert all(e["choices"][0]["prompt_token_ids"] is None for e in events)
    assert all(e["choices"][0]["token_ids"] is None for e in events)
    # Without a usage chunk the fingerprint rides on the finishing chunk, as in vLLM.
    assert "system_fingerprint" not in events[0] and events[-1]["system_fingerprint"]


async def test_models_and_health(sim: Sim) -> None:
    async with sim.session.get(sim.base + "/v1/models") as resp:
        body = await resp.json()
    assert [m["id"] for m in body["data"]] == ["tiny"] and body["object"] == "list"
    async with sim.session.get(sim.base + "/health") as resp:
        assert resp.status == 200


async def test_errors_are_vllm_shaped_and_the_server_keeps_serving(sim: Sim) -> None:
    status, body = await sim.post("/v1/chat/completions", {"model": "gpt-9", "messages": CHAT})
    assert status == 404
    assert body == {
        "error": {
            "message": "The model `gpt-9` does not exist. Valid aliases: tiny.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    bad: list[Any] = [
        b'{"model": "tiny", "messages": ',
        {"model": "tiny"},
        {"model": "tiny", "messages": CHAT, "max_tokens": 10**7},
        {"model": "tiny", "messages": CHAT, "priority": "high"},
    ]
    for payload in bad:
        status, body = await sim.post("/v1/chat/completions", payload)
        assert status == 400 and body["error"]["code"] == 400, payload
        assert body["error"]["type"] in ("Bad Request", "BadRequestError"), payload
        assert isinstance(body["error"]["param"], str), payload
    status, _ = await sim.post("/v1/completions", {"model": "tiny"})
    assert status == 400
    status, _ = await sim.post(
        "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 2}
    )
    assert status == 200


async def test_priority_header_wins_and_every_request_is_logged(sim: Sim) -> None:
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 1, "priority": 7}
    await sim.post("/v1/chat/completions", body, {"X-Vllm-Priority": "3", "X-Tenant": "acme"})
    await sim.post("/v1/chat/completions", body, {"X-Vllm-Priority": "soon"})
    await sim.post("/v1/chat/completions", {**body, "priority": "x"})
    first, second, third = sim.log_lines()
    assert (first["priority"], first["body_priority"], first["header_priority"]) == (3, 7, 3)
    assert (second["priority"], second["header_priority"]) == (7, None)
    assert first["headers"]["x-tenant"] == "acme" and "x-vllm-priority" in first["headers"]
    assert first["path"] == "/v1/chat/completions" and first["model"] == "tiny"
    assert first["prompt_tokens"] > 0 and first["max_tokens"] == 1 and first["stream"] is False
    assert first["request_id"].startswith("chatcmpl-") and first["time"] > 0
    assert third["request_id"] is None  # refused with a 400, but still logged


async def test_metrics_names_types_and_labels(sim: Sim) -> None:
    await sim.post("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 3})
    text = await sim.metrics()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries_total": "counter",
        "vllm:prefix_cache_hits_total": "counter",
        "vllm:num_preemptions_total": "counter",
        "vllm:prompt_tokens_total": "counter",
        "vllm:generation_tokens_total": "counter",
        "vllm:request_success_total": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:cache_config_info": "gauge",
        "vllm:prefix_cache_queries_created": "gauge",
    }
    assert {k: types.get(k) for k in expected} == expected
    assert metric(text, "vllm:request_success_total", finished_reason="length") == 1
    assert metric(text, "vllm:generation_tokens_total", engine="0", model_name="tiny") == 3
    assert metric(text, "vllm:prefix_cache_queries_total") > 0
    assert metric(text, "vllm:time_to_first_token_seconds_count") == 1
    assert metric(text, "vllm:inter_token_latency_seconds_count") == 2
    assert metric(text, "vllm:cache_config_info", block_size="16", num_gpu_blocks="27000") == 1
    assert (
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"}' in text
    )
    assert (
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="7680.0",model_name="tiny"}' in text
    )


async def test_client_disconnect_mid_stream_aborts_and_frees_the_slot(sim: Sim) -> None:
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 100_000, "stream": True}
    resp = await sim.session.post(sim.base + "/v1/chat/completions", json=body)
    await resp.content.readuntil(b"\n\n")  # role chunk
    await resp.content.readuntil(b"\n\n")  # a token
    text = await sim.metrics()
    assert metric(text, "vllm:num_requests_running") == 1
    assert metric(text, "vllm:kv_cache_usage_perc") > 0
    resp.close()  # drop the connection
    for _ in range(100):
        text = await sim.metrics()
        if metric(text, "vllm:num_requests_running") == 0:
            break
        await asyncio.sleep(0.02)
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "vllm:kv_cache_usage_perc") == 0
    # vLLM 0.32 counts no finished request for a client that went away
    assert metric(text, "vllm:request_success_total", finished_reason="abort") == 0


def test_cli_starts_a_server_like_vllm_serve(processes: ProcessGroup, port: int) -> None:
    child = processes.start(
        "sim",
        [
            sys.executable,
            "-m",
            "extproc.ops.cli",
            "sim",
            "--port",
            str(port),
            "--model",
            "tiny",
            "--scheduling-policy",
            "priority",
            "--max-num-seqs",
            "1",
            "--num-gpu-blocks-override",
            "64",
            "--speedup",
            "10",
        ],
    )
    base = f"http://127.0.0.1:{port}"
    wait_http_ready(base + "/health", child)
    request = urllib.request.Request(
        base + "/v1/completions",
        method="POST",
        data=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode(),
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert json.load(resp)["usage"]["completion_tokens"] == 2
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert metric(text, "vllm:cache_config_info", num_gpu_blocks="64") == 1


async def test_fault_flags_delay_headers_and_break_metrics(tmp_path: Path) -> None:
    port = free_port()
    config = SimConfig(model="tiny", speedup=20, fault_delay_headers_s=0.4, fault_metrics="hang")
    runner = await start(config, "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 2}
    try:
        async with aiohttp.ClientSession() as session:
            loop = asyncio.get_running_loop()
            for stream in (False, True):
                started = loop.time()
                async with session.post(
                    base + "/v1/chat/completions", json={**body, "stream": stream}
                ) as resp:
                    headers_after = loop.time() - started
                    assert resp.status == 200
                    await resp.read()
                assert headers_after >= 0.38
            timeout = aiohttp.ClientTimeout(total=0.3)
            with pytest.raises(asyncio.TimeoutError):
                async with session.get(base + "/metrics", timeout=timeout) as resp:
                    await resp.read()
            async with session.get(base + "/health") as resp:
                assert resp.status == 200
    finally:
        await runner.cleanup()
    port = free_port()
    runner = await start(SimConfig(model="tiny", fault_metrics="garbage"), "127.0.0.1", port)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/metrics") as resp,
        ):
            assert resp.status == 200
            text = await resp.text(errors="replace")
        with pytest.raises(MetricsError):
            parse_metrics(text, 0.0)
    finally:
        await runner.cleanup()
    with pytest.raises(ValueError):
        SimConfig(fault_metrics="slow")


async def test_fault_no_itl_serves_the_real_page_without_the_itl_histogram() -> None:
    port = free_port()
    runner = await start(SimConfig(model="tiny", fault_metrics="no-itl"), "127.0.0.1", port)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/metrics") as resp,
        ):
            assert resp.status == 200
            text = await resp.text()
        assert "vllm:inter_token_latency_seconds" not in text
        assert "vllm:time_to_first_token_seconds_count" in text  # the rest is all there
        metrics = parse_metrics(text, 0.0)
        assert (metrics.itl_sum_s, metrics.itl_count) == (None, None)
        assert metrics.block_size is not None
    finally:
        await runner.cleanup()


async def test_api_key_guards_the_v1_paths_as_vllm_does() -> None:
    """``--api-key``: without ``Bearer KEY`` every /v1 path is 401; probes and scrapers
    (``/health``, ``/metrics``) need no key."""
    port = free_port()
    runner = await start(SimConfig(model="tiny", api_key="sk-engine-key"), "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 2}
    try:
        async with aiohttp.ClientSession() as session:
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "sk-engine-key"},
            ):
                async with session.post(
                    f"{base}/v1/chat/completions", json=chat, headers=headers
                ) as r:
                    assert (r.status, await r.json()) == (401, {"error": "Unauthorized"})
            async with session.get(f"{base}/v1/models") as r:
                assert r.status == 401
            good = {"Authorization": "Bearer sk-engine-key"}
            async with session.post(f"{base}/v1/chat/completions", json=chat, headers=good) as r:
                assert r.status == 200
            for path in ("/health", "/metrics"):
                async with session.get(base + path) as r:
                    assert r.status == 200, path
    finally:
        await runner.cleanup()


async def test_reset_prefix_cache_forgets_cached_blocks_and_waits_for_running_ones(
    sim: Sim,
) -> None:
    """vLLM's dev route: refused while a request holds blocks, then every cached block is
    forgotten (the same prompt again finds nothing), as the bench needs between arms."""
    prompt = [{"role": "user", "content": "a long shared system prompt " * 40}]
    body = {"model": "tiny", "messages": prompt, "max_tokens": 100_000, "stream": True}
    resp = await sim.session.post(sim.base + "/v1/chat/completions", json=body)
    await resp.content.readuntil(b"\n\n")  # running: it holds its blocks
    assert await sim.post("/reset_prefix_cache", b"") == (200, {"success": False})
    resp.close()
    short = {"model": "tiny", "messages": prompt, "max_tokens": 2}
    for _ in range(100):  # the abort frees the blocks within a step
        status, answer = await sim.post("/reset_prefix_cache", b"")
        if answer["success"]:
            break
        await asyncio.sleep(0.02)
    assert (status, answer) == (200, {"success": True})
    assert (await sim.post("/v1/chat/completions", short))[0] == 200
    hits = metric(await sim.metrics(), "vllm:prefix_cache_hits_total")
    assert (await sim.post("/v1/chat/completions", short))[0] == 200
    again = metric(await sim.metrics(), "vllm:prefix_cache_hits_total")
    assert again > hits  # cached: the second request found the first's blocks
    assert (await sim.post("/reset_prefix_cache", b"")) == (200, {"success": True})
    assert (await sim.post("/v1/chat/completions", short))[0] == 200
    assert metric(await sim.metrics(), "vllm:prefix_cache_hits_total") == again  # forgotten
