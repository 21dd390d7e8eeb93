"""Engines given with ``--backend``: a precise arm needs their KV events and tokenizer, and
each arm starts on empty prefix caches (a simulator serves vLLM's reset route; an engine
without it is named)."""

from __future__ import annotations

import http.server
import json
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.fleet.backend import BackendSpec, KVEventPorts
from extproc.ops.processes import ProcessGroup, free_port, wait_http_ready
from loadtests.bench.cachestats import parse_prefix_counters
from loadtests.bench.external import BackendError, check_precise, reset_prefix_caches
from loadtests.bench.scenario import load_scenario

PROMPT = [{"role": "user", "content": "the same long system prompt, sent again " * 30}]


def test_a_precise_arm_needs_every_engines_events_and_their_tokenizer() -> None:
    scenario = load_scenario("prefix-vllm-cpu")
    events = BackendSpec("127.0.0.1", 8701, kv_events=KVEventPorts(5517, 5518))
    silent = BackendSpec("127.0.0.1", 8702)
    with pytest.raises(BackendError, match=r"kv-events=PORT.*http://127\.0\.0\.1:8702"):
        check_precise(scenario.with_overrides(tokenizer="/models/tiny"), [events, silent])
    with pytest.raises(BackendError, match="--tokenizer DIR"):
        check_precise(scenario, [events])
    check_precise(scenario.with_overrides(tokenizer="/models/tiny"), [events])
    # no precise arm, or simulators (no --backend): nothing to name
    check_precise(scenario.with_overrides(arms=["approximate", "least-request"]), [silent])
    check_precise(scenario, [])


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[BackendSpec]:
    """A simulator standing in for a vLLM started with VLLM_SERVER_DEV_MODE=1."""
    with ProcessGroup(tmp_path / "engine") as group:
        port = free_port()
        argv = [sys.executable, "-m", "extproc", "sim", "--port", str(port), "--speedup", "20"]
        child = group.start("engine", argv)
        wait_http_ready(f"http://127.0.0.1:{port}/health", child, timeout=30)
        yield BackendSpec("127.0.0.1", port)


def _hits_after_a_request(url: str) -> float:
    body = {"model": "sim-llama-8b", "messages": PROMPT, "max_tokens": 2}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), method="POST"
    )
    request.add_header("Content-Type", "application/json")
    urllib.request.urlopen(request, timeout=10).read()
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        return parse_prefix_counters(response.read().decode()).hits


def test_reset_empties_each_engines_prefix_cache(engine: BackendSpec) -> None:
    _hits_after_a_request(engine.url)
    warm = _hits_after_a_request(engine.url)
    assert warm > 0  # the second request found the first one's blocks
    assert reset_prefix_caches([engine]) == []
    assert _hits_after_a_request(engine.url) == warm  # nothing left to find


class _NoSuchRoute(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.send_error(404)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_an_engine_without_the_reset_route_is_named() -> None:
    """vLLM outside dev mode answers 404: the bench goes on, and says the cache carried over."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRoute)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        spec = BackendSpec("127.0.0.1", server.server_address[1])
        assert reset_prefix_caches([spec], wait_s=0) == [spec.url]
    finally:
        server.shutdown()
        server.server_close()
