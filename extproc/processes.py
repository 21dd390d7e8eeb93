"""Start child processes and make sure every one of them is stopped.

``fairlane up``, ``fairlane bench`` and the integration tests all start several servers
(Envoy, the service, simulators). A ``ProcessGroup`` owns them: each child runs in its own
session with its output in a log file, ``stop()`` sends SIGTERM then SIGKILL, and the group
is a context manager so a failing test or a Ctrl-C still stops everything.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.popen.poll() is None


class ProcessGroup:
    """A set of child processes that are stopped together."""

    def __init__(self, log_dir: Path | None = None) -> None:
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="fairlane-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        log: bool = True,
    ) -> Child:
        log_path = self.log_dir / f"{name}.log"
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        out = open(log_path, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
        try:
            popen = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            if log:
                out.close()  # type: ignore[union-attr]
        child = Child(name, popen, log_path)
        self.children.append(child)
        return child

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM every child (newest first), then SIGKILL whatever is left."""
        for child in reversed(self.children):
            _signal(child, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in reversed(self.children):
            remaining = max(0.0, deadline - time.monotonic())
            try:
                child.popen.wait(remaining)
            except subprocess.TimeoutExpired:
                _signal(child, signal.SIGKILL)
                child.popen.wait()
        self.children.clear()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _signal(child: Child, sig: signal.Signals) -> None:
    if child.popen.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.popen.pid, sig)  # the child's whole session


class NotReady(RuntimeError):
    pass


def wait_http_ready(url: str, child: Child | None = None, timeout: float = 30.0) -> None:
    """Poll ``url`` until it answers 200; fail early (with the log tail) if ``child`` died."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while time.monotonic() < deadline:
        if child is not None and not child.alive():
            raise NotReady(
                f"{child.name} exited with {child.popen.returncode} before {url} was ready:\n"
                f"{child.log_tail()}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
                last_error = f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as exc:
            last_error = str(exc)
        time.sleep(0.1)
    tail = f"\n{child.log_tail()}" if child is not None else ""
    raise NotReady(f"{url} not ready after {timeout:.0f}s ({last_error}){tail}")


def wait_port_open(port: int, child: Child | None = None, timeout: float = 30.0) -> None:
    """Wait until something accepts TCP connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and not child.alive():
            raise NotReady(
                f"{child.name} exited with {child.popen.returncode} before port {port} opened:\n"
                f"{child.log_tail()}"
            )
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise NotReady(f"port {port} not open after {timeout:.0f}s")
