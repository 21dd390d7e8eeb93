"""Start child processes and make sure every one of them is stopped.

``fairlane up``, ``fairlane bench`` and the integration tests all start several servers
(Envoy, the service, simulators). A ``ProcessGroup`` owns them: each child runs in its own
process session with its output in a log file, ``stop()`` sends SIGTERM then SIGKILL, and the group
is a context manager so a failing test or a Ctrl-C still stops everything. ``restart()``
starts a child that died again, with the same command, in its place in the group.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

LOWEST_PORT = 10_000
"""Ports handed out for servers start here (below, the well-known and registered ones a
machine's own services tend to use)."""

_handed_out: deque[int] = deque(maxlen=4096)
"""Ports this process handed out lately: a server may not have bound its port yet when the
next one is asked for."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``, for a server about to be started.

    Taken below the kernel's ephemeral range when it can be: the kernel gives ports of
    that range to outgoing connections (each scrape, each proxied request), so a port found
    free there can be taken by one before the server binds it. It happened: a benchmark
    arm's simulator failed with "Address already in use" on its KV events port. Not one
    handed out lately by this process, nor one any socket holds (a bind without
    ``SO_REUSEADDR`` fails while a connection on it lingers)."""
    low, _ = _ephemeral_range()
    if low - LOWEST_PORT >= 1_000:
        for _ in range(200):
            port = random.randrange(LOWEST_PORT, low)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.append(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _handed_out.append(port)
    return port


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (Linux's defaults if unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    argv: tuple[str, ...] = ()
    """The command it was started with; with ``env``, ``cwd`` and ``logged``, what
    :meth:`ProcessGroup.restart` starts again."""
    env: Mapping[str, str] | None = None
    """The variables set on top of this process's environment (not the whole of it)."""
    cwd: Path | None = None
    logged: bool = True

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def label(self) -> str:
        """How a person names this process in a message: "the service", "Envoy",
        "the simulator sim-0"."""
        if self.name == "envoy" or self.name.startswith("envoy-"):
            return "Envoy"
        if self.name.startswith("sim"):
            return f"the simulator {self.name}"
        return f"the {self.name}"


def exit_text(returncode: int | None) -> str:
    """``code 1`` or ``signal SIGKILL`` (Popen reports a signal as a negative code)."""
    if returncode is not None and returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"


class ChildExited(RuntimeError):
    """A child that stopped while it should have been serving: which one, how, and the end
    of its log, so a crashed component is named instead of showing up as failed requests."""

    def __init__(self, child: Child, during: str) -> None:
        self.child = child
        tail = child.log_tail(20) or "(empty)"
        super().__init__(
            f"{child.label} (pid {child.popen.pid}) exited with "
            f"{exit_text(child.popen.returncode)} during {during}; last lines of its log "
            f"({child.log_path}):\n{tail}"
        )


class PortInUse(OSError):
    """A port the user fixed is taken; the message names the port and what wanted it."""


def ensure_port_free(port: int, what: str, host: str = "127.0.0.1") -> None:
    """Fail before starting anything if ``port`` (chosen by the user for ``what``) is
    taken, instead of letting the process that needs it die with a bind error in its log.
    (Ports the harness picks itself come from :func:`free_port`.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # as Envoy and grpc do: only a live listener blocks, not old TIME_WAIT connections
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortInUse(
                f"port {port} on {host} ({what}) is already in use ({exc.strerror}): stop "
                "what holds it or choose another port"
            ) from None


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
        child = self._spawn(name, argv, env, cwd, log, self.log_dir / f"{name}.log")
        self.children.append(child)
        return child

    def restart(self, child: Child) -> Child:
        """Start the command of ``child``, which has exited, again (same argv, environment
        and working directory) and put the new process in its place in ``children``.

        Its output goes to a new log, ``NAME.1.log``, then ``NAME.2.log``...: the dead
        process's log, which says why it died, stays as it was."""
        if child.alive():
            raise RuntimeError(f"{child.label} (pid {child.popen.pid}) is still running")
        if not child.argv:
            raise ValueError(f"{child.label} was not started by a ProcessGroup: no command")
        index = next((i for i, c in enumerate(self.children) if c is child), None)
        if index is None:
            raise ValueError(f"{child.label} (pid {child.popen.pid}) is not in this group")
        new = self._spawn(
            child.name, child.argv, child.env, child.cwd, child.logged, self._next_log(child.name)
        )
        self.children[index] = new
        return new

    def _next_log(self, name: str) -> Path:
        generation = 1
        while (self.log_dir / f"{name}.{generation}.log").exists():
            generation += 1
        return self.log_dir / f"{name}.{generation}.log"

    def _spawn(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None,
        cwd: Path | None,
        log: bool,
        log_path: Path,
    ) -> Child:
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
        return Child(
            name, popen, log_path, tuple(argv), None if env is None else dict(env), cwd, log
        )

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

    def check_alive(self, during: str) -> None:
        """Raise :class:`ChildExited` for the first child that is no longer running."""
        for child in self.children:
            if not child.alive():
                raise ChildExited(child, during)

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
        os.killpg(child.popen.pid, sig)  # the child's whole process group


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


def port_open(port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port`` now (one try)."""
    with socket.socket() as s:
        s.settimeout(timeout)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_port_open(port: int, child: Child | None = None, timeout: float = 30.0) -> None:
    """Wait until something accepts TCP connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and not child.alive():
            raise NotReady(
                f"{child.name} exited with {child.popen.returncode} before port {port} opened:\n"
                f"{child.log_tail()}"
            )
        if port_open(port):
            return
        time.sleep(0.05)
    raise NotReady(f"port {port} not open after {timeout:.0f}s")
