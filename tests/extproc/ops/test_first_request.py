"""``fairlane up``'s "try:" line names a model the backends serve and a key the policy takes."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from extproc.fleet.backend import BackendSpec
from extproc.ops.first_request import ServedModel, curl_lines, served_model, served_models
from extproc.ops.processes import free_port
from extproc.policy import DEFAULT_POLICY_PATH, hashed_form, load_policy, parse_policy


class Models(BaseHTTPRequestHandler):
    """vLLM's ``/v1/models``: the model a real engine was started with, or a 401 when it
    wants an API key."""

    status = 200

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": "Qwen/Qwen3-8B"}]}).encode()
        self.send_response(self.status if self.path == "/v1/models" else 404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class Locked(Models):
    """An engine started with ``--api-key sk-engine-0001``."""

    def do_GET(self) -> None:
        self.status = 200 if self.headers.get("authorization") == "Bearer sk-engine-0001" else 401
        super().do_GET()


def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[BackendSpec]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield BackendSpec("127.0.0.1", server.server_address[1], "region-a")
    finally:
        server.shutdown()
        server.server_close()


def suggested(*specs: BackendSpec) -> ServedModel:
    """What ``up`` suggests after reading each backend's models, as it does at start."""
    return served_model([served_models(spec) for spec in specs])


@pytest.fixture
def engine() -> Iterator[BackendSpec]:
    yield from serve(Models)


@pytest.fixture
def locked() -> Iterator[BackendSpec]:
    yield from serve(Locked)


def test_the_model_comes_from_the_first_backend_that_answers(
    engine: BackendSpec, locked: BackendSpec
) -> None:
    down = BackendSpec("127.0.0.1", free_port(), "region-a")
    assert suggested(down, locked, engine) == ServedModel("Qwen/Qwen3-8B")


def test_a_real_backends_model_is_in_the_curl_line(engine: BackendSpec) -> None:
    policy = load_policy(DEFAULT_POLICY_PATH)
    lines = curl_lines("http://127.0.0.1:8080", policy, suggested(engine))
    text = "\n".join(lines)
    assert '"model": "Qwen/Qwen3-8B"' in text
    assert "sim-llama-8b" not in text
    assert "Bearer sk-chat-demo" in text
    assert lines[0] == "try:" and len(lines) == 4  # no notes: it works as printed


def test_unreadable_models_give_a_placeholder_and_say_why(locked: BackendSpec) -> None:
    down = BackendSpec("127.0.0.1", free_port(), "region-b")
    model = suggested(locked, down)
    assert model.name is None
    assert f"{locked.url}/v1/models: HTTP 401" in model.problem
    assert f"{down.url}/v1/models: " in model.problem
    text = "\n".join(curl_lines("http://x", load_policy(DEFAULT_POLICY_PATH), model))
    assert '"model": "MODEL"' in text
    assert "(MODEL: a model your backends serve; their /v1/models could not be read: " in text


def test_a_policy_without_the_demo_key_gets_a_key_placeholder() -> None:
    policy = parse_policy(
        "tiers: [{name: a, priority: 0, queue_limit: 1, queue_deadline_s: 1}]\n"
        f"tenants: [{{name: t, api_keys: ['{hashed_form('sk-prod-0001')}'], tiers: [a]}}]\n"
    )
    text = "\n".join(curl_lines("http://x", policy, ServedModel("m")))
    assert "Bearer YOUR_API_KEY" in text and "(YOUR_API_KEY: one of the policy's api_keys)" in text


def test_a_backend_naming_its_engine_key_is_asked_with_it(
    locked: BackendSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGINE_KEY", "sk-engine-0001")
    keyed = dataclasses.replace(locked, credential="env:ENGINE_KEY")
    assert suggested(keyed) == ServedModel("Qwen/Qwen3-8B")
    monkeypatch.delenv("ENGINE_KEY")
    model = suggested(keyed)
    assert model.name is None and "ENGINE_KEY is not set" in model.problem
