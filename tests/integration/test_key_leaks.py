"""No API key reaches a log line or a metric: the real stack, keys of a recognisable pattern.

Tenants hold keys in each of the four forms (plain, ``sha256:``, ``env:``, ``file:``), all
of the pattern ``sk-LEAKCHECK-...``. Good requests, refused ones (bad body, unknown tier,
a wrong key of the same pattern, a key in ``x-api-key``), a bodiless one and a policy
reload that fails on a key are sent through Envoy, with the service logging at DEBUG. Then
every file the stack wrote (service, Envoy, simulators and their request logs) and the
service's and Envoy's metrics are searched for the pattern and for each key's tail.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from extproc.ops.processes import ProcessGroup, free_port
from extproc.ops.up import Stack, StackConfig
from extproc.policy import hashed_form
from tests.integration.conftest import SIM_ARGS, auth, chat
from tests.integration.test_gateway_e2e import post

pytestmark = pytest.mark.integration

PATTERN = "LEAKCHECK"
_TAIL = "ghjkmnpqrstvwxyz"  # no hex digit, so a tail cannot match an id or a digest by chance


def leak_key(rng: random.Random, form: str) -> str:
    return f"sk-{PATTERN}-{form}-" + "".join(rng.choice(_TAIL) for _ in range(20))


def policy_text(keys: dict[str, str], duplicate: bool = False) -> str:
    """The tenants of each key form; ``duplicate`` gives the file tenant the plain key too
    (a policy the reload refuses, naming the key in its error)."""
    extra = f", {keys['plain']}" if duplicate else ""
    return (
        "tiers:\n"
        "  - {name: interactive, aliases: [high], priority: 0, queue_limit: 8,"
        " queue_deadline_s: 30}\n"
        "tenants:\n"
        f"  - {{name: plain, api_keys: [{keys['plain']}], tiers: [interactive]}}\n"
        f"  - {{name: hashed, api_keys: ['{hashed_form(keys['hashed'])}'], tiers: [interactive]}}\n"
        "  - {name: env, api_keys: ['env:FAIRLANE_LEAKCHECK_KEY'], tiers: [interactive]}\n"
        f"  - {{name: file, api_keys: ['file:leak.key'{extra}], tiers: [interactive]}}\n"
    )


def needles(keys: dict[str, str]) -> list[str]:
    """What must not appear: the pattern, each key's last 8 characters, and the masked form
    the 401 message shows the client (``sk-L***`` + the last 4)."""
    found = [PATTERN]
    for key in keys.values():
        found += [key[-8:], f"{key[:4]}***{key[-4:]}"]
    return found


def leaks(text: str, keys: dict[str, str]) -> list[str]:
    return [needle for needle in needles(keys) if needle in text]


def scan(root: Path, keys: dict[str, str]) -> dict[str, list[str]]:
    """File -> the needles found in it, for every file under ``root``."""
    found = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        hits = leaks(path.read_bytes().decode("utf-8", "replace"), keys)
        if hits:
            found[str(path)] = hits
    return found


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


async def test_keys_never_reach_logs_or_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random()
    keys = {form: leak_key(rng, form) for form in ("plain", "hashed", "env", "file", "wrong")}
    monkeypatch.setenv("FAIRLANE_LEAKCHECK_KEY", keys["env"])  # the service inherits it
    (tmp_path / "leak.key").write_text(keys["file"] + "\n")
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(keys))

    planted = tmp_path / "planted" / "x.log"  # the scan finds what it is looking for
    planted.parent.mkdir()
    wrong = keys["wrong"]
    planted.write_text(f"authorization: Bearer {wrong}\nbad key {wrong[:4]}***{wrong[-4:]}\n")
    assert scan(planted.parent, keys) == {str(planted): needles({"wrong": wrong})}

    logs = tmp_path / "logs"
    group = ProcessGroup(logs)
    try:
        config = StackConfig(
            port=free_port(),
            policy_path=policy,
            sim_regions=("region-a",),
            sim_args=SIM_ARGS,
            sim_log_requests=True,
            service_args=("--log-level", "DEBUG"),
        )
        stack = Stack(config, group).start()
        await exercise(stack, keys)
        await reload_refused(stack, policy, keys, logs)
        metrics = get(f"http://127.0.0.1:{stack.metrics_port}/metrics")
        envoy_stats = get(f"{stack.admin_url}/stats/prometheus")
    finally:
        group.stop()
    assert "fairlane_requests" in metrics and "envoy_" in envoy_stats  # real texts, read
    assert leaks(metrics, keys) == []
    assert leaks(envoy_stats, keys) == []
    assert scan(logs, keys) == {}


async def exercise(stack: Stack, keys: dict[str, str]) -> None:
    """Every kind of request a key comes with, and the answer each must get."""
    for form in ("plain", "hashed", "env", "file"):
        status, headers, body = await post(stack, chat("hello"), auth(keys[form]))
        assert status == 200, (form, body)
        assert headers["x-fairlane-tier"] == "interactive"
    status, _, _ = await post(stack, chat(stream=True), {"x-api-key": keys["env"]})
    assert status == 200
    status, _, body = await post(stack, b'{"model": ', auth(keys["plain"]))
    assert status == 400
    status, _, body = await post(stack, chat(priority="platinum"), auth(keys["file"]))
    assert status == 400
    status, _, body = await post(stack, chat(), auth(keys["wrong"]))
    assert status == 401
    message = json.loads(body)["error"]["message"]
    assert f"{keys['wrong'][:4]}***{keys['wrong'][-4:]}" in message  # the client alone sees it
    status, _, _ = await post(stack, chat(), {"x-api-key": keys["wrong"]})
    assert status == 401
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{stack.url}/v1/models", headers=auth(keys["hashed"])) as r,
    ):
        assert r.status == 200


async def reload_refused(stack: Stack, policy: Path, keys: dict[str, str], logs: Path) -> None:
    """A policy listing one key for two tenants: the service logs why it keeps the old one."""
    before = policy.stat().st_mtime_ns
    policy.write_text(policy_text(keys, duplicate=True))
    os.utime(policy, ns=(before + 1_000_000_000, before + 1_000_000_000))
    deadline = time.monotonic() + 15
    while True:
        text = "".join(p.read_text(errors="replace") for p in logs.glob("service*.log"))
        if "not reloaded" in text:
            assert "is already used by tenant 'plain'" in text
            return
        assert time.monotonic() < deadline, f"no reload error logged in {sorted(logs.iterdir())}"
        time.sleep(0.2)
