"""``fairlane up``'s watch over its children (extproc.ops.up.Watch) on stand-in processes:
a dead service is restarted with the same command in its place, Redis is reported, Envoy
stops the stack. Small Python processes instead of the real ones; a fake restart clock."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from extproc.ops.processes import Child, ProcessGroup, free_port
from extproc.ops.service_replicas import ServiceProcess, Services
from extproc.ops.supervisor import Supervisor
from extproc.ops.up import Stack, StackConfig, Watch

LISTEN = (
    "import socket, sys, time\n"
    "s = socket.socket()\n"
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1])))\n"
    "s.listen()\n"
    "print('listening', flush=True)\n"
    "time.sleep(120)\n"
)
"""A stand-in service: listens on the port it is given, like the gRPC port."""

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def kill(child: Child) -> None:
    os.kill(child.popen.pid, signal.SIGKILL)
    child.popen.wait(10)


def tick_until(watch: Watch, condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Tick ``watch`` until ``condition()`` holds (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert watch.tick() is None
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


def service_stack(group: ProcessGroup, names: tuple[str, ...], redis: bool) -> Stack:
    processes = []
    for name in names:
        port = free_port()
        child = group.start(name, [sys.executable, "-c", LISTEN, str(port)], env={"X_TEST": "1"})
        processes.append(ServiceProcess(child, port, free_port(), name.rpartition("-")[2]))
    redis_child = group.start("redis", SLEEP) if redis else None
    group.start("envoy", SLEEP)
    stack = Stack(StackConfig(), group)
    stack.services = Services(tuple(processes), redis_child)
    return stack


def test_a_dead_service_is_restarted_after_the_back_off_with_its_command_and_a_new_log(
    processes: ProcessGroup, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = service_stack(processes, ("service",), redis=False)
    clock = Clock()
    watch = Watch(stack, Supervisor(clock=clock))
    (before,) = stack.service_processes
    old = before.child
    assert watch.tick() is None and capsys.readouterr().err == ""
    kill(old)

    assert watch.tick() is None
    err = capsys.readouterr().err
    assert err == (
        "fairlane: the service exited (signal SIGKILL); restarting it in 0.5 s "
        f"(restart 1; log: {old.log_path})\n"
    )
    assert watch.sleep_s() == pytest.approx(0.25)
    clock.now += 0.4
    assert watch.tick() is None and capsys.readouterr().err == ""  # not due yet, no repeat
    assert processes.children[0] is old
    assert watch.sleep_s() == pytest.approx(0.1)

    clock.now += 0.1
    assert watch.tick() is None
    (process,) = stack.service_processes
    new = process.child
    assert new is not old and new.alive()
    assert processes.children[0] is new  # in the dead one's place: stopped in the same order
    assert (new.name, new.argv, new.env) == ("service", old.argv, {"X_TEST": "1"})
    assert (process.port, process.metrics_port) == (before.port, before.metrics_port)
    assert new.log_path.name == "service.1.log" and old.log_path.name == "service.log"


def test_the_restarted_service_is_announced_once_its_port_opens(
    processes: ProcessGroup, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = service_stack(processes, ("service",), redis=False)
    clock = Clock()
    watch = Watch(stack, Supervisor(clock=clock))
    kill(stack.service_processes[0].child)
    watch.tick()
    clock.now += 0.5
    watch.tick()
    new = stack.service_processes[0].child
    said: list[str] = []

    def announced() -> bool:
        said.append(capsys.readouterr().err)
        return "serving again" in "".join(said)

    tick_until(watch, announced)
    (line,) = [line for line in "".join(said).splitlines() if "serving again" in line]
    assert line.startswith(
        f"fairlane: the service is serving again (pid {new.popen.pid}, 0.5 s after it exited;"
    )
    assert line.endswith(f"log: {new.log_path})")
    assert "listening" in new.log_path.read_text()
    for _ in range(3):
        assert watch.tick() is None
    assert "serving again" not in capsys.readouterr().err  # said once


def test_a_restart_is_counted_and_backs_off_while_it_keeps_dying(
    processes: ProcessGroup, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = service_stack(processes, ("service",), redis=False)
    clock = Clock()
    watch = Watch(stack, Supervisor(clock=clock))
    for number, delay in ((1, "0.5"), (2, "1"), (3, "2")):
        kill(stack.service_processes[0].child)
        watch.tick()
        assert f"restarting it in {delay} s (restart {number};" in capsys.readouterr().err
        clock.now += float(delay)
        watch.tick()
        assert stack.service_processes[0].child.alive()
    assert sorted(p.name for p in processes.log_dir.glob("service*.log")) == [
        "service.1.log",
        "service.2.log",
        "service.3.log",
        "service.log",
    ]


def test_a_dead_replica_is_restarted_while_the_others_carry_on_and_redis_is_reported(
    processes: ProcessGroup, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = service_stack(processes, ("service-r1", "service-r2"), redis=True)
    clock = Clock()
    watch = Watch(stack, Supervisor(clock=clock))
    r1, r2 = (p.child for p in stack.service_processes)
    kill(r2)
    assert watch.tick() is None
    assert "the service-r2 exited (signal SIGKILL); the other replicas carry on; restarting" in (
        capsys.readouterr().err
    )
    clock.now += 0.5
    watch.tick()
    assert stack.services is not None
    assert stack.services.find("r2").child is not r2 and stack.services.find("r1").child is r1

    assert stack.services.redis is not None
    kill(stack.services.redis)
    assert watch.tick() is None
    assert watch.tick() is None
    err = capsys.readouterr().err
    assert err.count("fairlane: redis exited (signal SIGKILL); the replicas schedule alone") == 1


def test_envoy_dying_stops_the_stack(processes: ProcessGroup) -> None:
    stack = service_stack(processes, ("service",), redis=False)
    watch = Watch(stack, Supervisor(clock=Clock()))
    envoy = processes.children[-1]
    kill(envoy)
    assert watch.tick() is envoy


def test_restart_refuses_a_running_child_or_one_of_another_group(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    child = processes.start("sleeper", SLEEP)
    with pytest.raises(RuntimeError, match="still running"):
        processes.restart(child)
    kill(child)
    with ProcessGroup(tmp_path / "other") as other, pytest.raises(ValueError, match="not in"):
        other.restart(child)
