"""``fairlane up`` when its ext_proc service is SIGKILLed: Envoy keeps answering (503
``gateway_unavailable`` with ``retry-after``, at once), ``up`` restarts the service on the
same ports within seconds, requests already streaming finish, and SIGTERM still stops every
process, the restarted service included."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest

from extproc.ops.processes import Child, ProcessGroup, free_port
from tests.integration.test_up import children_of, command_line, demo_request, wait_for_log
from tests.pids import alive

pytestmark = pytest.mark.integration

PROBE_FOR_S = 10.0
PROBE_EVERY_S = 0.1
CLIENT_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Answer:
    sent_at: float
    took_s: float
    status: int | None
    """None: no answer within the client's timeout (or the connection failed)."""
    retry_after: str | None = None
    body: Any = None
    error: str = ""


def ask(port: int, timeout_s: float = CLIENT_TIMEOUT_S) -> Answer:
    """One small demo chat completion, as a client with a ``timeout_s`` timeout sees it."""
    sent_at = time.monotonic()
    try:
        with urllib.request.urlopen(demo_request(port, max_tokens=2), timeout=timeout_s) as r:
            status, headers, raw = int(r.status), r.headers, r.read()
    except urllib.error.HTTPError as error:
        status, headers, raw = int(error.code), error.headers, error.read()
    except (urllib.error.URLError, OSError) as exc:
        return Answer(sent_at, time.monotonic() - sent_at, None, error=repr(exc))
    took = time.monotonic() - sent_at
    try:
        body = json.loads(raw)
    except ValueError:
        body = raw[:200]
    return Answer(sent_at, took, status, headers.get("retry-after"), body)


def start_up(processes: ProcessGroup) -> tuple[Child, int]:
    """``fairlane up`` with its default simulators, once it answers a demo request."""
    port = free_port()
    up = processes.start("up", [sys.executable, "-m", "extproc", "up", "--port", str(port)])
    wait_for_log(up, "fairlane is up", timeout_s=60)
    deadline = time.monotonic() + 30
    while (answer := ask(port, timeout_s=10)).status != 200:
        assert time.monotonic() < deadline, f"no 200 from up: {answer}\n{up.log_tail()}"
        time.sleep(0.2)
    return up, port


def service_pids(up: Child) -> list[int]:
    return [pid for pid in children_of(up.popen.pid) if "serve" in command_line(pid)]


def stop_up(up: Child, started: set[int]) -> None:
    """SIGTERM ``up``: it exits 0 and every process it started is gone."""
    os.kill(up.popen.pid, signal.SIGTERM)
    assert up.popen.wait(timeout=20) == 0, up.log_tail()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in started if alive(pid)]


def is_gateway_unavailable(answer: Answer) -> bool:
    """Envoy's own answer while the service is away: 503, ``retry-after``, OpenAI's error
    shape."""
    error = answer.body.get("error") if isinstance(answer.body, dict) else None
    return (
        answer.status == 503
        and answer.retry_after is not None
        and isinstance(error, dict)
        and error.get("code") == "gateway_unavailable"
        and isinstance(error.get("message"), str)
    )


def test_a_killed_service_is_answered_for_by_envoy_and_restarted_within_seconds(
    processes: ProcessGroup,
) -> None:
    """SIGKILL the service under ``fairlane up``, then one request every 100 ms for 10 s,
    each with a 1 s client timeout: every one is answered within it, 200 or Envoy's 503
    ``gateway_unavailable`` with ``retry-after``; a 200 again within 5 s of the kill; ``up``
    says it restarted the service, which runs on the same port."""
    up, port = start_up(processes)
    started = set(children_of(up.popen.pid))
    assert len(started) == 4  # two simulators, the service, Envoy
    (service,) = service_pids(up)
    before = command_line(service)

    os.kill(service, signal.SIGKILL)
    killed_at = time.monotonic()
    answers: list[Answer] = []
    next_at = killed_at
    while time.monotonic() - killed_at < PROBE_FOR_S:
        answers.append(ask(port))
        next_at += PROBE_EVERY_S
        time.sleep(max(0.0, next_at - time.monotonic()))

    worst = max(a.took_s for a in answers)
    first_ok = next(a for a in answers if a.status == 200).sent_at - killed_at
    unavailable = sum(is_gateway_unavailable(a) for a in answers)
    print(
        f"\n{len(answers)} requests in {PROBE_FOR_S:g} s after the kill: {unavailable} got "
        f"503 gateway_unavailable, the rest 200; worst answer {worst * 1000:.0f} ms; first "
        f"200 sent {first_ok:.2f} s after the kill"
    )
    odd = [a for a in answers if a.status != 200 and not is_gateway_unavailable(a)]
    assert not odd, odd[:5]
    assert worst < CLIENT_TIMEOUT_S
    assert first_ok < 5.0, answers
    assert unavailable >= 1, "the service was never missed: the test is void"
    assert answers[-1].status == 200  # served again, not flapping

    log = up.log_path.read_text()
    assert "fairlane: the service exited (signal SIGKILL); restarting it in 0.5 s" in log, log
    assert "(restart 1; log: " in log and "the service is serving again" in log, log
    (restarted,) = service_pids(up)
    assert restarted != service and command_line(restarted) == before
    assert up.alive()
    stop_up(up, started | {restarted})


@dataclass
class Stream:
    """A streamed chat completion read in a thread: its status, chunks and end."""

    port: int
    max_tokens: int
    status: int | None = None
    chunks: list[dict[str, Any]] = field(default_factory=list)
    done_at: float | None = None
    error: str = ""

    def read(self) -> None:
        request = demo_request(self.port, self.max_tokens)
        body = json.loads(request.data)  # type: ignore[arg-type]
        body.update(stream=True, ignore_eos=True, stream_options={"include_usage": True})
        request.data = json.dumps(body).encode()
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                self.status = int(response.status)
                for line in response:
                    text = line.decode().strip()
                    if text == "data: [DONE]":
                        self.done_at = time.monotonic()
                    elif text.startswith("data: "):
                        self.chunks.append(json.loads(text.removeprefix("data: ")))
        except Exception as exc:  # the test reports it
            self.error = repr(exc)

    def tokens(self) -> int:
        choices = [choice for chunk in self.chunks for choice in chunk.get("choices", [])]
        return sum(1 for choice in choices if choice["delta"].get("content"))


def test_a_stream_under_way_when_the_service_is_killed_finishes(processes: ProcessGroup) -> None:
    """A streamed completion of ~2 s is under way (tokens arriving) when the service is
    SIGKILLed: Envoy carries it straight from the engine, so it ends with 200, every token
    and ``[DONE]``, after the kill."""
    up, port = start_up(processes)
    started = set(children_of(up.popen.pid))
    (service,) = service_pids(up)
    stream = Stream(port, max_tokens=400)
    reader = threading.Thread(target=stream.read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 10
    while len(stream.chunks) < 5:
        assert not stream.error and stream.done_at is None, stream
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.01)

    os.kill(service, signal.SIGKILL)
    killed_at = time.monotonic()
    reader.join(timeout=30)
    assert not reader.is_alive(), "the stream never ended"
    assert not stream.error, stream.error
    assert stream.status == 200
    assert stream.done_at is not None and stream.done_at > killed_at, "ended before the kill"
    print(f"\nthe stream ended {stream.done_at - killed_at:.2f} s after the kill")
    assert stream.tokens() == 400
    (usage,) = [c["usage"] for c in stream.chunks if c.get("usage")]
    assert usage["completion_tokens"] == 400
    assert stream.chunks[-2]["choices"][0]["finish_reason"] == "length"
    wait_for_log(up, "the service is serving again", timeout_s=15)
    stop_up(up, started | set(service_pids(up)))
