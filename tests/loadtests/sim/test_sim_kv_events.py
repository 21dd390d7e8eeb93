"""``--kv-events-config``: the simulator's KV events, in vLLM 0.32's bytes, with the hashes
the gateway computes, from the engine loop to a subscriber over ZMQ."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest

from extproc.core.blockhash import BlockHasher
from extproc.core.prompt import render_chat, tokenize
from extproc.fleet.kv_subscriber import KVEventSubscriber
from extproc.ops.processes import ProcessGroup, free_port, wait_http_ready
from loadtests.sim.blocks import BlockPool, block_hashes, engine_hasher
from loadtests.sim.engine import Engine, EngineConfig, EngineRequest
from loadtests.sim.kv_events import ALL_BLOCKS_CLEARED, block_removed, block_stored, encode_batch
from loadtests.sim.kv_publisher import KVEventsConfig, is_bind_endpoint
from loadtests.sim.profiles import get_profile
from loadtests.sim.server import SimConfig, start
from tests.polling import until

# vLLM 0.32's own encoding (msgspec, vllm.distributed.kv_events) of
# KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
#   BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=[1, 2],
#     block_size=2, lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None],
#     group_idx=0, kv_cache_spec_kind="full_attention"),
#   BlockRemoved(block_hashes=[5], medium="GPU", group_idx=0), AllBlocksCleared()])
VLLM_BATCH = bytes.fromhex(
    "93cb3ff8000000000000938ba474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "739201cfffffffffffffffffb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473"
    "920102aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f"
    "6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69647800b26b765f63616368655f73"
    "7065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f7665"
    "64ac626c6f636b5f6861736865739105a66d656469756da3475055a967726f75705f6964780081a474"
    "797065b0416c6c426c6f636b73436c656172656400"
)
CHAT = [{"role": "user", "content": "Summarise the gateway's design in a few words. " * 6}]


def test_a_batch_is_byte_for_byte_what_vllm_encodes() -> None:
    events = [block_stored([1, 2**64 - 1], None, [1, 2], 2), block_removed(5), ALL_BLOCKS_CLEARED]
    assert encode_batch(1.5, events) == VLLM_BATCH


def test_the_config_is_vllms_json() -> None:
    config = KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "", "buffer_steps": 10000}'
    )
    assert config.publishes and config.replay_endpoint == "tcp://*:5558"
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert not KVEventsConfig.parse('{"endpoint": "tcp://*:1"}').publishes  # vLLM's "null"
    for bad in ('{"enable_kv_cache_events": 1}', '{"endpoint": 5}', '{"port": 5}', "[]", "{"):
        with pytest.raises(ValueError):
            KVEventsConfig.parse(bad)
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("ipc:///tmp/kv")
    assert not is_bind_endpoint("tcp://127.0.0.1:5557")  # vLLM connects; the subscriber binds


def test_the_hash_chain_follows_the_algorithm_and_pythonhashseed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens = list(range(40))
    assert block_hashes(tokens, 16) == BlockHasher().chain(tokens, 16)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    hasher = engine_hasher("sha256_cbor")
    assert block_hashes(tokens, 16, hasher) == BlockHasher("sha256_cbor", "0").chain(tokens, 16)
    # a long prompt is hashed to its end (the gateway's own limit is for its lookups only)
    assert len(block_hashes([7] * 16 * 3000, 16)) == 3000


def engine_with_events(num_gpu_blocks: int = 64) -> Engine:
    engine = Engine(
        EngineConfig(profile=get_profile("llama-8b-h100"), num_gpu_blocks=num_gpu_blocks)
    )
    engine.pool.record_events()
    return engine


def request(name: str, tokens: list[int]) -> EngineRequest:
    return EngineRequest(
        request_id=name,
        prompt_len=len(tokens),
        block_hashes=block_hashes(tokens, 16),
        max_tokens=1,
        output_len=1,
        token_ids=tokens,
    )


def run(engine: Engine) -> list[list[dict[str, object]]]:
    """Every step's events, one list per step that had some (what the server publishes)."""
    batches = []
    now = 0.0
    while engine.has_work:
        now = engine.step(now).end
        events = engine.pool.take_events()
        if events:
            batches.append(events)
    return batches


def test_a_requests_full_blocks_are_stored_with_the_gateways_keys() -> None:
    tokens = list(range(1000, 1040))  # two full blocks and a partial one
    engine = engine_with_events()
    engine.add(request("a", tokens), 0.0)
    (batch,) = run(engine)
    keys = BlockHasher().keys(tokens, 16)
    assert batch == [block_stored(keys, None, tokens[:32], 16)]


def test_chunked_prefill_stores_blocks_as_they_fill_chained_to_their_parent() -> None:
    tokens = list(range(2000, 2064))
    engine = Engine(EngineConfig(profile=get_profile("llama-8b-h100"), max_num_batched_tokens=40))
    engine.pool.record_events()
    engine.add(request("a", tokens), 0.0)
    batches = run(engine)
    keys = BlockHasher().keys(tokens, 16)
    # the first step computes 40 tokens: two full blocks; the second the other two
    assert batches == [
        [block_stored(keys[:2], None, tokens[:32], 16)],
        [block_stored(keys[2:4], keys[1], tokens[32:64], 16)],
    ]


def test_eviction_removes_blocks_and_a_reset_clears_them() -> None:
    engine = engine_with_events(num_gpu_blocks=4)
    first = list(range(3000, 3048))  # 3 blocks
    engine.add(request("a", first), 0.0)
    run(engine)
    engine.add(request("b", list(range(4000, 4048))), 1.0)
    batches = run(engine)
    removed = [e for batch in batches for e in batch if e["type"] == "BlockRemoved"]
    # one free block was never used; the other two come from "a", tail first
    keys = BlockHasher().keys(first, 16)
    assert removed == [block_removed(keys[2]), block_removed(keys[1])]
    assert engine.pool.reset()
    assert engine.pool.take_events() == [ALL_BLOCKS_CLEARED]


def test_a_reset_is_refused_while_a_request_holds_blocks() -> None:
    pool = BlockPool(4, 16)
    pool.record_events()
    held = pool.allocate(1)
    assert held is not None
    pool.cache(held[0], b"h")
    assert not pool.reset()
    assert pool.take_events() == [] and pool.cached_prefix([b"h"]) == held


@dataclass
class Endpoints:
    pub: int
    replay: int

    def config_json(self) -> str:
        return json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.pub}",
                "replay_endpoint": f"tcp://*:{self.replay}",
                "topic": "",
                "buffer_steps": 10000,
            }
        )

    def subscriber(self) -> KVEventSubscriber:
        return KVEventSubscriber(
            f"tcp://127.0.0.1:{self.pub}", replay_endpoint=f"tcp://127.0.0.1:{self.replay}"
        )


@pytest.fixture
def endpoints() -> Endpoints:
    return Endpoints(free_port(), free_port())


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def chat(session: aiohttp.ClientSession, base: str, messages: object) -> None:
    body = {"model": "tiny", "messages": messages, "max_tokens": 2}
    async with session.post(base + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


def prompt_keys(messages: list[dict[str, str]]) -> list[int]:
    return BlockHasher().keys(tokenize(render_chat(messages)), 16)


async def test_the_server_publishes_each_steps_events_to_a_subscriber(
    endpoints: Endpoints, session: aiohttp.ClientSession
) -> None:
    port = free_port()
    config = SimConfig(
        model="tiny",
        speedup=20,
        num_gpu_blocks=32,
        kv_events_config=KVEventsConfig.parse(endpoints.config_json()),
    )
    runner = await start(config, "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    try:
        async with endpoints.subscriber() as sub:
            await until(lambda: sub.index.live, "the subscriber follows the engine")
            await chat(session, base, CHAT)
            keys = prompt_keys(CHAT)
            assert len(keys) >= 3
            await until(lambda: sub.index.match(keys, 0.0) == len(keys), "the prompt's blocks")
            # other prompts fill the 32 blocks and evict the first one's
            for n in range(12):
                await chat(session, base, [{"role": "user", "content": f"{n} other " * 70}])
            await until(lambda: sub.index.match(keys, 0.0) == 0, "the first prompt evicted")
            assert sub.index.live and sub.gaps_lost == 0 and sub.decode_errors == 0
            assert len(sub.index) <= 32
    finally:
        await runner.cleanup()


async def test_fairlane_sim_with_kv_events_config_feeds_the_gateways_index(
    processes: ProcessGroup, endpoints: Endpoints, session: aiohttp.ClientSession
) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "extproc.ops.cli", "sim", "--port", str(port)]
    argv += ["--model", "tiny", "--speedup", "10", "--kv-events-config", endpoints.config_json()]
    child = processes.start("sim", argv)
    base = f"http://127.0.0.1:{port}"
    wait_http_ready(base + "/health", child)
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        assert 'prefix_caching_hash_algo="sha256"' in resp.read().decode()
    async with endpoints.subscriber() as sub:
        await until(lambda: sub.index.live, "the subscriber follows the engine")
        await chat(session, base, CHAT)
        keys = prompt_keys(CHAT)
        await until(lambda: sub.index.match(keys, 0.0) == len(keys), "the prompt's block keys")
    assert "KV events on tcp://127.0.0.1:" in child.log_tail()  # tcp://* binds on --host
