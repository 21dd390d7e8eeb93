"""What ``fairlane bench`` does with bad input and failures: an unknown scenario lists the
available ones, a malformed file names file:line and field, options that mean nothing for
overhead are refused, an unreachable ``--backend`` is named, a component that dies during an
arm is named (with its exit and log) while everything else is stopped, and Ctrl-C stops every
process. All on loopback, each bounded to a few seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.ops.cli import main
from extproc.ops.processes import ProcessGroup, free_port
from loadtests.bench import cli as bench_cli
from loadtests.bench.arms import RunningArm
from loadtests.bench.scenario import SCENARIO_DIR, Arm, Scenario
from tests.pids import alive

REPO = Path(__file__).resolve().parents[3]


def test_unknown_scenario_lists_the_available_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "no-such-scenario"]) == 1
    err = capsys.readouterr().err
    assert "no-such-scenario: no such scenario file" in err
    for name in ("batch-flood", "overhead", "smoke", "starvation"):
        assert name in err


def test_malformed_scenario_names_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    text = (SCENARIO_DIR / "smoke.yaml").read_text()
    text = text.replace(
        "policy: policies/bench-x20.yaml", f"policy: {SCENARIO_DIR}/policies/bench-x20.yaml"
    )
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("rate: 1.0"))
    lines[at] = lines[at].replace("rate: 1.0", "rate: lots")
    bad.write_text("\n".join(lines) + "\n")
    assert main(["bench", str(bad), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:{at + 1}: groups[0].rate: must be requests per simulated second > 0" in err
    syntax = tmp_path / "syntax.yaml"
    syntax.write_text("name: x\ngroups: [unclosed\n")
    assert main(["bench", str(syntax)]) == 1
    assert f"{syntax}:3: YAML syntax error" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "option", [["--speedup", "5"], ["--backend", "http://127.0.0.1:9"], ["--model", "m"]]
)
def test_overhead_refuses_fleet_options(
    option: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "overhead", *option]) == 1
    assert f"{option[0]}: overhead runs in wall-clock time" in capsys.readouterr().err


def test_unreachable_backend_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "smoke", "--backend", url]) == 1
    assert f"--backend {url}: not reachable" in capsys.readouterr().err
    assert main(["bench", "smoke", "--backend", "http://localhost"]) == 1
    assert "expected [REGION=]http://IP:PORT" in capsys.readouterr().err


@pytest.fixture
def kill_service_after(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Kill the fairlane arm's service 1 s after the arm is up (a crash mid-run)."""
    killed: list[int] = []
    timers: list[threading.Timer] = []
    real = bench_cli.start_arm

    def start_arm(scenario: Scenario, arm: Arm, group: ProcessGroup, *rest: object) -> RunningArm:
        running = real(scenario, arm, group, *rest)  # type: ignore[arg-type]
        killed.append(running.pids["service"])
        timer = threading.Timer(1.0, os.kill, (running.pids["service"], signal.SIGKILL))
        timers.append(timer)
        timer.start()
        return running

    monkeypatch.setattr(bench_cli, "start_arm", start_arm)
    yield killed
    for timer in timers:
        timer.cancel()


@pytest.mark.integration
def test_a_component_that_dies_is_named_and_the_arm_ends_early(
    tmp_path: Path, kill_service_after: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    started = time.monotonic()
    # 600 simulated s = 30 s wall of load: the death must end the arm long before that
    args = ["bench", "smoke", "--arms", "fairlane", "--duration", "600", "--out", str(out)]
    assert main(args) == 1
    assert time.monotonic() - started < 20
    captured = capsys.readouterr()
    pid = kill_service_after[0]
    message = f"the service (pid {pid}) exited with signal SIGKILL during arm fairlane"
    assert message in captured.err and "last lines of its log" in captured.err
    assert f"fairlane: FAILED: ChildExited: {message}" in captured.out
    assert (out / "report.md").exists()
    leftovers = [
        p.name
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and str(out) in _cmdline(int(p.name))
    ]
    assert leftovers == []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _interruptible() -> None:
    """In the child: Ctrl-C as a shell delivers it. A child inherits its parent's ignored
    and blocked signals, and earlier tests in this process may have left SIGINT so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _signal_state(pid: int) -> str:
    """The process's ignored, blocked and caught signal masks, for a failure message."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as exc:
        return str(exc)
    return ", ".join(line for line in lines if line.startswith(("SigIgn", "SigBlk", "SigCgt")))


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.integration
def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    bench = subprocess.Popen(
        [sys.executable, "-m", "extproc", "bench", "smoke", "--duration", "600", "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_interruptible,
    )
    try:
        assert bench.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = bench.stderr.readline()
            if " up at " in line or not line:
                break
        children = _children(bench.pid)
        assert len(children) >= 2, children  # Envoy and a simulator (the fifo arm)
        state = _signal_state(bench.pid)
        bench.send_signal(signal.SIGINT)
        try:
            rest = bench.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            running = "still running" if bench.poll() is None else f"exited {bench.returncode}"
            raise AssertionError(f"no exit 30 s after SIGINT ({running}; {state})") from None
        assert bench.returncode == 1
        assert "interrupted; every process was stopped" in rest
        assert not [pid for pid in children if alive(pid)]
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
