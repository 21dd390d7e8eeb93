"""LoRA adapters in the simulator, as vLLM 0.32 serves them: the engine's adapter limit and
slot loads on a virtual clock, the metric, the hashes, and the HTTP side over loopback."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import pickle
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from extproc.core.blockhash import BlockHasher
from extproc.fleet.kv_events import event_key
from extproc.ops.processes import free_port
from loadtests.sim.blocks import BlockPool, block_hashes
from loadtests.sim.cli import add_arguments, config_from_args
from loadtests.sim.cli import run as cli_run
from loadtests.sim.engine import Engine, EngineConfig, EngineRequest, Policy, StepOutput
from loadtests.sim.fastforward import decode_run
from loadtests.sim.kv_events import block_stored
from loadtests.sim.lora import (
    LoraModule,
    LoraRegistry,
    parse_load_body,
    parse_lora_module,
    runtime_updating_from_env,
)
from loadtests.sim.metrics import SimMetrics, cache_config_labels
from loadtests.sim.profiles import get_profile
from loadtests.sim.request import ApiError, parse_generate
from loadtests.sim.server import SimConfig, start

CHAT = [{"role": "user", "content": "Tell me a story about a gateway."}]
LOAD_S = 0.05
_ids = itertools.count()


# ------------------------------------------------------------------ engine, virtual clock


def make_engine(max_loras: int = 1, **kw: Any) -> Engine:
    config = EngineConfig(
        profile=get_profile("llama-8b-h100"), max_loras=max_loras, lora_load_s=LOAD_S, **kw
    )
    return Engine(config)


def make_req(lora: str | None, tokens: int = 40, max_tokens: int = 6) -> EngineRequest:
    start = next(_ids) * 100_000
    ids = list(range(start, start + tokens))
    lora_id = {"a": 1, "b": 2, "c": 3}.get(lora or "", 0)
    return EngineRequest(
        request_id=f"r{next(_ids)}",
        prompt_len=tokens,
        block_hashes=block_hashes(ids, 16, lora=None if lora is None else (lora, f"/ad/{lora}")),
        max_tokens=max_tokens,
        output_len=max_tokens,
        lora_id=lora_id,
        lora_name=lora,
    )


def run(engine: Engine, now: float = 0.0, on_step: Any = None) -> list[StepOutput]:
    steps: list[StepOutput] = []
    while engine.has_work and len(steps) < 10_000:
        out = engine.step(now)
        if on_step is not None:
            on_step(out)
        now = out.end
        steps.append(out)
    return steps


def test_with_max_loras_1_a_second_adapter_waits_for_the_first_to_finish() -> None:
    engine = make_engine(max_loras=1)
    a, b, base = make_req("a"), make_req("b"), make_req(None)
    for i, req in enumerate((a, b, base)):
        engine.add(req, i * 1e-6)
    first = engine.step(0.0)
    # b is skipped (deferred) and admission goes on behind it: the base request runs with a
    assert engine.running == [a, base] and list(engine.waiting) == [b]
    assert engine.deferred == {b} and engine.num_deferred == 1
    assert first.num_lora_loads == 1
    run(engine, first.end)
    assert a.finished_at is not None and b.scheduled_at is not None
    assert b.scheduled_at >= a.finished_at  # on the simulated clock
    assert base.scheduled_at == 0.0  # admitted behind the deferred b, in the first step
    assert engine.num_deferred == 0 and not engine.waiting


def test_two_slots_run_two_adapters_together_and_a_third_waits() -> None:
    engine = make_engine(max_loras=2)
    a, b, c = make_req("a"), make_req("b"), make_req("c")
    for req in (a, b, c):
        engine.add(req, 0.0)
    out = engine.step(0.0)
    assert engine.running == [a, b] and engine.deferred == {c}
    assert out.num_lora_loads == 2
    run(engine, out.end)
    assert c.scheduled_at is not None and a.finished_at is not None
    assert c.scheduled_at >= min(a.finished_at, b.finished_at or 0.0)


def test_more_requests_of_a_running_adapter_join_its_batch() -> None:
    engine = make_engine(max_loras=1)
    reqs = [make_req("a") for _ in range(3)]
    for req in reqs:
        engine.add(req, 0.0)
    out = engine.step(0.0)
    assert engine.running == reqs and not engine.deferred and out.num_lora_loads == 1


def test_deferred_requests_keep_their_order_under_both_policies() -> None:
    for policy in (Policy.FCFS, Policy.PRIORITY):
        engine = make_engine(max_loras=1, policy=policy)
        a, b1, b2 = make_req("a"), make_req("b"), make_req("b")
        for i, req in enumerate((a, b1, b2)):
            engine.add(req, i * 1e-6)
        engine.step(0.0)
        assert list(engine.waiting) == [b1, b2] and engine.deferred == {b1, b2}


def test_loading_an_adapter_into_a_slot_costs_engine_time_once() -> None:
    engine = make_engine(max_loras=1)
    a = make_req("a", max_tokens=2)
    engine.add(a, 0.0)
    first = engine.step(0.0)
    profile = engine.profile
    assert first.num_lora_loads == 1
    assert first.duration == pytest.approx(profile.step_seconds(40, 0, 0) + LOAD_S)
    run(engine, first.end)
    again = make_req("a", max_tokens=2)
    engine.add(again, 1.0)
    assert engine.step(1.0).num_lora_loads == 0  # still in its slot
    run(engine, 2.0)
    other = make_req("b", max_tokens=2)
    engine.add(other, 3.0)
    assert engine.step(3.0).num_lora_loads == 1  # evicts a
    assert list(engine.lora_slots) == [2]


def test_a_runtime_load_takes_a_slot_and_the_fast_forward_waits_for_the_reload() -> None:
    engine = make_engine(max_loras=1)
    a = make_req("a", max_tokens=50)
    engine.add(a, 0.0)
    now = 0.0
    for _ in range(3):  # prefill, then decodes
        now = engine.step(now).end
    assert decode_run(engine) is not None
    assert engine.activate_lora(2)  # /v1/load_lora_adapter of b evicts a, between steps
    assert not engine.loras_resident() and decode_run(engine) is None
    out = engine.step(now)
    assert out.num_lora_loads == 1 and list(engine.lora_slots) == [1]
    assert decode_run(engine) is not None


def test_an_aborted_deferred_request_leaves_the_deferred_set() -> None:
    engine = make_engine(max_loras=1)
    a, b = make_req("a"), make_req("b")
    engine.add(a, 0.0)
    engine.add(b, 0.0)
    engine.step(0.0)
    assert engine.abort(b, 0.1)
    assert engine.num_deferred == 0 and not engine.waiting


def test_without_lora_an_engine_ignores_nothing_and_defers_nothing() -> None:
    engine = make_engine(max_loras=0)
    reqs = [make_req(None) for _ in range(2)]
    for req in reqs:
        engine.add(req, 0.0)
    out = engine.step(0.0)
    assert engine.running == reqs and out.num_lora_loads == 0 and not engine.lora_slots


# ------------------------------------------------------------------ the metric


def lora_series(text: str) -> dict[tuple[str, str, str], float]:
    pattern = (
        r'^vllm:lora_requests_info\{max_lora="(\d+)",running_lora_adapters="([^"]*)",'
        r'waiting_lora_adapters="([^"]*)"\} (\S+)$'
    )
    return {m[:3]: float(m[3]) for m in re.findall(pattern, text, re.M)}


def test_lora_requests_info_is_set_as_vllm_0_32_sets_it() -> None:
    engine = make_engine(max_loras=1)
    ticks = itertools.count(1000)
    metrics = SimMetrics(
        engine, "tiny", cache_config_labels(engine), clock=lambda: float(next(ticks))
    )
    a, b = make_req("a", max_tokens=3), make_req("b", max_tokens=3)
    engine.add(a, 0.0)
    engine.add(b, 0.0)
    seen: list[str] = []

    def on_step(out: StepOutput) -> None:
        metrics.on_step(out)
        newest = max(lora_series(metrics.exposition().decode()).items(), key=lambda kv: kv[1])
        seen.append(newest[0][1])

    run(engine, on_step=on_step)
    text = metrics.exposition().decode()
    assert "# TYPE vllm:lora_requests_info gauge" in text
    assert "# HELP vllm:lora_requests_info Running stats on lora requests." in text
    series = lora_series(text)
    # One series per label set ever current; running and waiting are the same list, an
    # adapter listed from its first token to its last request's end; a reader takes the
    # series with the newest time.
    assert set(series) == {("1", "a", "a"), ("1", "", ""), ("1", "b", "b")}
    assert series[("1", "b", "b")] < series[("1", "", "")] == max(series.values())
    assert seen[0] == "a" and seen[-1] == "" and "b" in seen
    assert seen.index("b") > seen.index("a")
    # b waited for a's slot: vLLM counts it as deferred, not waiting for capacity
    assert 'reason="deferred"} 0.0' in text


def test_the_waiting_reasons_split_deferred_from_capacity() -> None:
    engine = make_engine(max_loras=1, max_num_seqs=2)
    metrics = SimMetrics(engine, "tiny", cache_config_labels(engine))
    for req in (make_req("a"), make_req("b"), make_req(None), make_req(None)):
        engine.add(req, 0.0)
    engine.step(0.0)  # a and one base request run; b is deferred; the other waits for a seat
    text = metrics.exposition().decode()

    def gauge(name: str) -> float:
        return float(re.findall(rf"^{re.escape(name)} (\S+)$", text, re.M)[0])

    lv = 'engine="0",model_name="tiny"'
    assert gauge(f"vllm:num_requests_waiting{{{lv}}}") == 2
    assert gauge(f'vllm:num_requests_waiting_by_reason{{{lv},reason="capacity"}}') == 1
    assert gauge(f'vllm:num_requests_waiting_by_reason{{{lv},reason="deferred"}}') == 1


def test_without_lora_there_is_no_lora_metric() -> None:
    engine = make_engine(max_loras=0)
    metrics = SimMetrics(engine, "tiny", cache_config_labels(engine))
    assert b"lora_requests_info" not in metrics.exposition()


# ------------------------------------------------------------------ hashes and KV events


def _vllm_chain(tokens: list[int], extras: list[Any]) -> list[bytes]:
    parent = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL))
    digest = parent.digest()
    out = []
    for k, extra in enumerate(extras):
        item = (digest, tuple(tokens[k * 16 : (k + 1) * 16]), extra)
        digest = hashlib.sha256(pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(digest)
    return out


def test_a_lora_requests_blocks_carry_vllms_lora_extra_key() -> None:
    tokens = list(range(40))
    hasher = BlockHasher()  # NONE_HASH seeded with "vllm-none-hash", as vLLM's sha256
    lora = ("a", "/ad/a")
    key = ("lora", "a", "/ad/a")
    own = block_hashes(tokens, 16, hasher, lora=lora)
    assert own == _vllm_chain(tokens, [(key,), (key,)])
    salted = block_hashes(tokens, 16, hasher, "s", lora=lora)
    assert salted == _vllm_chain(tokens, [(key, ("cache_salt", "s")), (key,)])
    plain = block_hashes(tokens, 16, hasher)
    assert plain == _vllm_chain(tokens, [None, None])
    assert not set(plain) & set(own)
    assert not set(own) & set(block_hashes(tokens, 16, hasher, lora=("a", "/other")))


def test_a_lora_requests_block_stored_names_its_adapter() -> None:
    pool = BlockPool(8, 16)
    pool.record_events()
    tokens = list(range(32))
    hashes = block_hashes(tokens, 16, lora=("a", "/ad/a"), cache_salt="s")
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.cache_full(blocks, hashes, 0, 2, tokens, "s", 7, "a")
    keys = [event_key(h) for h in hashes]
    assert pool.take_events() == [
        block_stored(keys, None, tokens, 16, [["a", "s"], ["a"]], lora_id=7, lora_name="a")
    ]


def test_an_engine_caches_an_adapters_prompt_apart_from_the_base_models() -> None:
    engine = make_engine(max_loras=1)
    tokens = list(range(64))

    def req(lora: tuple[str, str] | None) -> EngineRequest:
        return EngineRequest(
            request_id=f"r{next(_ids)}",
            prompt_len=64,
            block_hashes=block_hashes(tokens, 16, lora=lora),
            max_tokens=1,
            output_len=1,
            lora_id=1 if lora else 0,
            lora_name=lora[0] if lora else None,
        )

    hits = []
    now = 0.0
    for lora in (None, ("a", "/ad/a"), ("a", "/ad/a")):
        engine.add(req(lora), now)
        out = engine.step(now)  # the whole prompt and its one token
        hits.append(out.prefix_hits)
        now = out.end
        assert not engine.has_work
    # the adapter finds nothing of the base model's, then its own blocks (the last token is
    # always computed)
    assert hits == [0, 0, 48]


# ------------------------------------------------------------------ flags and bodies


def parse_flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_lora_flags_are_vllms() -> None:
    args = parse_flags(
        "--model",
        "tiny",
        "--enable-lora",
        "--lora-modules",
        "a=/ad/a",
        '{"name": "b", "path": "/ad/b", "base_model_name": "tiny"}',
        "--max-loras",
        "2",
        "--max-lora-rank",
        "64",
        "--max-cpu-loras",
        "4",
        "--lora-load-ms",
        "20",
    )
    config = config_from_args(args)
    assert config.lora_modules == (LoraModule("a", "/ad/a"), LoraModule("b", "/ad/b", "tiny"))
    engine = config.engine_config()
    assert (engine.max_loras, engine.lora_load_s) == (2, 0.02)
    assert config_from_args(parse_flags("--model", "tiny")).engine_config().max_loras == 0
    with pytest.raises(SystemExit):
        parse_flags("--max-lora-rank", "7")
    with pytest.raises(SystemExit):
        parse_flags("--lora-modules", "{not json")
    with pytest.raises(ValueError, match="--enable-lora"):
        config_from_args(parse_flags("--lora-modules", "a=/ad/a"))
    with pytest.raises(ValueError, match="max_cpu_loras"):
        SimConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_the_cli_refuses_what_vllm_refuses_at_start_up(capsys: pytest.CaptureFixture[str]) -> None:
    port = str(free_port())
    assert cli_run(parse_flags("--port", port, "--lora-modules", "a=/ad/a")) == 2
    assert "--enable-lora" in capsys.readouterr().err
    flags = ("--port", port, "--model", "tiny", "--enable-lora", "--lora-modules", "tiny=/p")
    assert cli_run(parse_flags(*flags)) == 2
    assert "conflicts with a served base model" in capsys.readouterr().err


def test_lora_modules_items_and_the_runtime_flag() -> None:
    assert parse_lora_module("x=/a=b") == LoraModule("x", "/a=b")
    assert parse_lora_module('{"name": "x", "path": "/p"}') == LoraModule("x", "/p")
    for bad in ('{"name": "x"}', '{"name": "x", "path": "/p", "rank": 8}', "[1]", "{"):
        with pytest.raises(ValueError):
            parse_lora_module(bad)
    env = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
    assert runtime_updating_from_env({env: " True "}) and runtime_updating_from_env({env: "1"})
    assert not runtime_updating_from_env({env: "yes"}) and not runtime_updating_from_env({})


def test_the_registry_checks_loads_as_vllm_does() -> None:
    registry = LoraRegistry(("tiny", "alias"))
    a = registry.load("a", "/ad/a")
    b = registry.load("b", "/ad/b", base_model_name="alias")
    c = registry.load("c", "/ad/c", base_model_name="not-served")
    assert [(x.lora_id, x.parent) for x in (a, b, c)] == [(1, "tiny"), (2, "alias"), (3, "tiny")]
    with pytest.raises(ApiError, match="has already been loaded"):
        registry.load("a", "/ad/a2")
    moved = registry.load("a", "/ad/a2", load_inplace=True)
    assert moved.lora_id == 1 and list(registry.adapters) == ["a", "b", "c"]
    with pytest.raises(ApiError, match="conflicts with a served base model"):
        registry.load("alias", "/p")
    with pytest.raises(ApiError, match="must be provided"):
        registry.load("d", "")
    registry.unload("b")
    assert registry.load("b", "/ad/b").lora_id == 4  # a new load, a new id
    with pytest.raises(ApiError) as err:
        registry.unload("zz")
    assert err.value.status == 404 and err.value.err_type == "NotFoundError"


def test_a_load_body_is_validated_as_pydantic_would() -> None:
    assert parse_load_body({"lora_name": "a", "lora_path": "/p", "load_inplace": "true"}) == (
        "a",
        "/p",
        True,
    )
    with pytest.raises(ApiError) as err:
        parse_load_body({"lora_name": 5})
    assert err.value.err_type == "Bad Request" and err.value.param == "body.lora_name"
    assert err.value.message.startswith("2 validation errors:")
    assert "'type': 'missing', 'loc': 'body.lora_path'" in err.value.message


def test_a_request_names_a_served_model_or_an_adapter() -> None:
    def model_of(body: dict[str, Any]) -> tuple[str, str | None]:
        gen = parse_generate(False, {"prompt": "hi", **body}, {}, ("tiny",), 512, 0, None, {"a"})
        return gen.model, gen.lora_name

    assert model_of({"model": "a"}) == ("a", "a")
    assert model_of({"model": "tiny"}) == ("tiny", None)
    assert model_of({}) == ("tiny", None)
    assert model_of({"model": ""}) == ("tiny", None)  # vLLM: no model is the served one
    with pytest.raises(ApiError) as err:
        model_of({"model": "b"})
    assert err.value.status == 404 and err.value.message.endswith("Valid aliases: tiny.")


# ------------------------------------------------------------------ over loopback


@dataclass
class Sim:
    base: str
    session: aiohttp.ClientSession

    async def post(self, path: str, body: Any) -> tuple[int, Any, str]:
        async with self.session.post(self.base + path, json=body) as resp:
            text = await resp.text()
            ctype = resp.headers.get("Content-Type", "")
            return resp.status, json.loads(text) if "json" in ctype else text, ctype

    async def get(self, path: str) -> Any:
        async with self.session.get(self.base + path) as resp:
            assert resp.status == 200
            return await resp.json() if path.startswith("/v1") else await resp.text()


@pytest.fixture
async def lora_sim() -> AsyncIterator[Sim]:
    port = free_port()
    config = SimConfig(
        model="tiny",
        served_model_names=("tiny", "tiny-chat"),
        speedup=50,
        seed=3,
        enable_lora=True,
        lora_modules=(
            LoraModule("sql", "/adapters/sql"),
            LoraModule("chat", "/adapters/chat", base_model_name="tiny-chat"),
        ),
        max_loras=1,
        runtime_lora_updating=True,
    )
    runner = await start(config, "127.0.0.1", port)
    try:
        async with aiohttp.ClientSession() as session:
            yield Sim(f"http://127.0.0.1:{port}", session)
    finally:
        await runner.cleanup()


async def test_models_lists_the_served_names_then_the_adapters(lora_sim: Sim) -> None:
    body = await lora_sim.get("/v1/models")
    cards = [{k: m[k] for k in ("id", "root", "parent", "max_model_len")} for m in body["data"]]
    assert cards == [
        {"id": "tiny", "root": "tiny", "parent": None, "max_model_len": 131072},
        {"id": "tiny-chat", "root": "tiny", "parent": None, "max_model_len": 131072},
        {"id": "sql", "root": "/adapters/sql", "parent": "tiny", "max_model_len": None},
        {"id": "chat", "root": "/adapters/chat", "parent": "tiny-chat", "max_model_len": None},
    ]
    card = body["data"][2]
    assert list(card) == [
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "permission",
    ]
    assert card["object"] == "model" and card["owned_by"] == "vllm"
    assert card["permission"][0]["object"] == "model_permission"


async def test_a_request_to_an_adapter_is_served_and_an_unknown_model_is_a_404(
    lora_sim: Sim,
) -> None:
    chat = {"messages": CHAT, "max_tokens": 3}
    status, body, _ = await lora_sim.post("/v1/chat/completions", {"model": "sql", **chat})
    assert status == 200 and body["model"] == "sql" and body["usage"]["completion_tokens"] <= 3
    status, body, _ = await lora_sim.post("/v1/chat/completions", {"model": "nope", **chat})
    assert status == 404
    assert body == {
        "error": {
            "message": "The model `nope` does not exist. Valid aliases: tiny, tiny-chat.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    text = await lora_sim.get("/metrics")
    series = lora_series(text)
    assert series and max(series, key=lambda k: series[k]) == ("1", "", "")
    assert ("1", "sql", "sql") in series


async def test_runtime_load_and_unload(lora_sim: Sim) -> None:
    load = {"lora_name": "fin", "lora_path": "/adapters/fin"}
    status, text, ctype = await lora_sim.post("/v1/load_lora_adapter", load)
    assert (status, text) == (200, "Success: LoRA adapter 'fin' added successfully.")
    assert not ctype.startswith("application/json")
    ids = [m["id"] for m in (await lora_sim.get("/v1/models"))["data"]]
    assert ids == ["tiny", "tiny-chat", "sql", "chat", "fin"]
    chat = {"model": "fin", "messages": CHAT, "max_tokens": 2}
    status, body, _ = await lora_sim.post("/v1/chat/completions", chat)
    assert status == 200 and body["model"] == "fin"

    status, body, _ = await lora_sim.post("/v1/load_lora_adapter", load)
    assert status == 400 and body["error"]["type"] == "InvalidUserInput"
    assert "has already been loaded" in body["error"]["message"]
    status, _, _ = await lora_sim.post("/v1/load_lora_adapter", {**load, "load_inplace": True})
    assert status == 200
    status, body, _ = await lora_sim.post(
        "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": "/p"}
    )
    assert status == 400 and "conflicts with a served base model" in body["error"]["message"]
    status, body, _ = await lora_sim.post("/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and body["error"]["param"] == "body.lora_path"

    status, text, _ = await lora_sim.post("/v1/unload_lora_adapter", {"lora_name": "fin"})
    assert (status, text) == (200, "Success: LoRA adapter 'fin' removed successfully.")
    status, body, _ = await lora_sim.post("/v1/unload_lora_adapter", {"lora_name": "fin"})
    assert status == 404
    assert body == {
        "error": {
            "message": "The lora adapter 'fin' cannot be found.",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    }
    status, body, _ = await lora_sim.post("/v1/chat/completions", chat)
    assert status == 404 and body["error"]["param"] == "model"


async def test_the_second_adapter_is_deferred_while_the_first_runs(lora_sim: Sim) -> None:
    long = {"messages": CHAT, "max_tokens": 100_000, "ignore_eos": True, "stream": True}
    resp = await lora_sim.session.post(
        lora_sim.base + "/v1/chat/completions", json={"model": "sql", **long}
    )
    await resp.content.readuntil(b"\n\n")  # role chunk
    await resp.content.readuntil(b"\n\n")  # a token: sql runs, and holds the one slot
    short = {"model": "chat", "messages": CHAT, "max_tokens": 2}
    other = asyncio.ensure_future(
        lora_sim.session.post(lora_sim.base + "/v1/chat/completions", json=short)
    )
    deferred = re.compile(r'num_requests_waiting_by_reason\{[^}]*reason="deferred"\} (\S+)')
    text = ""
    for _ in range(500):
        text = await lora_sim.get("/metrics")
        found = deferred.search(text)
        if found and float(found[1]):
            break
        await asyncio.sleep(0.01)
    # chat waits for sql's adapter slot, not for a seat (255 are free)
    assert float(deferred.findall(text)[0]) == 1
    assert re.search(r"^vllm:num_requests_running\{[^}]*\} 1\.0$", text, re.M)
    assert not other.done()
    newest = max(lora_series(text).items(), key=lambda kv: kv[1])[0]
    assert newest == ("1", "sql", "sql")  # chat has no token yet, so vLLM does not list it
    resp.close()  # sql's client leaves: its slot frees and chat runs
    other_resp = await other
    assert other_resp.status == 200 and (await other_resp.json())["model"] == "chat"
    text = await lora_sim.get("/metrics")
    assert float(deferred.findall(text)[0]) == 0


async def test_without_runtime_updating_the_routes_are_fastapis_404() -> None:
    port = free_port()
    runner = await start(
        SimConfig(model="tiny", enable_lora=True, runtime_lora_updating=False), "127.0.0.1", port
    )
    try:
        async with aiohttp.ClientSession() as session:
            sim = Sim(f"http://127.0.0.1:{port}", session)
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                status, body, _ = await sim.post(path, {"lora_name": "a", "lora_path": "/p"})
                assert (status, body) == (404, {"detail": "Not Found"})
            text = await sim.get("/metrics")
            assert "# TYPE vllm:lora_requests_info gauge" in text
            assert not lora_series(text)  # no step yet, so no series, as in vLLM
    finally:
        await runner.cleanup()


async def test_the_environment_switches_runtime_updating_and_lora_must_be_enabled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    port = free_port()
    runner = await start(SimConfig(model="tiny"), "127.0.0.1", port)
    try:
        async with aiohttp.ClientSession() as session:
            sim = Sim(f"http://127.0.0.1:{port}", session)
            status, body, _ = await sim.post(
                "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/p"}
            )
            assert status == 500 and body["error"]["type"] == "InternalServerError"
            assert [m["id"] for m in (await sim.get("/v1/models"))["data"]] == ["tiny"]
    finally:
        await runner.cleanup()


def test_start_up_adapters_that_vllm_would_refuse_stop_the_server() -> None:
    from loadtests.sim.server import SimServer

    for modules in (
        (LoraModule("tiny", "/p"),),
        (LoraModule("a", "/p"), LoraModule("a", "/q")),
    ):
        with pytest.raises(ValueError):
            SimServer(SimConfig(model="tiny", enable_lora=True, lora_modules=modules))
    server = SimServer(
        SimConfig(
            model="tiny",
            enable_lora=True,
            max_loras=1,
            lora_modules=(LoraModule("a", "/p"), LoraModule("b", "/q")),
        )
    )
    assert list(server.engine.lora_slots) == [2]  # loaded in order, the last one kept
    assert isinstance(server.engine.config, EngineConfig)
