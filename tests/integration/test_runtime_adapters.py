"""LoRA adapters loaded at run time, through the real Envoy: the policy lists an adapter no
engine holds, and the gateway loads it onto an engine of its base (vLLM's
``/v1/load_lora_adapter``) before the first request for it goes there.

Engines that cannot load (LoRA off) answer the load with an error: the client gets a 503
``adapter_unavailable`` from the gateway, and the engine never sees the request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.ops.up import Stack
from tests.integration.conftest import (
    SIM_ARGS,
    TEST_POLICY,
    auth,
    chat,
    read_request_log,
    start_stack,
)
from tests.polling import until_awaited

pytestmark = pytest.mark.integration

SIM = tuple(a for a in SIM_ARGS if a not in ("--model", "sim-model"))
BASE = ("--model", "qwen-7b")
LORA = (*BASE, "--enable-lora", "--max-loras", "2")
POLICY = (
    TEST_POLICY
    + """
models:
  adapters:
    qwen-med: {base: qwen-7b, path: /adapters/qwen-med}
"""
)


def start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *engines: tuple[str, ...]) -> Any:
    # vLLM serves /v1/load_lora_adapter only with runtime updating on; the simulators
    # read it from their environment, as vLLM does.
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    return start_stack(
        tmp_path,
        POLICY,
        sim_regions=("region-a",) * len(engines),
        sim_args=SIM,
        sim_extra_args=dict(enumerate(engines)),
    )


async def listed(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as response:
        return {card["id"]: card.get("parent") for card in (await response.json())["data"]}


async def base_read(stack: Stack) -> bool:
    """The gateway knows the engines' models: its own /v1/models lists the adapter."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{stack.url}/v1/models", headers=auth("sk-chat-demo")) as response,
    ):
        if response.status != 200:
            return False
        cards = (await response.json())["data"]
    return {"qwen-7b", "qwen-med"} <= {card["id"] for card in cards}


async def ask(stack: Stack, n: int) -> list[tuple[int, Any]]:
    answers = []
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            async with session.post(
                f"{stack.url}/v1/chat/completions",
                json=chat(model="qwen-med"),
                headers=auth("sk-chat-demo"),
            ) as response:
                body = await response.json()
                answers.append((response.status, body.get("model") or body.get("error")))
    return answers


async def test_an_adapter_no_engine_holds_is_loaded_then_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    group, stack = start(tmp_path, monkeypatch, LORA, LORA)
    with group:
        await until_awaited(lambda: base_read(stack), "the engines' models read", 15.0)
        assert await ask(stack, 6) == [(200, "qwen-med")] * 6
        holders = {b.address for b in stack.backends if "qwen-med" in await listed(b.url)}
        assert holders  # loaded where it ran, and nowhere it did not
        for address, log in stack.request_logs.items():
            ran = {record.get("model") for record in read_request_log(log)}
            assert ran <= {"qwen-med"}, (address, ran)
            assert bool(ran) == (address in holders), (address, ran, holders)


async def test_an_engine_that_cannot_load_answers_nothing_and_the_client_gets_a_503(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    group, stack = start(tmp_path, monkeypatch, BASE)  # LoRA is off on this engine
    with group:
        await until_awaited(lambda: base_read(stack), "the engine's models read", 15.0)
        [(status, error)] = await ask(stack, 1)
        assert (status, error["code"]) == (503, "adapter_unavailable")
        assert "LoRA is not enabled" in error["message"]
        for log in stack.request_logs.values():
            assert read_request_log(log) == []
        # and the service keeps serving the base model
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{stack.url}/v1/chat/completions",
                json=chat(model="qwen-7b"),
                headers=auth("sk-chat-demo"),
            ) as response,
        ):
            assert response.status == 200
