"""The seeded workload: what each group sends, and when, identical for every arm.

An A/B comparison is only fair if both arms get the same requests. Everything random here
(Poisson arrival times, prompt and output lengths, the prompt words) comes from
``random.Random`` seeded with a string built from the scenario seed, the group name and the
request's index (string seeds hash with SHA-512, so they do not depend on
``PYTHONHASHSEED``). Open-loop groups get a fixed list of arrival times; closed-loop clients
get a fixed sequence of request shapes (how many of them run depends on the arm's speed).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from extproc.prompt import count_tokens, render_chat
from loadtests.bench.scenario import Dist, Group

# Five-letter-or-shorter words are exactly one token each for extproc.prompt (" word").
_ALPHABET = "abcdefghijklmnopqrstuvwxyz"
# Tokens the chat template adds around a user message (measured with a one-token message:
# an empty one would merge the template's two newlines into one piece).
TEMPLATE_TOKENS = count_tokens(render_chat([{"role": "user", "content": "abc"}])) - 1


@dataclass(frozen=True)
class RequestShape:
    """One request's sizes (and for open loop its arrival, in simulated seconds)."""

    group: str
    index: int
    prompt_tokens: int
    max_tokens: int
    at_s: float | None = None
    client: int = 0


def sample(dist: Dist, rng: random.Random) -> int:
    if dist.kind == "fixed":
        return dist.value
    if dist.kind == "uniform":
        return rng.randint(dist.low, dist.high)
    value = dist.median * math.exp(rng.gauss(0.0, dist.sigma))
    return max(dist.low, min(dist.high, round(value)))


def _rng(seed: int, *parts: object) -> random.Random:
    return random.Random(":".join(str(p) for p in (seed, *parts)))


def shape(
    group: Group, seed: int, index: int, client: int = 0, at_s: float | None = None
) -> RequestShape:
    """The ``index``-th request of ``group`` (of one closed-loop ``client``)."""
    rng = _rng(seed, "shape", group.name, client, index)
    return RequestShape(
        group=group.name,
        index=index,
        prompt_tokens=sample(group.prompt_tokens, rng),
        max_tokens=sample(group.max_tokens, rng),
        at_s=at_s,
        client=client,
    )


def open_loop_schedule(group: Group, seed: int, end_s: float, cap: int) -> list[RequestShape]:
    """Poisson arrivals at ``group.rate`` between its start and ``min(stop, end_s)``."""
    assert group.rate is not None
    rng = _rng(seed, "arrivals", group.name)
    stop = min(group.stop_s if group.stop_s is not None else end_s, end_s)
    shapes: list[RequestShape] = []
    t = group.start_s
    while len(shapes) < cap:
        t += rng.expovariate(group.rate)
        if t >= stop:
            break
        shapes.append(shape(group, seed, len(shapes), at_s=t))
    return shapes


def prompt_text(prompt_tokens: int, seed: int, group: str, client: int, index: int) -> str:
    """User content whose chat rendering is ``prompt_tokens`` tokens (at least one word).

    Words are random, so prompts share no prefix blocks: prefix caching would otherwise
    make the flood's prefills nearly free and the comparison meaningless.
    """
    rng = _rng(seed, "text", group, client, index)
    words = max(1, prompt_tokens - TEMPLATE_TOKENS)
    return " ".join("".join(rng.choices(_ALPHABET, k=rng.randint(3, 5))) for _ in range(words))


def chat_body(shape: RequestShape, group: Group, seed: int, model: str) -> dict[str, object]:
    body: dict[str, object] = {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": prompt_text(
                    shape.prompt_tokens, seed, group.name, shape.client, shape.index
                ),
            }
        ],
        "max_tokens": shape.max_tokens,
        "ignore_eos": True,  # exact output lengths: the same work in both arms
        "stream": group.stream,
    }
    if group.stream:
        body["stream_options"] = {"include_usage": True}
    return body
