"""Engines someone else started (``fairlane bench --backend URL``): checked before the run,
and their prefix caches emptied before each arm.

A simulated fleet is started fresh for every arm, so no arm inherits another's cache. Real
engines outlive the arms: without a reset the second arm of a prefix scenario would start on
the cache the first one warmed, and its hit rate would measure the order of the arms.
vLLM empties its prefix cache on ``POST /reset_prefix_cache`` (served when the engine runs
with ``VLLM_SERVER_DEV_MODE=1``; ``fairlane sim`` serves it always), and publishes
``AllBlocksCleared`` on its KV events stream.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from extproc.fleet.backend import BackendSpec, parse_backend
from loadtests.bench.scenario import Scenario

RESET_NEEDS = "vLLM serves `POST /reset_prefix_cache` only with `VLLM_SERVER_DEV_MODE=1`"
"""Why an engine's prefix cache may carry over from one arm to the next."""

RESET_WAIT_S = 30.0
"""How long to retry a reset vLLM refuses because a request still holds blocks (the previous
arm's cancelled requests leave the engine within a step or two)."""


class BackendError(ValueError):
    """A ``--backend`` that cannot be used; the message names it."""


def external_backends(urls: Sequence[str], timeout: float = 5.0) -> tuple[BackendSpec, ...]:
    """``--backend`` URLs as backends, each checked to answer ``/health`` now: a typo or a
    stopped engine fails here, naming the URL, not as a run of failed requests."""
    specs = []
    for url in urls:
        try:
            spec = parse_backend(url)
        except ValueError as exc:
            raise BackendError(f"--backend: {exc}") from None
        try:
            with urllib.request.urlopen(f"{spec.url}/health", timeout=timeout) as response:
                if response.status != 200:
                    raise BackendError(f"--backend {url}: /health answered {response.status}")
        except (urllib.error.URLError, OSError) as exc:
            raise BackendError(f"--backend {url}: not reachable ({exc})") from None
        specs.append(spec)
    return tuple(specs)


def check_precise(scenario: Scenario, external: Sequence[BackendSpec]) -> None:
    """A precise arm on existing engines follows their KV events and hashes prompts with
    their tokenizer: both must be named, or the arm would silently run approximate (no
    events) or match nothing (the simulators' tokenizer against a real model's hashes)."""
    precise = [a.name for a in scenario.arms if a.prefix_index == "precise"]
    if not external or not precise:
        return
    silent = [b.url for b in external if b.kv_events is None]
    if silent:
        raise BackendError(
            f"arm {precise[0]} follows the engines' KV events: give each --backend its "
            f"ports (URL#kv-events=PORT,kv-replay=PORT); none for {', '.join(silent)} "
            "(or leave the arm out with --arms)"
        )
    if scenario.tokenizer is None:
        raise BackendError(
            f"arm {precise[0]} hashes prompts as the engines do: --tokenizer DIR (the "
            "engines' model directory: its tokenizer.json and tokenizer_config.json)"
        )


def reset_prefix_caches(backends: Sequence[BackendSpec], wait_s: float = RESET_WAIT_S) -> list[str]:
    """Empty every engine's prefix cache; the URLs of those that could not be (no such route,
    or still refusing after ``wait_s``), for the report to say their cache carried over."""
    kept = []
    for backend in backends:
        deadline = time.monotonic() + wait_s
        while True:
            answer = _reset(backend.url)
            if answer is not False or time.monotonic() >= deadline:
                break
            time.sleep(0.5)  # a request still holds blocks: vLLM refuses until it leaves
        if answer is not True:
            kept.append(backend.url)
    return kept


def _reset(url: str, timeout: float = 10.0) -> bool | None:
    """True: emptied; False: refused for now (blocks held); None: the engine has no such
    route (vLLM outside dev mode) or did not answer."""
    request = urllib.request.Request(f"{url}/reset_prefix_cache", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = json.loads(response.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    # vLLM 0.32 answers {"success": bool}; older ones answered 200 with no body.
    return bool(body.get("success", True)) if isinstance(body, dict) else None
