"""Two models whose engines come and go through DNS, through the real stack: every request
still reaches an engine that serves its model, while engines join each pool and one leaves.

A real DNS server (dnsmasq on loopback) serves two names, one per model; simulated engines
listen on loopback addresses 127.0.0.21-24 (two per model, on one port). Mixed traffic for
both models flows while the test scales each name from one engine to two, then one name
back to one.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from extproc.fleet.discovery import DnsBackendSpec
from extproc.ops.processes import ProcessGroup, free_port, wait_http_ready
from extproc.ops.up import Stack, StackConfig
from tests.dns_server import DnsmasqMissing, DnsServer
from tests.exported_metrics import parse_samples
from tests.integration.conftest import auth, read_request_log
from tests.integration.test_dynamic_fleet import POLICY

pytestmark = pytest.mark.integration

PERIOD_S = 1.0
NAMES = {"llama": "llama.fairlane.test", "qwen-7b": "qwen.fairlane.test"}
ENGINES = {
    "127.0.0.21": "llama",
    "127.0.0.22": "llama",
    "127.0.0.23": "qwen-7b",
    "127.0.0.24": "qwen-7b",
}
WAIT_S = 20.0


async def until(condition: Callable[[], bool], what: str) -> None:
    started = time.monotonic()
    while not await asyncio.to_thread(condition):
        assert time.monotonic() - started < WAIT_S, f"{what}: not within {WAIT_S}s"
        await asyncio.sleep(0.05)


def backend_models(stack: Stack) -> dict[str, set[str]]:
    """Backend address -> the models the service has read for it."""
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=3) as response:
        samples = parse_samples(response.read().decode())
    found: dict[str, set[str]] = {}
    for (name, labels), value in samples.items():
        if name == "fairlane_backend_model" and value == 1:
            label = dict(labels)
            found.setdefault(label["backend"], set()).add(label["model"])
    return found


async def send_forever(
    url: str, statuses: list[tuple[str, int]], stop: asyncio.Event, worker: int
) -> None:
    async with aiohttp.ClientSession() as session:
        for number in itertools.count():
            if stop.is_set():
                return
            model = "llama" if (number + worker) % 2 else "qwen-7b"
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"hi {number}"}],
                "max_tokens": 8,
            }
            try:
                async with session.post(
                    url, json=body, headers=auth("sk-chat-demo"), timeout=aiohttp.ClientTimeout(30)
                ) as response:
                    await response.read()
                    statuses.append((model, response.status))
            except (aiohttp.ClientError, TimeoutError):
                statuses.append((model, 0))


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[tuple[ProcessGroup, DnsServer, Stack, int]]:
    group = ProcessGroup(tmp_path / "logs")
    try:
        dns = DnsServer(group, tmp_path)
        try:
            dns.start()
        except DnsmasqMissing as missing:
            pytest.fail(str(missing), pytrace=False)
        port = free_port()
        for ip, model in ENGINES.items():
            argv = [sys.executable, "-m", "extproc", "sim", "--host", ip, "--port", str(port)]
            argv += ["--model", model, "--log-requests", str(tmp_path / f"requests-{ip}.jsonl")]
            child = group.start(f"sim-{ip}", argv)
            await asyncio.to_thread(wait_http_ready, f"http://{ip}:{port}/health", child, 30)
        dns.set(NAMES["llama"], ("127.0.0.21",))
        dns.set(NAMES["qwen-7b"], ("127.0.0.23",))
        policy = tmp_path / "policy.yaml"
        policy.write_text(POLICY)
        config = StackConfig(
            port=free_port(),
            policy_path=policy,
            dns_backends=tuple(DnsBackendSpec(name, port, "region-a") for name in NAMES.values()),
            service_args=("--dns-server", dns.address, "--dns-interval", str(PERIOD_S)),
        )
        stack = await asyncio.to_thread(Stack(config, group).start)
        yield group, dns, stack, port
    finally:
        await asyncio.to_thread(group.stop)


async def test_requests_follow_their_model_while_engines_join_and_leave(
    fleet: tuple[ProcessGroup, DnsServer, Stack, int], tmp_path: Path
) -> None:
    _, dns, stack, port = fleet

    def read(*ips: str) -> bool:
        known = backend_models(stack)
        return all(ENGINES[ip] in known.get(f"{ip}:{port}", set()) for ip in ips)

    await until(lambda: read("127.0.0.21", "127.0.0.23"), "the first engines' models read")
    statuses: list[tuple[str, int]] = []
    stop = asyncio.Event()
    url = stack.url + "/v1/chat/completions"
    workers = [asyncio.create_task(send_forever(url, statuses, stop, i)) for i in range(4)]
    try:
        await until(lambda: len(statuses) >= 20, "traffic on both models")
        dns.set(NAMES["llama"], ("127.0.0.21", "127.0.0.22"))  # each pool gains an engine
        dns.set(NAMES["qwen-7b"], ("127.0.0.23", "127.0.0.24"))
        await until(lambda: read(*ENGINES), "the joined engines' models read")
        sent = len(statuses)
        await until(lambda: len(statuses) >= sent + 40, "traffic on four engines")
        dns.set(NAMES["llama"], ("127.0.0.22",))  # and one leaves
        sent = len(statuses)
        await until(lambda: len(statuses) >= sent + 40, "traffic after the departure")
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), 60)
    assert [s for s in statuses if s[1] != 200] == []
    for ip, model in ENGINES.items():
        seen = {r.get("model") for r in read_request_log(tmp_path / f"requests-{ip}.jsonl")}
        assert seen <= {model}, (ip, seen)
    joined = read_request_log(tmp_path / "requests-127.0.0.24.jsonl")
    assert joined, "the engine that joined the qwen pool got traffic"
