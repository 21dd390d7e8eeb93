"""``fairlane up`` as a user runs it: one command, a working endpoint, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from extproc.processes import ProcessGroup, free_port
from tests.pids import alive

pytestmark = pytest.mark.integration


def children_of(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_up_serves_a_demo_key_and_sigterm_stops_every_process(processes: ProcessGroup) -> None:
    port = free_port()
    up = processes.start("up", [sys.executable, "-m", "extproc", "up", "--port", str(port)])
    deadline = time.monotonic() + 60
    while "fairlane is up" not in up.log_path.read_text():
        assert up.alive(), up.log_tail()
        assert time.monotonic() < deadline, up.log_tail()
        time.sleep(0.1)
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(
            {
                "model": "sim-llama-8b",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 3,
            }
        ).encode(),
        headers={"authorization": "Bearer sk-chat-demo", "content-type": "application/json"},
    )
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
