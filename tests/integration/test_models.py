"""Several models behind one gateway, through the real Envoy: two simulated engines that
serve different models (one with an alias), requests alternating between them.

Every request reaches an engine that serves its model (none gets the engine's 404), an
unknown model is answered 404 by the gateway, and ``GET /v1/models`` lists the fleet's.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.ops.processes import ProcessGroup
from extproc.ops.up import Stack
from tests.exported_metrics import parse_samples
from tests.integration.conftest import SIM_ARGS, auth, chat, read_request_log, start_stack
from tests.polling import until_awaited

pytestmark = pytest.mark.integration

SIM = tuple(a for a in SIM_ARGS if a not in ("--model", "sim-model"))
MODELS = {
    0: ("--model", "llama-70b", "--served-model-name", "llama-70b", "llama"),
    1: ("--model", "qwen-7b"),
}


@pytest.fixture
def two_models(tmp_path: Path) -> Any:
    group, stack = start_stack(
        tmp_path, sim_regions=("region-a", "region-a"), sim_args=SIM, sim_extra_args=MODELS
    )
    with group:
        yield group, stack


async def models_read(stack: Stack) -> bool:
    """The service has read both engines' /v1/models (``fairlane_backend_model``)."""
    return await models_read_at(f"http://127.0.0.1:{stack.metrics_port}/metrics")


async def models_read_at(url: str) -> bool:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        samples = parse_samples(await response.text())
    return {labels.get("model") for (name, labels) in _labelled(samples)} >= {
        "llama",
        "llama-70b",
        "qwen-7b",
    }


def _labelled(samples: Any) -> list[tuple[str, dict[str, str]]]:
    return [(name, dict(labels)) for (name, labels) in samples if name == "fairlane_backend_model"]


async def test_each_request_reaches_an_engine_that_serves_its_model(
    two_models: tuple[ProcessGroup, Stack],
) -> None:
    _, stack = two_models
    await until_awaited(lambda: models_read(stack), "the engines' models read", 15.0)
    statuses: dict[str, list[int]] = {"llama": [], "qwen-7b": []}
    async with aiohttp.ClientSession() as session:
        for i in range(40):
            model = "llama" if i % 2 else "qwen-7b"
            async with session.post(
                f"{stack.url}/v1/chat/completions",
                json=chat(model=model),
                headers=auth("sk-chat-demo"),
            ) as response:
                statuses[model].append(response.status)
                body = await response.json()
                if response.status == 200:
                    assert body["model"] == model
        async with session.post(
            f"{stack.url}/v1/chat/completions",
            json=chat(model="gpt-5"),
            headers=auth("sk-chat-demo"),
        ) as response:
            unknown = (response.status, (await response.json())["error"]["code"])
        async with session.get(f"{stack.url}/v1/models", headers=auth("sk-chat-demo")) as response:
            listed = {card["id"] for card in (await response.json())["data"]}
    assert statuses == {"llama": [200] * 20, "qwen-7b": [200] * 20}
    assert unknown == (404, "model_not_found")
    assert listed == {"llama", "llama-70b", "qwen-7b"}
    # and the engines saw only their own model
    for address, log in stack.request_logs.items():
        seen = {record.get("model") for record in read_request_log(log)}
        assert seen in ({"llama"}, {"qwen-7b"}), (address, seen)


@pytest.fixture
def two_models_two_replicas(tmp_path: Path) -> Any:
    group, stack = start_stack(
        tmp_path,
        sim_regions=("region-a", "region-a"),
        sim_args=SIM,
        sim_extra_args=MODELS,
        replicas=2,
    )
    with group:
        yield group, stack


async def test_replicas_route_by_model_too(
    two_models_two_replicas: tuple[ProcessGroup, Stack],
) -> None:
    _, stack = two_models_two_replicas
    for process in stack.service_processes:  # each replica reads the engines' models
        await until_awaited(partial(models_read_at, process.metrics_url), "its models", 15.0)
    statuses = []
    async with aiohttp.ClientSession() as session:
        for i in range(20):
            model = "llama" if i % 2 else "qwen-7b"
            key = "sk-chat-demo" if i % 4 < 2 else "sk-batch-demo"  # both replicas get some
            async with session.post(
                f"{stack.url}/v1/chat/completions", json=chat(model=model), headers=auth(key)
            ) as response:
                statuses.append(response.status)
    assert statuses == [200] * 20
    for address, log in stack.request_logs.items():
        seen = {record.get("model") for record in read_request_log(log)}
        assert seen in ({"llama"}, {"qwen-7b"}), (address, seen)
