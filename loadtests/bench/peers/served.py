"""What each engine serves and how it caches, asked of the engine itself.

A peer gateway is configured as its users would configure it in front of the same fleet:
LiteLLM gets one deployment per model name an engine answers to (its served names and the
LoRA adapters it has loaded, as ``/v1/models`` lists them), and vllm-router's ``kv_aware``
policy the block size the engine hashes its KV events with (``vllm:cache_config_info``'s
``block_size`` label). Asking the engines works the same for the simulators and for real
vLLM engines given with ``--backend``.
"""

from __future__ import annotations

import json
import re
import urllib.request

DEFAULT_BLOCK_SIZE = 16
"""vLLM's block size on GPUs, when an engine's metrics do not say."""

_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{(?:[^}]*,)?block_size="(\d+)"', re.MULTILINE)


def _get(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: bytes = response.read()
        return body


def served_models(base_url: str, timeout: float = 5.0) -> tuple[str, ...]:
    """The model names ``GET /v1/models`` lists (served names, then LoRA adapters)."""
    data = json.loads(_get(f"{base_url}/v1/models", timeout))
    return tuple(str(card["id"]) for card in data.get("data", []))


def block_size(base_url: str, timeout: float = 5.0) -> int:
    """The engine's KV block size in tokens (:data:`DEFAULT_BLOCK_SIZE` when unknown)."""
    try:
        text = _get(f"{base_url}/metrics", timeout).decode(errors="replace")
    except OSError:
        return DEFAULT_BLOCK_SIZE
    return block_size_in(text)


def block_size_in(metrics: str) -> int:
    """The ``block_size`` label of ``vllm:cache_config_info`` in a ``/metrics`` page."""
    match = _BLOCK_SIZE.search(metrics)
    return int(match.group(1)) if match else DEFAULT_BLOCK_SIZE
