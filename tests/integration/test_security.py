"""Security through the real stack (Envoy, the service, simulated vLLM): engines that want an
API key get theirs and no one else's, a client's copies of the gateway's headers never reach
an engine, and the client listener can speak TLS."""

from __future__ import annotations

import json
import shutil
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from extproc.ops.processes import ProcessGroup, free_port
from extproc.ops.up import Stack, StackConfig
from tests.extproc.envoy.test_failure_mode import OWNED_BY_THE_GATEWAY
from tests.extproc.envoy.test_tls import make_self_signed
from tests.integration.conftest import SIM_ARGS, TEST_POLICY, chat, read_request_log

pytestmark = pytest.mark.integration

KEY_A = "sk-engine-REGION-A-7f3c9d"
KEY_B = "sk-engine-REGION-B-51ae02"
TENANT_KEY = "sk-chat-demo"


def _start(tmp: Path, **config: Any) -> tuple[ProcessGroup, Stack]:
    policy = tmp / "policy.yaml"
    policy.write_text(TEST_POLICY)
    group = ProcessGroup(tmp / "logs")
    try:
        stack = Stack(
            StackConfig(
                port=free_port(),
                policy_path=policy,
                sim_args=SIM_ARGS,
                sim_log_requests=True,
                **config,
            ),
            group,
        ).start()
    except BaseException:
        group.stop()
        raise
    return group, stack


def _post(
    url: str, headers: dict[str, str], context: ssl.SSLContext | None = None
) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url,
        data=json.dumps(chat()).encode(),
        headers={"content-type": "application/json", **headers},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _log_of(stack: Stack, region: str) -> list[dict[str, Any]]:
    (address,) = [b.address for b in stack.backends if b.region == region]
    return read_request_log(stack.request_logs[address])


def test_each_engine_gets_its_own_key_and_nothing_the_gateway_owns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Region a's engine wants KEY_A (from the environment), region b's KEY_B (from a file).
    A request carrying every header the gateway owns reaches region a with KEY_A alone; once
    region a is gone, requests reach region b with KEY_B. A key the engine does not want is
    refused by the engine itself (the simulator answers 401), so the test can fail."""
    monkeypatch.setenv("FAIRLANE_TEST_ENGINE_KEY_A", KEY_A)
    key_file = tmp_path / "engine-b.key"
    key_file.write_text(KEY_B + "\n")
    group, stack = _start(
        tmp_path,
        sim_regions=("region-a", "region-b"),
        sim_extra_args={0: ("--api-key", KEY_A), 1: ("--api-key", KEY_B)},
        service_args=(
            "--region-key",
            "region-a=env:FAIRLANE_TEST_ENGINE_KEY_A",
            "--region-key",
            f"region-b=file:{key_file}",
        ),
    )
    try:
        (b_address,) = [b.address for b in stack.backends if b.region == "region-b"]
        # the engines really want their keys
        status, _ = _post(f"http://{b_address}/v1/chat/completions", {})
        assert status == 401
        status, _ = _post(f"http://{b_address}/v1/chat/completions", {"authorization": KEY_A})
        assert status == 401

        status, body = _post(f"{stack.url}/v1/chat/completions", dict(OWNED_BY_THE_GATEWAY))
        assert status == 200, body
        (seen,) = _log_of(stack, "region-a")
        headers = {name.lower(): value for name, value in seen["headers"].items()}
        assert headers["authorization"] == f"Bearer {KEY_A}"
        for name, value in OWNED_BY_THE_GATEWAY.items():
            if name == "authorization":
                continue
            # set by the gateway itself, never the client's value
            assert headers.get(name) != value, (name, headers)
        assert not any(
            name.startswith("x-fairlane-") and name not in ("x-fairlane-tier", "x-fairlane-tenant")
            for name in headers
        ), headers
        assert headers["x-fairlane-tenant"] == "chat-app"  # the gateway's, not the client's
        assert TENANT_KEY not in json.dumps(seen)
        assert KEY_B not in json.dumps(seen)

        # region a goes away: the service moves to region b, and sends b's key there
        stack.kill_simulator(next(b.address for b in stack.backends if b.region == "region-a"))
        deadline = time.monotonic() + 30
        while not _log_of(stack, "region-b"):
            assert time.monotonic() < deadline, "no request reached region b"
            _post(f"{stack.url}/v1/chat/completions", {"authorization": f"Bearer {TENANT_KEY}"})
            time.sleep(0.5)
        status, body = _post(
            f"{stack.url}/v1/chat/completions", {"authorization": f"Bearer {TENANT_KEY}"}
        )
        assert status == 200, body
        for record in _log_of(stack, "region-b"):
            headers = {name.lower(): value for name, value in record["headers"].items()}
            assert headers["authorization"] == f"Bearer {KEY_B}"
        logs = "".join(p.read_text() for p in group.log_dir.glob("*.log"))
        assert KEY_A not in logs and KEY_B not in logs  # read once, never printed
    finally:
        group.stop()


def test_the_client_listener_speaks_tls(tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    assert openssl is not None, "this test needs the openssl command to make a certificate"
    cert, key = make_self_signed(tmp_path, openssl)
    group, stack = _start(tmp_path, tls_cert=cert, tls_key=key)
    try:
        assert stack.url.startswith("https://")
        trusted = ssl.create_default_context(cafile=str(cert))
        auth = {"authorization": f"Bearer {TENANT_KEY}"}
        status, body = _post(f"{stack.url}/v1/chat/completions", auth, trusted)
        assert status == 200, body
        assert json.loads(body)["object"] == "chat.completion"
        # the listener speaks nothing else: plain HTTP on the same port gets no answer
        plain = stack.url.replace("https://", "http://")
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            _post(f"{plain}/v1/chat/completions", auth)
        # and a client that does not trust the certificate refuses it
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            _post(f"{stack.url}/v1/chat/completions", auth, ssl.create_default_context())
    finally:
        group.stop()
