"""The LiteLLM proxy in front of the engines: its config, its command line, starting it.

One proxy process (uvicorn, one worker, as ``litellm --config`` starts by default) with one
deployment per model name an engine answers to, through LiteLLM's vLLM provider
(``hosted_vllm/NAME`` at ``http://ENGINE/v1``), so that requests for a model go only to the
engines serving it and vLLM's own fields (``ignore_eos``, ``priority``, ``extra_body``)
reach them. The proxy refuses to start without a master key: every request of a LiteLLM
arm carries it (:data:`MASTER_KEY`) in place of the tenant's key, since keys of its own
would need LiteLLM's database. The model cost map is read from the installed package
(``LITELLM_LOCAL_MODEL_COST_MAP``) instead of being fetched from GitHub at start-up. The
rest (routing strategy ``simple-shuffle``, retries, timeouts) is LiteLLM's default.

LiteLLM's priority (:func:`litellm_priority`) is an integer from 0 (most urgent) to 255.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from extproc.fleet.backend import BackendSpec
from extproc.ops.processes import ProcessGroup, free_port, wait_http_ready
from loadtests.bench.peers.install import LITELLM, require
from loadtests.bench.peers.served import served_models

MASTER_KEY = "sk-fairlane-bench-litellm"
"""The proxy's master key, which every request of a LiteLLM arm sends."""
PRIORITY_MIN, PRIORITY_MAX = 0, 255
"""LiteLLM's scheduler orders priorities 0 (first) to 255 (``litellm/scheduler.py``)."""
ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}
READY_TIMEOUT_S = 120.0
"""Importing the proxy alone takes seconds of CPU; on a busy 2-core machine many more."""


def litellm_priority(vllm_priority: int) -> int:
    """A tier's vLLM priority (lower is earlier, as in LiteLLM) as LiteLLM's priority:
    the same order, clamped to LiteLLM's range."""
    return min(PRIORITY_MAX, max(PRIORITY_MIN, vllm_priority))


def litellm_config(
    deployments: Mapping[str, Sequence[str]], master_key: str = MASTER_KEY
) -> dict[str, Any]:
    """The proxy's config: for each engine base URL, one deployment per model it serves."""
    model_list = [
        {
            "model_name": name,
            "litellm_params": {
                "model": f"hosted_vllm/{name}",
                "api_base": f"{url}/v1",
                "api_key": "none",
            },
        }
        for url, names in deployments.items()
        for name in names
    ]
    return {"model_list": model_list, "general_settings": {"master_key": master_key}}


def litellm_argv(binary: Path, config: Path, port: int) -> list[str]:
    return [
        str(binary),
        "--config",
        str(config),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
    ]


def start_litellm(
    group: ProcessGroup,
    backends: Sequence[BackendSpec],
    master_key: str = MASTER_KEY,
    models: Sequence[str] | None = None,
    name: str = "litellm",
) -> str:
    """Start the proxy in ``group`` (its config written into the group's log directory,
    the deployments read from each engine's ``/v1/models``, or ``models`` on every
    backend), wait until it serves and warm it up; its base URL."""
    binary = require(LITELLM)
    deployments = {
        b.url: tuple(models) if models is not None else served_models(b.url) for b in backends
    }
    path = group.log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(litellm_config(deployments, master_key), sort_keys=False))
    port = free_port()
    child = group.start(name, litellm_argv(binary, path, port), env=ENV, cwd=group.log_dir)
    url = f"http://127.0.0.1:{port}"
    wait_http_ready(f"{url}/health/readiness", child, timeout=READY_TIMEOUT_S)
    for model in dict.fromkeys(n for names in deployments.values() for n in names):
        warm_up(url, model, master_key)
    return url


def warm_up(url: str, model: str, master_key: str = MASTER_KEY, timeout: float = 60.0) -> None:
    """One short request for ``model`` through the proxy: its first request loads the
    provider's code (~0.6 s here), which the arm's first requests must not pay."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {master_key}"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        response.read()
