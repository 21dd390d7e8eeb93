"""``fairlane up`` as a user runs it: one command, a working endpoint, nothing left behind."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from extproc.fleet.seats import FALLBACK_SEATS
from extproc.ops.processes import Child, ProcessGroup, free_port, wait_http_ready
from extproc.ops.up import SeatCount, SeatWatch
from tests.integration.conftest import SIM_ARGS, auth, chat, start_stack
from tests.pids import alive

pytestmark = pytest.mark.integration


def children_of(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def wait_for_log(child: Child, text: str, timeout_s: float) -> str:
    """``child``'s log once it holds ``text``; fails with the log's tail if the child exits
    first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while text not in (log := child.log_path.read_text()):
        assert child.alive(), child.log_tail()
        assert time.monotonic() < deadline, child.log_tail()
        time.sleep(0.1)
    return log


def demo_request(port: int, max_tokens: int) -> urllib.request.Request:
    """A chat completion with the default policy's demo key, to ``fairlane up`` on ``port``."""
    body = {
        "model": "sim-llama-8b",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": max_tokens,
    }
    return urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"authorization": "Bearer sk-chat-demo", "content-type": "application/json"},
    )


def test_up_serves_a_demo_key_and_sigterm_stops_every_process(processes: ProcessGroup) -> None:
    port = free_port()
    up = processes.start("up", [sys.executable, "-m", "extproc", "up", "--port", str(port)])
    wait_for_log(up, "fairlane is up", timeout_s=60)
    request = demo_request(port, max_tokens=3)
    banner = up.log_path.read_text()
    assert "Bearer sk-chat-demo" in banner and '"model": "sim-llama-8b"' in banner, banner
    # the simulators publish their KV events by default, and the service follows them
    assert "prefix affinity: precise, from the KV events of 2 engine(s)" in banner, banner
    seat_lines = re.findall(r"backend (region-[ab]) 127\.0\.0\.1:\d+: seats (\d+) \((.*)\)", banner)
    # two simulators of unknown size, before any load: the fallback
    assert sorted(seat_lines) == [
        ("region-a", str(FALLBACK_SEATS), "fallback: not learned yet"),
        ("region-b", str(FALLBACK_SEATS), "fallback: not learned yet"),
    ], banner
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        assert response.headers["x-fairlane-tier"] == "interactive"
        assert json.load(response)["usage"]["completion_tokens"] == 3

    started = children_of(up.popen.pid)
    assert len(started) == 4  # two simulators, the service, Envoy
    os.kill(up.popen.pid, signal.SIGTERM)
    assert up.popen.wait(timeout=20) == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in started if alive(pid)]


def test_up_with_a_real_backend_suggests_the_model_it_serves(processes: ProcessGroup) -> None:
    """``--backend`` names an engine started elsewhere, serving another model than the
    simulator's default: the "try:" line names that model (read from its /v1/models), and
    the line works as printed."""
    engine_port, port = free_port(), free_port()
    engine = processes.start(
        "engine",
        [sys.executable, "-m", "extproc", "sim", "--port", str(engine_port), "--model", "qwen-x"],
    )
    wait_http_ready(f"http://127.0.0.1:{engine_port}/health", engine)
    up = processes.start(
        "up",
        [
            *(sys.executable, "-m", "extproc", "up", "--port", str(port)),
            *("--backend", f"region-a=http://127.0.0.1:{engine_port}"),
        ],
    )
    wait_for_log(up, "Ctrl-C stops everything", timeout_s=60)
    banner = up.log_path.read_text()
    (line,) = [line for line in banner.splitlines() if '"model"' in line]
    body = json.loads(line.strip().removeprefix("-d '").removesuffix("'"))
    assert body["model"] == "qwen-x", banner
    assert "sim-llama-8b" not in banner
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps({**body, "max_tokens": 2}).encode(),
        headers={"authorization": "Bearer sk-chat-demo", "content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        assert json.load(response)["model"] == "qwen-x"
    os.kill(up.popen.pid, signal.SIGTERM)
    assert up.popen.wait(timeout=20) == 0


SEATS_POLICY = """\
max_in_flight_per_backend: 16
tiers:
  - name: interactive
    priority: 0
    queue_limit: 16
    queue_deadline_s: 30
    gate: {max_waiting: 8}
tenants:
  - name: chat-app
    api_keys: [sk-chat-demo]
    tiers: [interactive]
"""


async def test_seats_are_learned_from_a_queueing_engine_and_printed_by_up(tmp_path: Path) -> None:
    """An engine of two seats (``--max-num-seqs 2``) that the gateway fills past them
    queues requests while its KV cache has room: the service learns 2, exports it, and the
    watch ``fairlane up`` runs turns it into a line, starting from the fallback."""
    group, stack = start_stack(tmp_path, SEATS_POLICY, sim_args=(*SIM_ARGS, "--max-num-seqs", "2"))
    try:
        (backend,) = stack.backends
        watch = SeatWatch(f"http://127.0.0.1:{stack.metrics_port}/metrics")
        assert watch.first() == {backend.address: SeatCount("region-a", FALLBACK_SEATS, "fallback")}
        lines: list[str] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def send() -> int:
                body = chat(max_tokens=60)  # ~3 s each: six of them keep four waiting
                url = f"{stack.url}/v1/chat/completions"
                async with session.post(url, json=body, headers=auth("sk-chat-demo")) as r:
                    await r.read()
                    return r.status

            requests = [asyncio.create_task(send()) for _ in range(6)]
            deadline = time.monotonic() + 20
            while not lines and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                lines += await asyncio.to_thread(watch.poll)
            assert await asyncio.gather(*requests) == [200] * 6
        assert lines == [f"backend region-a {backend.address}: seats 2 (learned from the engine)"]
    finally:
        group.stop()


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().rstrip("\0").split("\0")
    except OSError:
        return []


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value after ``flag`` in a command line, if it has one."""
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def test_up_with_replicas_survives_a_dead_replica_and_stops_everything(
    processes: ProcessGroup,
) -> None:
    """``fairlane up --replicas 2``: a local Redis and two replicas, each printed with its
    gRPC address and metrics; one SIGKILLed replica is reported, the other serves on and
    the dead one is restarted with its flags; SIGTERM stops every process, Redis and the
    restarted replica included."""
    port = free_port()
    up = processes.start(
        "up", [sys.executable, "-m", "extproc", "up", "--port", str(port), "--replicas", "2"]
    )
    wait_for_log(up, "fairlane is up", timeout_s=60)
    banner = up.log_path.read_text()
    assert re.search(r"2 replicas sharing state in redis://127\.0\.0\.1:\d+/0", banner), banner
    for replica in ("r1", "r2"):
        assert re.search(
            rf"replica {replica}: gRPC 127\.0\.0\.1:\d+, metrics http://127\.0\.0\.1:\d+/metrics",
            banner,
        ), banner

    def generate() -> int:
        request = demo_request(port, max_tokens=2)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return int(response.status)
        except urllib.error.HTTPError as error:
            return int(error.code)

    assert [generate() for _ in range(4)] == [200] * 4
    started = children_of(up.popen.pid)
    assert len(started) == 6  # two simulators, Redis, two replicas, Envoy
    (r2,) = [pid for pid in started if flag_value(command_line(pid), "--replica-id") == "r2"]
    r2_argv = command_line(r2)
    os.kill(r2, signal.SIGKILL)
    log = wait_for_log(up, "service-r2 exited", timeout_s=10)
    assert "the other replicas carry on; restarting it in 0.5 s (restart 1;" in log, log
    # Until Envoy's health checks mark r2 down, a request may still reach it and get 503
    # (test_replicas.py holds that to its target): wait for that, then r1 (and the
    # restarted r2) serve.
    deadline = time.monotonic() + 15
    while (statuses := [generate() for _ in range(4)]) != [200] * 4:
        assert set(statuses) <= {200, 503}, statuses
        assert time.monotonic() < deadline, f"the replicas never served again: {statuses}"
        time.sleep(0.2)
    wait_for_log(up, "the service-r2 is serving again", timeout_s=15)
    restarted = [p for p in children_of(up.popen.pid) if p not in started]
    assert [command_line(p) for p in restarted] == [r2_argv]  # same ports, same flags
    assert up.alive()

    os.kill(up.popen.pid, signal.SIGTERM)
    assert up.popen.wait(timeout=20) == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in [*started, *restarted]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in [*started, *restarted] if alive(pid)]
