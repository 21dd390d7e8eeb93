"""Precise prefix routing through the real Envoy.

Two simulated engines publish their KV events (``fairlane up``'s default: each simulator
gets ``--kv-events-config``, the service ``--tokenizer builtin`` and each backend's
``kv-events``/``kv-replay`` ports). The service follows both streams; the picker matches a
prompt against the blocks each engine says it holds. What only the events can know is
tested here: blocks an engine cached for traffic that never went through this gateway,
and an engine that restarted with an empty cache.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.ops.up import Stack
from tests.exported_metrics import Samples, parse_samples
from tests.integration.conftest import (
    MODEL,
    SIM_ARGS,
    auth,
    requests_by_backend,
    start_stack,
)
from tests.polling import until

pytestmark = pytest.mark.integration

KEY = "sk-chat-demo"
MARK = "x-test-question"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    group, running = start_stack(
        tmp_path_factory.mktemp("prefix"), sim_regions=("region-a", "region-a")
    )
    try:
        yield running
    finally:
        group.stop()


def service_metrics(stack: Stack) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=5) as r:
        return parse_samples(r.read().decode())


def metric(stack: Stack, name: str, **labels: str) -> float:
    """The sum of the service's ``name`` samples whose labels include ``labels`` (0: none)."""
    wanted = set(labels.items())
    return sum(
        value
        for (sample, found), value in service_metrics(stack).items()
        if sample == name and wanted <= found
    )


def gauge(stack: Stack, name: str, backend: str) -> float:
    return metric(stack, name, backend=backend)


def conversation(system: str, question: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 2,
    }


def system_prompt(topic: str) -> str:
    """About 600 tokens (the simulator's tokenizer): a few dozen blocks of 16."""
    return f"You answer questions about {topic}. Be brief and precise. " * 60


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    """POST a chat, tagged with its question (the simulators log request headers)."""
    headers = {**auth(KEY), MARK: body["messages"][-1]["content"]}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()


def served_by(stack: Stack, question: str) -> str:
    """The backend whose simulator received the request asking ``question``."""
    for address, records in requests_by_backend(stack).items():
        if any(record["headers"].get(MARK) == question for record in records):
            return address
    raise AssertionError(f"no simulator logged the request asking {question!r}")


async def idle(stack: Stack) -> None:
    """Every backend idle as the service last saw it (nothing in flight, no KV in use), so
    prefix affinity alone decides the next pick (a load tie goes to the first backend)."""
    names = (
        "fairlane_backend_in_flight",
        "fairlane_backend_kv_cache_usage_ratio",
        "fairlane_backend_waiting",
    )
    for backend in stack.backends:
        address = backend.address
        await until(
            lambda: all(gauge(stack, n, address) == 0 for n in names),  # noqa: B023
            f"{address} idle",
            every_s=0.05,
        )


async def live(stack: Stack) -> None:
    for backend in stack.backends:
        address = backend.address
        await until(
            lambda: gauge(stack, "fairlane_backend_kv_events_live", address) == 1,  # noqa: B023
            f"{address}'s KV events followed from a known point",
            timeout_s=20,
            every_s=0.2,
        )


async def test_blocks_cached_for_traffic_elsewhere_draw_the_request(stack: Stack) -> None:
    """An engine that cached a prompt for a client that did not come through this gateway
    (another gateway, a replica, a direct caller) is where the next request with that
    prefix goes: only its events say so."""
    await live(stack)
    first, second = stack.backends
    for backend in (second, first):  # each engine, in turn, is the one that knows
        system = system_prompt(f"the fleet behind {backend.address}")
        async with aiohttp.ClientSession() as session:
            await send(session, backend.url, conversation(system, "a direct question"))
            address = backend.address
            await until(
                lambda: gauge(stack, "fairlane_backend_kv_index_blocks", address) > 0,  # noqa: B023
                f"{address}'s BlockStored events in the service's index",
                every_s=0.05,
            )
            await idle(stack)
            question = f"through the gateway to {backend.port}"
            await send(session, stack.url, conversation(system, question))
            assert served_by(stack, question) == backend.address
    assert metric(stack, "fairlane_prefix_matches_total", index="precise") >= 2
    # Each request tokenized one piece of the ~3.5 KB system prompt it had never read (its
    # budget, COLD_CHARS), and the rest waited to be read between requests: all of it is
    # read soon after, seven pieces or so per prompt.
    await until(
        lambda: metric(stack, "fairlane_prompts_read_later") == 0,
        "the prompts' unread rest read between requests",
        every_s=0.05,
    )
    assert metric(stack, "fairlane_prompt_pieces_total", cache="miss") >= 12


async def test_an_engine_restarted_empty_is_forgotten(stack: Stack) -> None:
    """A restarted engine's stream starts over at 0: the service clears what it knew of it
    (its cache is empty), so a prompt it held before no longer draws requests there."""
    await live(stack)
    first, victim = stack.backends
    system = system_prompt("restarts")
    async with aiohttp.ClientSession() as session:
        await send(session, victim.url, conversation(system, "before the restart"))
        await until(
            lambda: gauge(stack, "fairlane_backend_kv_index_blocks", victim.address) > 0,
            "the victim's blocks in the index",
        )
    stack.kill_simulator(victim.address)
    stack.restart_simulator(victim.address)
    async with aiohttp.ClientSession() as session:  # no connection kept to the dead one
        # The new engine says something only when it caches a block: prompt it until the
        # service has seen its stream start over (the first messages may be published
        # before the subscription has reconnected).
        for n in range(50):
            await send(session, victim.url, conversation(system_prompt(f"life {n}"), "hello"))
            if _restarts(stack, victim.address) >= 1:
                break
            await asyncio.sleep(0.2)
        assert _restarts(stack, victim.address) >= 1, "the restart was never seen"
        await live(stack)
        await idle(stack)
        question = "after the restart, through the gateway"
        await send(session, stack.url, conversation(system, question))
    # Nothing holds the prompt now: the pick is by load, and a load tie goes to the first
    # backend. Had the index kept the dead engine's blocks, the victim would have drawn it.
    assert served_by(stack, question) == first.address


def _restarts(stack: Stack, address: str) -> float:
    return metric(stack, "fairlane_kv_events_total", backend=address, kind="restarts")


@pytest.fixture(scope="module")
def model_stack(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> Iterator[Stack]:
    """Simulators and service with a model's own tokenizer (the tiny model's, trained
    offline), so long prompts are tokenized off the service's event loop."""
    model = tiny_tokenizer
    group, running = start_stack(
        tmp_path_factory.mktemp("prefix-model"),
        sim_regions=("region-a", "region-a"),
        sim_args=(*SIM_ARGS, "--tokenizer", str(model)),
        service_args=("--tokenizer", str(model)),
    )
    try:
        yield running
    finally:
        group.stop()


async def test_with_the_models_tokenizer_a_long_prompt_finds_its_engine(
    model_stack: Stack,
) -> None:
    """The same as above with a real tokenizer and a prompt (> 8 KiB) the engine holds
    but the service never read: one request reads only its budget of new text
    (``COLD_CHARS``), and those keys, read in pieces, still match the engine's."""
    stack = model_stack
    await live(stack)
    holder = stack.backends[1]
    system = system_prompt("long documents") * 3
    assert len(system) > 8 * 1024
    async with aiohttp.ClientSession() as session:
        await send(session, holder.url, conversation(system, "a direct question"))
        await until(
            lambda: gauge(stack, "fairlane_backend_kv_index_blocks", holder.address) > 0,
            "the holder's BlockStored events in the service's index",
        )
        await idle(stack)
        question = "through the gateway, read a piece at a time"
        await send(session, stack.url, conversation(system, question))
    assert served_by(stack, question) == holder.address
