"""Locust load tests per tier: one user class per kind of client fairlane schedules.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8080             # web UI
    locust -f loadtests/locustfile.py --host http://127.0.0.1:8080 \\
        --headless -u 20 -r 5 -t 2m --csv /tmp/fairlane                       # CSV files
    locust -f loadtests/locustfile.py --host ... InteractiveUser BatchUser     # some tiers

The classes (weights in brackets): ``InteractiveUser`` [4], ``ApiUser`` [2], ``BatchUser``
[2], ``SharedPrefixUser`` [1] and ``ConversationUser`` [1]; ``ChatUser`` says what each
reports (streaming classes add TTFT and ITL rows) and the environment variables that set the
model, the keys, the seed and the weights. Prompts are random words generated locally from a
seed (``loadtests.bench.workload``): user *n* of a class sends the same requests in every run
with the same seed. Tiers are selected by class, not by ``--tags``: locust keeps a class whose
tasks were all filtered out by tags, and it then fails on every iteration.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from locust import between, constant, task
from locust.contrib.fasthttp import FastHttpUser, ResponseContextManager

try:
    from loadtests.bench import workload
    from loadtests.bench.scenario import Dist, Group, SharedPrefix
except ImportError:  # locust puts only loadtests/ on sys.path; fairlane not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from loadtests.bench import workload
    from loadtests.bench.scenario import Dist, Group, SharedPrefix

CHAT_PATH = "/v1/chat/completions"
USER_HEADER = "x-user-id"
"""The default policy's end-user header: each locust user is one end user for fairness."""


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


MODEL = _env("FAIRLANE_MODEL", "sim-llama-8b")
SEED = int(_env("FAIRLANE_SEED", "0"))
IGNORE_EOS = _env("FAIRLANE_IGNORE_EOS", "1") not in ("0", "false", "no")
KEYS = {
    "interactive": _env("FAIRLANE_KEY_INTERACTIVE", "sk-chat-demo"),
    "api": _env("FAIRLANE_KEY_API", "sk-api-demo"),
    "batch": _env("FAIRLANE_KEY_BATCH", "sk-batch-demo"),
}


def _think_range(text: str) -> tuple[float, float]:
    """``"1-4"`` -> (1.0, 4.0); a single number is a fixed think time."""
    low, _, high = text.partition("-")
    return float(low), float(high or low)


THINK_S = _think_range(_env("FAIRLANE_THINK_S", "1-4"))


def _weight(name: str, default: int) -> int:
    return int(_env(f"FAIRLANE_WEIGHT_{name}", str(default)))


# The request shapes, as bench groups so the seeded generator of `fairlane bench` makes the
# prompts (token counts are exact for extproc.core.prompt, approximate for a real tokenizer).
INTERACTIVE = Group(
    name="locust-interactive",
    api_key=KEYS["interactive"],
    tenant="chat-app",
    tier="interactive",
    prompt_tokens=Dist("lognormal", median=64, sigma=0.5, low=16, high=256),
    max_tokens=Dist("uniform", low=32, high=128),
    stream=True,
)
API = Group(
    name="locust-api",
    api_key=KEYS["api"],
    tenant="code-review",
    tier="api",
    prompt_tokens=Dist("uniform", low=256, high=1024),
    max_tokens=Dist("uniform", low=64, high=256),
    stream=False,
)
BATCH = Group(
    name="locust-batch",
    api_key=KEYS["batch"],
    tenant="nightly-batch",
    tier="batch",
    prompt_tokens=Dist("uniform", low=1024, high=3072),
    max_tokens=Dist("uniform", low=256, high=512),
    stream=True,
)
SHARED_PREFIX = Group(
    name="locust-shared-prefix",
    api_key=KEYS["interactive"],
    tenant="chat-app",
    tier="interactive",
    prompt_tokens=Dist("uniform", low=16, high=64),
    max_tokens=Dist("uniform", low=32, high=96),
    stream=True,
    shared_prefix=SharedPrefix(
        system_prompts=4, system_tokens=Dist("fixed", value=1024), turns=Dist("fixed", value=1)
    ),
)
CONVERSATION = Group(
    name="locust-conversation",
    api_key=KEYS["interactive"],
    tenant="chat-app",
    tier="interactive",
    prompt_tokens=Dist("uniform", low=16, high=64),
    max_tokens=Dist("uniform", low=32, high=96),
    stream=True,
    shared_prefix=SharedPrefix(
        system_prompts=4,
        system_tokens=Dist("fixed", value=1024),
        turns=Dist("uniform", low=2, high=6),
    ),
)


def request_bodies(group: Group, client: int, seed: int = SEED) -> Iterator[dict[str, Any]]:
    """The endless, seeded sequence of chat bodies one client of ``group`` sends."""
    for shape in workload.client_shapes(group, seed, client):
        body = workload.chat_body(shape, group, seed, MODEL)
        if not IGNORE_EOS:
            body.pop("ignore_eos", None)
        yield body


class StreamError(Exception):
    """A 200 stream that is not a complete OpenAI stream (the request counts as failed)."""


class ChatUser(FastHttpUser):
    """One client of a tier: sends its group's seeded requests, one at a time, in order.

    FastHttpUser rather than HttpUser: the same response times for about a quarter of the
    load generator's CPU, which matters on a small box that also runs the gateway.

    The classes:

    - ``InteractiveUser`` [4]: streaming chat, short prompts, a human's think time. Besides the
      request itself (``POST interactive``, time = the whole stream) it reports ``TTFT
      interactive`` (time to the first content token) and ``ITL interactive`` (the stream's mean
      gap between content tokens) as their own rows in locust's stats and CSV.
    - ``ApiUser`` [2]: non-streamed completions of medium prompts, a program's short pauses.
    - ``BatchUser`` [2]: large prompts, long outputs, no pause at all (many run side by side).
    - ``SharedPrefixUser`` [1]: single chat turns that start with one of a few long system
      prompts shared by every user (prefix-affinity routing).
    - ``ConversationUser`` [1]: multi-turn chats over those system prompts; each turn re-sends
      the whole history (sticky routing to the backend holding the conversation's prefix).

    Streaming classes report TTFT and ITL rows too. A request fails on a non-200 status, on a
    stream that ends without ``data: [DONE]`` (or carries an ``error`` event) and on a
    connection error.

    Environment variables (all optional):

    - ``FAIRLANE_MODEL``: the model name sent (default ``sim-llama-8b``, the simulators').
    - ``FAIRLANE_KEY_INTERACTIVE``, ``FAIRLANE_KEY_API``, ``FAIRLANE_KEY_BATCH``: the bearer key
      of each tier (defaults: the demo keys ``sk-chat-demo``, ``sk-api-demo``,
      ``sk-batch-demo``). The shared-prefix and conversation users use the interactive key.
    - ``FAIRLANE_SEED``: the prompt seed (default 0).
    - ``FAIRLANE_THINK_S``: the interactive think time, ``MIN-MAX`` seconds (default ``1-4``).
    - ``FAIRLANE_IGNORE_EOS``: ``0`` leaves vLLM's ``ignore_eos`` out of the body (for an
      endpoint that rejects unknown fields, e.g. OpenAI's); default ``1`` (exact output
      lengths).
    - ``FAIRLANE_WEIGHT_INTERACTIVE``, ``_API``, ``_BATCH``, ``_SHARED_PREFIX``,
      ``_CONVERSATION``: override a class's weight; ``0`` leaves the class out.
    """

    abstract = True
    group: ClassVar[Group]
    tier: ClassVar[str]
    """The name of this class's rows in locust's stats (``POST <tier>``, ``TTFT <tier>``)."""
    network_timeout = 600.0
    connection_timeout = 10.0
    _clients: ClassVar[Iterator[int]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._clients = itertools.count()  # per class: user n of a class is client n

    def on_start(self) -> None:
        # Distributed runs: workers must not replay each other's clients.
        worker = getattr(self.environment.runner, "worker_index", 0) or 0
        self.client_number = worker * 1_000_000 + next(type(self)._clients)
        self.bodies = request_bodies(self.group, self.client_number)
        self.headers = {
            "Authorization": f"Bearer {self.group.api_key}",
            USER_HEADER: f"{self.group.name}-{self.client_number}",
        }

    @task
    def chat(self) -> None:
        body = next(self.bodies)
        if body.get("stream"):
            self.stream_chat(body)
        else:
            self.complete_chat(body)

    def complete_chat(self, body: dict[str, Any]) -> None:
        with self.client.post(
            CHAT_PATH,
            json=body,
            headers=self.headers,
            name=self.tier,
            catch_response=True,
        ) as response:
            if response.status_code != 200:
                response.failure(_status_error(response))
                return
            try:
                choices = json.loads(response.content or b"")["choices"]
                if not choices:
                    raise StreamError("no choices in the response")
            except (ValueError, KeyError, TypeError, StreamError) as exc:
                response.failure(f"bad completion: {exc}")

    def stream_chat(self, body: dict[str, Any]) -> None:
        """Read the SSE stream line by line, timing the first token and the gaps after it.

        locust times a ``stream=True`` request only to its headers, so the row's response
        time is set here to the whole stream; TTFT and ITL are fired as their own request
        types only for streams that completed, so failures do not skew them.
        """
        start = time.perf_counter()
        with self.client.post(
            CHAT_PATH,
            json=body,
            headers=self.headers,
            name=self.tier,
            stream=True,
            catch_response=True,
        ) as response:
            if response.status_code != 200:
                response.failure(_status_error(response))
                return
            try:
                token_times, size = _read_stream(response)
            except Exception as exc:  # reset, timeout, malformed event: a failed request
                response.request_meta["response_time"] = (time.perf_counter() - start) * 1000
                response.failure(exc)
                return
            total_ms = (time.perf_counter() - start) * 1000
            response.request_meta["response_time"] = total_ms
            response.request_meta["response_length"] = size
        if not token_times:
            return
        fire = self.environment.events.request.fire
        ttft_ms = (token_times[0] - start) * 1000
        fire(request_type="TTFT", name=self.tier, response_time=ttft_ms, response_length=0)
        if len(token_times) > 1:
            itl_ms = (token_times[-1] - token_times[0]) * 1000 / (len(token_times) - 1)
            fire(request_type="ITL", name=self.tier, response_time=itl_ms, response_length=0)


def _status_error(response: ResponseContextManager) -> Exception | str:
    """What a refused request reports: the connection error, or the status and the start of
    the body (fairlane's JSON error names the reason: queue full, deadline, bad key)."""
    error = getattr(response, "error", None)
    if response.status_code == 0 and isinstance(error, Exception):
        return error
    try:
        text = (response.content or b"")[:200].decode("utf-8", "replace")
    except Exception:  # a body that cannot be read: the status says enough
        text = ""
    return f"HTTP {response.status_code}: {text}"


def _read_stream(response: ResponseContextManager) -> tuple[list[float], int]:
    """The arrival time of every content chunk, and the bytes read; raises StreamError.

    geventhttpclient's ``readline`` returns each line as soon as it arrives, where
    ``iter_content`` would wait for a full chunk of bytes and blur the token timings.
    """
    raw = response._response
    if raw is None:
        raise StreamError("no response to read")
    times: list[float] = []
    size = 0
    while True:
        line = raw.readline(b"\n")
        if not line:
            raise StreamError("stream ended without data: [DONE]")
        size += len(line)
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return times, size
        event = json.loads(data)
        if "error" in event:
            raise StreamError(f"error event: {str(event['error'])[:200]}")
        for choice in event.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                times.append(time.perf_counter())
                break


class InteractiveUser(ChatUser):
    """A person in a chat UI: short prompts, streamed answers, reading time in between."""

    weight = _weight("INTERACTIVE", 4)
    group = INTERACTIVE
    tier = "interactive"
    wait_time = between(*THINK_S)


class ApiUser(ChatUser):
    """A program calling the API: medium prompts, whole answers, short pauses."""

    weight = _weight("API", 2)
    group = API
    tier = "api"
    wait_time = between(0.1, 0.5)


class BatchUser(ChatUser):
    """A batch job's worker: large prompts, long outputs, the next request at once."""

    weight = _weight("BATCH", 2)
    group = BATCH
    tier = "batch"
    wait_time = constant(0)


class SharedPrefixUser(ChatUser):
    """Chat turns opening with one of four long shared system prompts: the prefix-affinity
    routing case (the picker should send them where those blocks are cached)."""

    weight = _weight("SHARED_PREFIX", 1)
    group = SHARED_PREFIX
    tier = "shared-prefix"
    wait_time = between(*THINK_S)


class ConversationUser(ChatUser):
    """Multi-turn chats: each turn re-sends the system prompt and the history, so a
    conversation's prompt grows and should stick to the backend holding its prefix. The
    history's answers are seeded words of the length asked for, not the backend's answer,
    so the prompts are the same in every run."""

    weight = _weight("CONVERSATION", 1)
    group = CONVERSATION
    tier = "conversation"
    wait_time = between(*THINK_S)
