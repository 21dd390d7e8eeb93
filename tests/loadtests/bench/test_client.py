"""The load generator (``loadtests.bench.client``): where each group's requests go. Real HTTP
on loopback; the receiving servers only count and answer as an OpenAI server would."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import web

from loadtests.bench.client import LoadRun
from loadtests.bench.scenario import SCENARIO_DIR, parse_scenario
from loadtests.bench.scenario.model import Scenario


def scenario(tmp_path: Path) -> Scenario:
    group: dict[str, object] = {"api_key": "sk-chat-demo", "tenant": "chat-app"}
    group |= {"tier": "interactive", "concurrency": 1, "prompt_tokens": 8, "max_tokens": 4}
    data = {
        "name": "t",
        "duration_s": 4,
        "warmup_s": 0,
        "drain_s": 2,
        "speedup": 1,
        "policy": str(SCENARIO_DIR / "policies" / "bench-x20.yaml"),
        "groups": [
            {"name": "through", "user": "through", **group},
            {"name": "around", "user": "around", "direct": True, **group},
        ],
        "arms": [{"name": "fifo", "kind": "fifo"}, {"name": "fairlane", "kind": "fairlane"}],
    }
    return parse_scenario(data, tmp_path / "t.yaml")


async def _serve(hits: Counter[tuple[str, str]], name: str) -> tuple[web.AppRunner, str]:
    async def chat(request: web.Request) -> web.StreamResponse:
        hits[(name, request.headers["x-user-id"])] += 1
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"choices": [{"message": {"content": "ok"}}]})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"delta": {"content": "ok"}}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_a_direct_group_goes_to_the_backends_in_turn_and_the_others_through_the_gateway(
    tmp_path: Path,
) -> None:
    hits: Counter[tuple[str, str]] = Counter()

    async def run() -> None:
        servers = [await _serve(hits, name) for name in ("gateway", "engine-0", "engine-1")]
        try:
            (_, gateway), *engines = servers
            spec = scenario(tmp_path)
            load = LoadRun(
                spec, "fairlane", spec.groups, gateway, backend_urls=tuple(u for _, u in engines)
            )
            await load.run()
        finally:
            for runner, _ in servers:
                await runner.cleanup()

    asyncio.run(run())
    through, around = "through", "around"
    assert hits[("gateway", through)] > 0 and hits[("gateway", around)] == 0
    assert hits[("engine-0", through)] == hits[("engine-1", through)] == 0
    assert hits[("engine-0", around)] > 0 and hits[("engine-1", around)] > 0
    assert abs(hits[("engine-0", around)] - hits[("engine-1", around)]) <= 1


def test_a_direct_group_without_backends_is_refused(tmp_path: Path) -> None:
    spec = scenario(tmp_path)
    with pytest.raises(ValueError, match="direct group"):
        LoadRun(spec, "fairlane", spec.groups, "http://127.0.0.1:9")
